"""The submission client against a hostile server, a broken network and a careless user.

One test (or one parametrized family) per class of issue 13: double submission, deadlines,
cancel and signals, malformed server data, file names from the server, connections.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fake_comfy_server import TLS_CERT, FakeComfyServer, Scenario
from test_client import h3_graph

from h3_multigpu.cli import main as cli_main
from h3_multigpu.client import (
    ComfyClient,
    DownloadError,
    ExecutionFailed,
    RunTimeout,
    ServerProtocolError,
    submit,
)

JSON = "application/json"


def run(fake: FakeComfyServer, tmp_path: Path, graph: dict | None = None, *,
        client_kwargs: dict | None = None, **kwargs):
    events: list[dict] = []
    on_event = kwargs.pop("on_event", events.append)
    kwargs.setdefault("timeout_s", 20)  # a broken client fails the test instead of hanging CI
    client = ComfyClient(fake.url, **{"retries": 3, "backoff_s": 0.01, "timeout_s": 5,
                                      "on_event": on_event, **(client_kwargs or {})})
    paths = submit(graph or h3_graph(), out_dir=tmp_path, on_event=on_event, client=client,
                   poll_s=0.2, cancel_grace_s=5, **kwargs)
    return paths, events


def workflow_file(tmp_path: Path) -> Path:
    path = tmp_path / "wf.json"
    path.write_text(json.dumps(h3_graph()))
    return path


def cli(fake_url: str, tmp_path: Path, *extra: str) -> int:
    return cli_main(["submit", str(workflow_file(tmp_path)), "--server", fake_url,
                     "--out", str(tmp_path / "out"), "--retries", "1", *extra])


def ctrl_c_on(kind: str, events: list[dict]):
    def sink(event):
        events.append(event)
        if event["event"] == kind:
            raise KeyboardInterrupt

    return sink


# -- double submission -----------------------------------------------------------------------

def test_post_slower_than_its_timeout_is_watched_for_not_sent_again(tmp_path):
    # The server validates for 1.2 s, the POST gives up after 0.3 s: the prompt is being
    # queued while the client has no answer. Sending it again would queue it twice.
    with FakeComfyServer(Scenario(post_delay_s=1.2)) as fake:
        paths, events = run(fake, tmp_path, client_kwargs={"timeout_s": 0.3,
                                                           "post_timeout_s": 0.3})
    assert fake.post_attempts == 1 and len(fake.queued_ids) == 1
    assert "post_unanswered" in [e["event"] for e in events]
    assert next(e for e in events if e["event"] == "queued")["prompt_id"] == fake.queued_ids[0]
    assert paths[0].read_bytes() == fake.scenario.video_bytes


def test_a_server_that_assigns_its_own_prompt_id_is_followed(tmp_path):
    with FakeComfyServer(Scenario(own_prompt_ids=True)) as fake:
        paths, events = run(fake, tmp_path, timeout_s=10)
    theirs = fake.queued_ids[0]
    assert fake.prompts_received[0]["prompt_id"] != theirs
    assert next(e for e in events if e["event"] == "queued")["prompt_id"] == theirs
    assert any(e["event"] == "warning" and f"queued the prompt as {theirs}" in e["message"]
               for e in events)
    assert paths[0].read_bytes() == fake.scenario.video_bytes


def test_lost_answer_from_a_server_with_its_own_ids_is_found_not_queued_again(tmp_path):
    with FakeComfyServer(Scenario(own_prompt_ids=True, drop_post_response=True)) as fake:
        paths, events = run(fake, tmp_path, timeout_s=10)
    assert fake.post_attempts == 1 and len(fake.queued_ids) == 1
    reconciled = next(e for e in events if e["event"] == "reconciled")
    assert reconciled["prompt_id"] == fake.queued_ids[0]
    assert paths[0].read_bytes() == fake.scenario.video_bytes


def test_cancel_finds_a_prompt_queued_under_the_servers_own_id(tmp_path):
    events: list[dict] = []
    with FakeComfyServer(Scenario(own_prompt_ids=True, hold_pending=True)) as fake:
        with pytest.raises(KeyboardInterrupt):
            run(fake, tmp_path, on_event=ctrl_c_on("queued", events))
        assert fake.queue_deletes == fake.queued_ids
    assert next(e for e in events if e["event"] == "cancelled")["action"] == (
        "removed from the queue")


# -- deadlines -------------------------------------------------------------------------------

def test_one_deadline_covers_a_post_that_never_answers(tmp_path, capsys):
    with FakeComfyServer(Scenario(post_delay_s=25)) as fake:
        start = time.monotonic()
        code = cli(fake.url, tmp_path, "--timeout", "1.5")
        elapsed = time.monotonic() - start
    assert code == 124
    err = capsys.readouterr().err
    assert "--timeout 1.5 s passed" in err
    assert "its POST /prompt was never answered, so it may still appear" in err
    assert fake.post_attempts == 1
    assert elapsed < 15, elapsed  # a generous guard: the old client took 30 s per attempt


def test_a_view_that_never_answers_ends_at_the_deadline_listing_the_outputs(tmp_path):
    with FakeComfyServer(Scenario(view="hang")) as fake:
        start = time.monotonic()
        with pytest.raises(RunTimeout) as info:
            run(fake, tmp_path, timeout_s=2.0)
        elapsed = time.monotonic() - start
    message = str(info.value)
    assert "--timeout 2 s passed while download" in message
    assert "had finished; not downloaded: " + fake.url + "/view?filename=h3_00001_.mp4" in message
    assert elapsed < 12, elapsed
    assert list(tmp_path.iterdir()) == []


def test_a_view_that_streams_forever_stops_at_the_size_limit(tmp_path):
    with FakeComfyServer(Scenario(view="endless")) as fake:
        with pytest.raises(DownloadError, match="more than the download limit of 1,048,576"):
            run(fake, tmp_path, client_kwargs={"max_download_bytes": 1 << 20})
        assert fake.view_bytes_sent < 64 << 20
    assert list(tmp_path.iterdir()) == []  # the partial file is removed


def test_an_output_larger_than_the_limit_is_not_fetched(tmp_path):
    with FakeComfyServer() as fake:
        with pytest.raises(DownloadError, match="is 16,396 bytes, over the download limit of 1,"):
            run(fake, tmp_path, client_kwargs={"max_download_bytes": 1000})


@pytest.mark.parametrize("flags,fragment", [
    (["--timeout", "-1"], "argument --timeout: '-1' is not a positive number"),
    (["--timeout", "nan"], "argument --timeout: 'nan'"),
    (["--timeout", "inf"], "argument --timeout: 'inf'"),
    (["--retries", "-1"], "argument --retries: '-1' is not a whole number from 0 to 100"),
    (["--max-download", "0"], "argument --max-download: size '0'"),
])
def test_negative_or_endless_limits_are_refused(tmp_path, capsys, flags, fragment):
    with FakeComfyServer() as fake:
        assert cli(fake.url, tmp_path, *flags) == 2
        assert fake.post_attempts == 0
    assert fragment in capsys.readouterr().err


# -- cancel and signals ----------------------------------------------------------------------

def test_cancel_refused_with_403_is_reported_as_not_removed(tmp_path):
    events: list[dict] = []
    with FakeComfyServer(Scenario(hold_pending=True, forbid_cancel=True)) as fake:
        with pytest.raises(KeyboardInterrupt):
            run(fake, tmp_path, on_event=ctrl_c_on("queued", events))
        prompt_id = fake.queued_ids[0]
        assert fake.queue()["queue_pending"][0][1] == prompt_id  # still there
    action = next(e for e in events if e["event"] == "cancelled")["action"]
    assert action.startswith("NOT removed: POST /queue answered HTTP 403")
    assert f"remove prompt {prompt_id} from the ComfyUI queue" in action


def test_interrupt_refused_with_403_is_reported_as_not_interrupted(tmp_path):
    events: list[dict] = []
    with FakeComfyServer(Scenario(step_s=0.05, forbid_cancel=True)) as fake:
        with pytest.raises(KeyboardInterrupt):
            run(fake, tmp_path, graph=h3_graph(steps=40), on_event=ctrl_c_on("progress", events))
        fake.interrupt_flag = True  # let the fake's worker finish quickly
    action = next(e for e in events if e["event"] == "cancelled")["action"]
    assert action.startswith("NOT interrupted: POST /interrupt answered HTTP 403")


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM cannot be caught on Windows")
def test_sigterm_cancels_the_queued_prompt_and_prints_its_id(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    with FakeComfyServer(Scenario(hold_pending=True)) as fake:
        proc = subprocess.Popen(
            [sys.executable, "-m", "h3_multigpu", "submit", str(workflow_file(tmp_path)),
             "--server", fake.url, "--out", str(tmp_path / "out")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            deadline = time.monotonic() + 60
            while not fake.queued_ids and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.05)
            assert fake.queued_ids, proc.communicate(timeout=5)
            proc.terminate()  # SIGTERM, as `timeout` and CI runners send
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        prompt_id = fake.queued_ids[0]
        assert fake.queue_deletes == [prompt_id]
    assert proc.returncode == 143, err
    assert f"SIGTERM: prompt {prompt_id} removed from the queue" in err
    assert "Traceback" not in err


def test_a_broadcast_success_without_prompt_id_is_not_our_end(tmp_path):
    scenario = Scenario(hold_pending=True,
                        ws_extra=['{"type": "execution_success", "data": {}}'])
    with FakeComfyServer(scenario) as fake:
        threading.Timer(1.0, fake.release).start()
        paths, events = run(fake, tmp_path, history_timeout_s=0.5)
    assert paths[0].read_bytes() == fake.scenario.video_bytes
    assert "started" in [e["event"] for e in events]


# -- malformed server data -------------------------------------------------------------------

HTML = (200, "text/html", b"<html><body>Please log in</body></html>")


@pytest.mark.parametrize("scenario,fragment", [
    (Scenario(replies={"/object_info": HTML}),
     "GET /object_info at {url} answered text/html that is not JSON ('<html>"),
    (Scenario(replies={"/object_info": (200, JSON, b"[1, 2]")}),
     "GET /object_info at {url} answered a JSON list where ComfyUI answers a JSON object"),
    (Scenario(replies={"/object_info": (200, JSON, b"42")}),
     "GET /object_info at {url} answered a JSON number"),
])
def test_malformed_answers_before_queueing_exit_4_naming_endpoint_and_server(
        tmp_path, capsys, scenario, fragment):
    with FakeComfyServer(scenario) as fake:
        assert cli(fake.url, tmp_path) == 4
        assert fake.post_attempts == 0
    err = capsys.readouterr().err
    assert fragment.format(url=fake.url) in err and "Traceback" not in err


@pytest.mark.parametrize("reply,fragment", [
    (HTML, "POST /prompt at {url} answered text/html that is not JSON"),
    ((200, JSON, b'{"prompt_id": 5, "number": 0}'), "POST /prompt at {url} answered without a "
                                                    "prompt_id"),
    ((200, JSON, b'["queued"]'), "POST /prompt at {url} answered a JSON list"),
])
def test_malformed_post_answer_cancels_the_queued_prompt_and_prints_its_id(
        tmp_path, capsys, reply, fragment):
    with FakeComfyServer(Scenario(hold_pending=True, post_reply=reply)) as fake:
        assert cli(fake.url, tmp_path) == 4
        prompt_id = fake.queued_ids[0]
        assert fake.queue_deletes == [prompt_id]
    err = capsys.readouterr().err
    assert fragment.format(url=fake.url) in err
    assert f"prompt {prompt_id}: removed from the queue" in err


def test_history_outputs_of_the_wrong_shape_exit_4_with_the_prompt_id(tmp_path, capsys):
    def outputs_as_list(entry):
        entry["outputs"] = [entry["outputs"]]
        return entry

    with FakeComfyServer(Scenario(history_hook=outputs_as_list)) as fake:
        assert cli(fake.url, tmp_path) == 4
        prompt_id = fake.queued_ids[0]
    err = capsys.readouterr().err
    assert "the history entry's 'outputs' is a list" in err
    assert f"prompt {prompt_id} had finished" in err


def test_queue_entries_of_the_wrong_shape_name_the_endpoint_and_the_prompt(tmp_path, capsys):
    def broken(answer):
        return {"queue_running": [["only-one-field"]], "queue_pending": "none"}

    scenario = Scenario(drop_post_response=True, hold_pending=True, queue_hook=broken)
    with FakeComfyServer(scenario) as fake:
        assert cli(fake.url, tmp_path) == 4
        prompt_id = fake.queued_ids[0]
        assert fake.post_attempts == 1
    err = capsys.readouterr().err
    assert f"GET /queue at {fake.url}: an entry of 'queue_running' is ['only-one-field']" in err
    assert f"cancel prompt {prompt_id} from the ComfyUI queue" in err


def test_malformed_websocket_messages_are_survived(tmp_path):
    scenario = Scenario(ws_extra=[
        "not json at all", "[1, 2, 3]", '{"type": "executing", "data": "node 5"}',
        '{"type": "progress", "data": {"value": null, "max": 8, "prompt_id": "{prompt_id}"}}',
        '{"type": "progress", "data": {"value": "3", "max": 8, "prompt_id": "{prompt_id}"}}',
        '{"type": "status", "data": {"status": "busy"}}',
        '{"type": "executed", "data": {"node": "16", "output": [1], "prompt_id": "{prompt_id}"}}',
    ])
    with FakeComfyServer(scenario) as fake:
        paths, events = run(fake, tmp_path)
    assert paths[0].read_bytes() == fake.scenario.video_bytes
    warnings = [e for e in events if e["event"] == "warning"]
    assert len(warnings) == 1 and "not ComfyUI's" in warnings[0]["message"]
    assert [(e["value"], e["max"]) for e in events if e["event"] == "progress"] == [
        (1, 3), (2, 3), (3, 3)]


def test_execution_error_with_the_traceback_as_one_string(tmp_path):
    with FakeComfyServer(Scenario(error_node="11", traceback_as_string=True)) as fake:
        with pytest.raises(ExecutionFailed) as info:
            run(fake, tmp_path)
    message = str(info.value)
    assert "    RuntimeError: CUDA out of memory" in message
    assert '    File "execution.py", line 1' in message


# -- file names from the server --------------------------------------------------------------

def test_odd_file_names_are_sanitised_skipped_and_listed(tmp_path, capsys):
    names = ["a\nb.mp4", "c\x00d.mp4", "x" * 300 + ".mp4", ".", 12345, "../../escape.mp4",
             "good.mp4"]
    with FakeComfyServer(Scenario(file_names=names)) as fake:
        assert cli(fake.url, tmp_path) == 1
    err = capsys.readouterr().err
    out = tmp_path / "out"
    saved = sorted(p.name for p in out.iterdir())
    assert saved == sorted(["a_b.mp4", "c_d.mp4", "x" * 196 + ".mp4", "escape.mp4",
                            "good.mp4"])
    assert all(p.read_bytes() == fake.scenario.video_bytes for p in out.iterdir())
    assert "skipped node #16: its file name '.' is not a file name" in err
    assert "skipped node #16: its file name is 12345, not text" in err
    saved_lines = [line.split("saved: ", 1)[1] for line in err.splitlines() if "saved: " in line]
    assert sorted(Path(line).name for line in saved_lines) == saved  # one path per line
    assert not (tmp_path / "escape.mp4").exists()


# -- connections -----------------------------------------------------------------------------

def test_basic_auth_from_the_server_url_and_the_password_never_echoed(tmp_path, capsys):
    with FakeComfyServer(auth=("ann", "s3cr:et@")) as fake:
        good = fake.url.replace("http://", "http://ann:s3cr%3Aet%40@")
        assert cli(good, tmp_path, "--json") == 0
        assert fake.auth_failures == 0 and len(fake.queued_ids) == 1
        out = capsys.readouterr().out
        assert json.loads(out.splitlines()[-1])["event"] == "done"
        bad = fake.url.replace("http://", "http://ann:wrong-s3cr@")
        assert cli(bad, tmp_path) == 3
        err = capsys.readouterr().err
        assert f"{fake.url} refused the user and password given in --server (HTTP 401)" in err
        assert cli(fake.url, tmp_path) == 3
        assert "asks for a login (HTTP 401)" in capsys.readouterr().err
    assert cli("http://ann:s3cr3t@127.0.0.1:99999", tmp_path) == 2
    err = capsys.readouterr().err
    assert "a port outside 1-65535" in err and "s3cr" not in out + err
    assert "http://ann:***@127.0.0.1:99999" in err


def test_https_with_a_self_signed_certificate(tmp_path, capsys):
    with FakeComfyServer(tls=True) as fake:
        assert fake.url.startswith("https://")
        assert cli(fake.url, tmp_path) == 3
        err = capsys.readouterr().err
        assert f"the TLS certificate of {fake.url} is not trusted" in err
        assert "--ca-bundle FILE" in err and "--insecure" in err
        assert fake.post_attempts == 0
        assert cli(fake.url, tmp_path, "--ca-bundle", str(TLS_CERT)) == 0
        assert cli(fake.url, tmp_path, "--insecure") == 0
        assert len(fake.queued_ids) == 2
    capsys.readouterr()
    assert cli(fake.url, tmp_path, "--ca-bundle", str(tmp_path / "none.pem")) == 2
    assert "is not a file" in capsys.readouterr().err


@pytest.mark.parametrize("server,fragment", [
    ("http://127.0.0.1:99999", "a port outside 1-65535"),
    ("http://127.0.0.1:0", "has port 0"),
    ("ftp://127.0.0.1:8188", "is not an http(s) URL"),
    ("http://", "names no host"),
    ("http://127.0.0.1:8188/?x=1", "has a query or fragment"),
    ("", "--server is empty"),
])
def test_server_urls_are_validated_before_any_connection(tmp_path, capsys, server, fragment):
    assert cli(server, tmp_path) == 2
    assert fragment in capsys.readouterr().err


def test_api_errors_are_server_protocol_errors_not_workflow_errors():
    with FakeComfyServer(Scenario(replies={"/object_info": (404, "text/plain", b"nope")})) as fk:
        with pytest.raises(ServerProtocolError, match="is not found at"):
            ComfyClient(fk.url, retries=0).object_info()


def test_object_info_with_malformed_classes_is_the_servers_fault(tmp_path, capsys):
    broken = {"KSampler": {"input": {"required": ["seed", "steps"]}}}
    scenario = Scenario(replies={"/object_info": (200, JSON, json.dumps(broken).encode())})
    with FakeComfyServer(scenario) as fake:
        assert cli(fake.url, tmp_path) == 4
    assert "node class 'KSampler': its 'required' inputs are ['seed', 'steps'], not an object" \
        in capsys.readouterr().err
