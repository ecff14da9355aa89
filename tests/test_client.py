"""The submission client against the loopback fake server: one scripted failure per test."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from fake_comfy_server import FakeComfyServer, Scenario

from h3_multigpu.cli import main as cli_main
from h3_multigpu.client import (
    ComfyClient,
    ExecutionFailed,
    PromptRejected,
    RunTimeout,
    Target,
    WorkflowError,
    submit,
)


def h3_graph(steps: int = 3) -> dict:
    """A small API graph titled like the bundled workflows (workflows/api/*.json)."""

    def node(class_type: str, title: str, **inputs):
        return {"class_type": class_type, "inputs": inputs, "_meta": {"title": title}}

    return {
        "1": node("UNETLoader", "Diffusion Model", unet_name="minimax_h3_fl2va.safetensors",
                  weight_dtype="default"),
        "2": node("LoraLoaderModelOnly", "Turbo LoRA", model=["1", 0],
                  lora_name="minimax_h3_turbo_8step.safetensors", strength_model=1.0),
        "3": node("CLIPLoader", "Text Encoder", clip_name="qwen3vl_h3.safetensors",
                  type="minimax"),
        "4": node("PrimitiveStringMultiline", "Prompt", value="a fox"),
        "5": node("CLIPTextEncode", "PASS1 Conditioning", text=["4", 0], clip=["3", 0]),
        "6": node("PrimitiveFloat", "Seconds", value=5.0),
        "7": node("PrimitiveInt", "Seed", value=42),
        "8": node("PrimitiveInt", "PASS1 Width", value=864),
        "9": node("PrimitiveInt", "PASS1 Height", value=480),
        "10": node("EmptyMiniMaxH3LatentAV", "Empty Latent", width=["8", 0], height=["9", 0],
                   length=124),
        "11": node("KSampler", "PASS1 Sampler", model=["2", 0], seed=["7", 0],
                   steps=["12", 0], cfg=1.0, sampler_name="res_multistep", scheduler="simple",
                   positive=["5", 0], negative=["5", 0], latent_image=["10", 0], denoise=1.0),
        "12": node("PrimitiveInt", "PASS1 Steps", value=steps),
        "13": node("VAELoader", "Video VAE", vae_name="minimax_h3_video_vae.safetensors"),
        "14": node("VAEDecode", "Decode Video", samples=["11", 0], vae=["13", 0]),
        "15": node("CreateVideo", "Create Video", images=["14", 0], fps=24.0),
        "16": node("SaveVideo", "Save Video", video=["15", 0], filename_prefix="video/h3",
                   format="auto", codec="auto"),
    }


def run(fake: FakeComfyServer, tmp_path: Path, graph: dict | None = None, **kwargs):
    events: list[dict] = []
    on_event = kwargs.pop("on_event", events.append)
    retries = kwargs.pop("retries", 4)
    kwargs.setdefault("timeout_s", 20)  # a broken client fails the test instead of hanging CI
    client = ComfyClient(fake.url, retries=retries, backoff_s=0.01, timeout_s=5,
                         on_event=on_event)
    paths = submit(graph or h3_graph(), params=kwargs.pop("params", None), out_dir=tmp_path,
                   on_event=on_event, client=client, poll_s=0.2, **kwargs)
    return paths, events


def kinds(events: list[dict]) -> list[str]:
    return [e["event"] for e in events]


def test_success_patches_params_reports_progress_and_downloads_the_video(tmp_path):
    with FakeComfyServer() as fake:
        params = {"prompt": "a red fox", "seed": 7, "seconds": 10, "turbo": False,
                  "pass1_size": "1312x736"}
        paths, events = run(fake, tmp_path, params=params)
    assert [p.name for p in paths] == ["h3_00001_.mp4"]
    assert paths[0].read_bytes() == fake.scenario.video_bytes
    assert len(fake.prompts_received) == 1
    body = fake.prompts_received[0]
    sent = body["prompt"]
    assert sent["4"]["inputs"]["value"] == "a red fox"
    assert sent["7"]["inputs"]["value"] == 7
    assert sent["6"]["inputs"]["value"] == 10
    assert (sent["8"]["inputs"]["value"], sent["9"]["inputs"]["value"]) == (1312, 736)
    assert "2" not in sent and sent["11"]["inputs"]["model"] == ["1", 0]  # --no-turbo
    queued = next(e for e in events if e["event"] == "queued")
    assert body["prompt_id"] == queued["prompt_id"] and body["client_id"] == queued["client_id"]
    progress = [e for e in events if e["event"] == "progress"]
    assert [(e["value"], e["max"]) for e in progress] == [(1, 3), (2, 3), (3, 3)]
    assert {e["title"] for e in progress} == {"PASS1 Sampler"}
    assert progress[-1]["eta_s"] == 0
    assert kinds(events)[-1] == "done"


def test_400_prints_node_errors_and_is_not_retried(tmp_path):
    node_errors = {"11": {"errors": [{"type": "value_not_in_list", "message": "Value not in list",
                                     "details": "sampler_name: 'dpm' not in ['euler']"}],
                          "dependent_outputs": ["16"], "class_type": "KSampler"}}
    with FakeComfyServer(Scenario(node_errors=node_errors)) as fake:
        with pytest.raises(PromptRejected) as info:
            run(fake, tmp_path)
    assert fake.post_attempts == 1
    message = str(info.value)
    assert "node #11 'PASS1 Sampler' (KSampler)" in message
    assert "Value not in list: sampler_name: 'dpm' not in ['euler']" in message


def test_503_is_retried_and_the_prompt_runs_once(tmp_path):
    with FakeComfyServer(Scenario(post_failures=[503, 502])) as fake:
        paths, events = run(fake, tmp_path)
    assert fake.post_attempts == 3
    assert len(fake.prompts_received) == 1
    assert [e["error"] for e in events if e["event"] == "retry"] == ["HTTP 503", "HTTP 502"]
    assert len(paths) == 1


def test_lost_post_response_is_reconciled_not_resubmitted(tmp_path):
    with FakeComfyServer(Scenario(drop_post_response=True, step_s=0.05)) as fake:
        paths, events = run(fake, tmp_path)
    assert fake.post_attempts == 1, "the client posted the same prompt twice"
    assert len(fake.prompts_received) == 1
    reconciled = next(e for e in events if e["event"] == "reconciled")
    assert reconciled["found_in"] in ("pending", "running", "history")
    assert paths[0].read_bytes() == fake.scenario.video_bytes


def test_websocket_drop_reconnects_with_same_client_id_and_reads_history(tmp_path):
    # The socket dies at step 1 and the server refuses new ones while the run finishes, so
    # the end of the run is only visible through /history.
    scenario = Scenario(drop_ws_at_step=1, ws_refuse_s=0.3, step_s=0.02)
    with FakeComfyServer(scenario) as fake:
        paths, events = run(fake, tmp_path, retries=8)  # backoff 0.01 s doubling: 2.5 s in all
    assert "ws_reconnect" in kinds(events)
    client_id = next(e for e in events if e["event"] == "queued")["client_id"]
    assert len(fake.ws_client_ids) >= 2 and set(fake.ws_client_ids) == {client_id}
    assert len(fake.prompts_received) == 1
    assert paths[0].read_bytes() == fake.scenario.video_bytes


def test_ctrl_c_interrupts_the_running_prompt(tmp_path):
    def press_ctrl_c(event):
        events.append(event)
        if event["event"] == "progress":
            raise KeyboardInterrupt

    events: list[dict] = []
    with FakeComfyServer(Scenario(step_s=0.05)) as fake:
        with pytest.raises(KeyboardInterrupt):
            run(fake, tmp_path, graph=h3_graph(steps=50), on_event=press_ctrl_c)
        prompt_id = fake.prompts_received[0]["prompt_id"]
        assert fake.interrupts == [{"prompt_id": prompt_id}]
        assert fake.queue_deletes == []
        deadline = time.monotonic() + 3
        while prompt_id not in fake.history and time.monotonic() < deadline:
            time.sleep(0.02)
        assert fake.history[prompt_id]["status"]["status_str"] == "error"
    cancelled = next(e for e in events if e["event"] == "cancelled")
    assert cancelled["action"] == "interrupted on the server"
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_while_queued_removes_the_prompt_from_the_queue(tmp_path):
    def press_ctrl_c(event):
        events.append(event)
        if event["event"] == "queued":
            raise KeyboardInterrupt

    events: list[dict] = []
    with FakeComfyServer(Scenario(hold_pending=True)) as fake:
        with pytest.raises(KeyboardInterrupt):
            run(fake, tmp_path, on_event=press_ctrl_c)
        assert fake.queue_deletes == [fake.prompts_received[0]["prompt_id"]]
        assert fake.interrupts == []
        assert fake.queue()["queue_pending"] == []
    assert next(e for e in events if e["event"] == "cancelled")["action"] == (
        "removed from the queue")


def test_timeout_cancels_the_prompt(tmp_path):
    with FakeComfyServer(Scenario(hold_pending=True)) as fake:
        # the prompt stays pending, so only the deadline ends the run: 2 s leaves the POST and
        # the queue check room on a loaded 2-CPU machine (0.3 s did not always)
        with pytest.raises(RunTimeout, match="removed from the queue"):
            run(fake, tmp_path, timeout_s=2.0)
        assert fake.queue_deletes == [fake.prompts_received[0]["prompt_id"]]


def test_history_written_after_execution_success_is_waited_for(tmp_path):
    with FakeComfyServer(Scenario(history_delay_s=0.4)) as fake:
        paths, events = run(fake, tmp_path)
    assert "history_wait" in kinds(events)
    assert paths[0].read_bytes() == fake.scenario.video_bytes


def test_existing_output_file_is_never_overwritten(tmp_path):
    (tmp_path / "h3_00001_.mp4").write_bytes(b"an earlier video")
    with FakeComfyServer() as fake:
        paths, _ = run(fake, tmp_path)
    assert (tmp_path / "h3_00001_.mp4").read_bytes() == b"an earlier video"
    assert paths == [tmp_path / "h3_00001__1.mp4"]
    assert paths[0].read_bytes() == fake.scenario.video_bytes


def test_truncated_download_is_detected_and_fetched_again(tmp_path):
    with FakeComfyServer(Scenario(truncate_view_once=True)) as fake:
        paths, events = run(fake, tmp_path)
    assert paths[0].read_bytes() == fake.scenario.video_bytes
    assert any(e["event"] == "retry" and "download" in e["what"] for e in events)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h3_00001_.mp4"]


def test_execution_error_names_node_exception_and_inputs(tmp_path):
    with FakeComfyServer(Scenario(error_node="11")) as fake:
        with pytest.raises(ExecutionFailed) as info:
            run(fake, tmp_path)
    message = str(info.value)
    assert "node #11 'PASS1 Sampler' (KSampler) failed" in message
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.18 GiB" in message
    assert "sampler_name='res_multistep'" in message  # the node's own inputs
    assert "values seen by the node: steps=[3]" in message  # the server's current_inputs


def test_every_problem_is_reported_before_anything_is_submitted(tmp_path):
    graph = h3_graph()
    graph["1"]["inputs"]["unet_name"] = "minimax_h3_fl2va_int8.safetensors"
    graph["8"]["inputs"]["value"], graph["9"]["inputs"]["value"] = 1296, 720
    graph["10"]["inputs"]["length"] = 125
    graph["14"]["class_type"] = "VAEDecodeTiledH3"
    targets = {"seed": Target("Noise Seed", "value")}
    with FakeComfyServer() as fake:
        with pytest.raises(WorkflowError) as info:
            run(fake, tmp_path, graph, params={"seed": 3, "pass2_size": "1300x736"},
                targets=targets)
    assert fake.post_attempts == 0 and fake.ws_client_ids == []
    problems = [str(p) for p in info.value.problems]
    assert len(problems) == 6, problems
    text = "\n".join(problems)
    assert "no node is titled 'Noise Seed'; titles in this graph: Create Video, Decode" in text
    assert "--pass2-size: canvas 1300x736 is not valid for H3" in text
    assert ("node #8 'PASS1 Width' (PrimitiveInt) / node #9 'PASS1 Height' (PrimitiveInt): "
            "canvas 1296x720 is not valid for H3") in text
    assert "node #1 'Diffusion Model' (UNETLoader): input 'unet_name'" in text
    assert "did you mean 'minimax_h3_fl2va.safetensors'?" in text
    assert "node #10 'Empty Latent' (EmptyMiniMaxH3LatentAV): input 'length'" in text
    assert "use 124 or 141" in text
    assert "class 'VAEDecodeTiledH3' is not installed" in text


def test_cli_json_mode_prints_one_event_per_line(tmp_path, capsys):
    workflow = tmp_path / "wf.json"
    workflow.write_text(json.dumps(h3_graph()))
    out = tmp_path / "out"
    with FakeComfyServer() as fake:
        code = cli_main(["submit", str(workflow), "--server", fake.url, "--json", "--seed", "9",
                         "--out", str(out), "--timeout", "20"])
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[-1]["event"] == "done"
    assert lines[-1]["paths"] == [str(out / "h3_00001_.mp4")]
    assert fake.prompts_received[0]["prompt"]["7"]["inputs"]["value"] == 9


def test_cli_text_mode_exit_codes(tmp_path, capsys):
    workflow = tmp_path / "wf.json"
    workflow.write_text(json.dumps(h3_graph()))
    with FakeComfyServer() as fake:
        code = cli_main(["submit", str(workflow), "--server", fake.url, "--pass2-steps", "4",
                         "--out", str(tmp_path)])
        assert code == 2  # this graph has one pass: no node titled "PASS2 Steps"
        assert "no node is titled 'PASS2 Steps'" in capsys.readouterr().err
        code = cli_main(["submit", str(workflow), "--server", fake.url, "--pass2-steps", "4",
                         "--map", "pass2-steps=PASS1 Steps:value", "--out", str(tmp_path)])
        assert code == 0
        assert capsys.readouterr().out.strip() == str(tmp_path / "h3_00001_.mp4")
        assert fake.prompts_received[0]["prompt"]["12"]["inputs"]["value"] == 4
    code = cli_main(["submit", str(workflow), "--server", fake.url, "--out", str(tmp_path),
                     "--retries", "1"])
    assert code == 3  # the server is gone
    assert "is ComfyUI running at" in capsys.readouterr().err


def test_two_runs_in_parallel_keep_their_own_prompts(tmp_path):
    results: dict[int, list[Path]] = {}
    with FakeComfyServer() as fake:
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(
            i, run(fake, tmp_path / str(i))[0])) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
    assert len(fake.prompts_received) == 2
    assert sorted(len(paths) for paths in results.values()) == [1, 1]
