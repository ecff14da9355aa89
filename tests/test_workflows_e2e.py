"""The bundled workflows end to end on a real ComfyUI on the CPU: each UI file goes through
`h3-multigpu submit` (the pack's client) to a saved mp4 with a video and an audio stream.

    COMFYUI_PATH=/path/to/ComfyUI python -m pytest -q -m "comfyui and slow" \\
        -o addopts="--strict-markers" -s tests/test_workflows_e2e.py

The server gets this pack and tests/comfyui_nodes/h3_tiny_text_encoder in its custom_nodes and
a models folder (--extra-model-paths-config) with every file the workflows name, under the
official names, written by tests/e2e_models.py: a tiny INT8 ConvRot DiT, the full-size INT8 video
VAE and fp32 audio VAE (ComfyUI builds them at one size), tiny LoRAs, a small latent upscaler and
a tiny Qwen3-VL text encoder. The text encoder is the one stand-in: ComfyUI builds H3's encoder
at the fixed 32B size whatever the file holds, so the test node shrinks that configuration in
the test server (its docstring says exactly what it changes); everything else is the files and
the nodes as users get them. The clip is as small as the graphs allow: PASS1 32x32, PASS2 64x64,
5 frames (--seconds 0.1), one step per pass.

H3_E2E_MODELS=DIR keeps the written models in DIR for the next run (2.8 GB, most of it the video
VAE); otherwise they are written to a temporary folder and removed. The wall time of each
workflow is printed and recorded as the test's `wall_s` property.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from comfyui_harness import start_comfyui
from e2e_models import TINY_TE_NODE
from workflow_bed import tiny_png

from h3_multigpu.cli import main as cli_main
from h3_multigpu.client import ui_to_api

pytestmark = [pytest.mark.comfyui, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / "workflows"
NAMES = ("h3_multigpu_two_pass_t2v", "h3_multigpu_two_pass_i2v", "h3_multigpu_two_pass_r2v")
FOLDERS = ("diffusion_models", "text_encoders", "vae", "loras", "latent_upscale_models")
TINY_RUN = ["--pass1-size", "32x32", "--pass2-size", "64x64", "--seconds", "0.1",
            "--pass1-steps", "1", "--pass2-steps", "1"]
# The placement node keeps its shipped devices="auto": on this CPU server it passes the models
# through, says NOT ACTIVE and the graph runs on ComfyUI's defaults.
FRAMES, SIZE = 5, (64, 64)


def _write_models(models: Path) -> None:
    if (models / "vae" / "minimax_h3_video_vae_int8_convrot.safetensors").is_file():
        return  # a kept folder (H3_E2E_MODELS) from an earlier run
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT.parent), *filter(None, [os.environ.get("PYTHONPATH")])])}
    run = subprocess.run([sys.executable, str(Path(__file__).parent / "e2e_models.py"),
                          str(models)], env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.fixture(scope="module")
def server():
    """(url, log path) of a ComfyUI with the pack, the tiny text encoder node and the models."""
    kept = os.environ.get("H3_E2E_MODELS")
    work = Path(tempfile.mkdtemp(prefix="h3-e2e-"))
    models = Path(kept) if kept else work / "models"
    try:
        _write_models(models)
        config = work / "extra_model_paths.yaml"
        config.write_text("\n".join(["h3_e2e:", f"  base_path: {models}",
                                     *(f"  {f}: {f}" for f in FOLDERS)]) + "\n")
        inputs = work / "input"
        inputs.mkdir()
        (inputs / "example.png").write_bytes(tiny_png(64, 48))
        log = work / "comfyui.log"
        extra = ("--extra-model-paths-config", str(config), "--input-directory", str(inputs))
        with start_comfyui(os.environ["COMFYUI_PATH"], extra_args=extra, log_path=log,
                           custom_nodes={"h3_tiny_text_encoder": TINY_TE_NODE}) as url:
            yield url, log
    finally:
        shutil.rmtree(work, ignore_errors=True)  # models too, unless H3_E2E_MODELS keeps them


def _events(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _streams(path: Path) -> dict:
    import av  # PyAV, what ComfyUI saves videos with

    with av.open(str(path)) as container:
        video = next(s for s in container.streams if s.type == "video")
        audio = [s for s in container.streams if s.type == "audio"]
        frames = sum(1 for _ in container.decode(video=0))
        return {"size": (video.codec_context.width, video.codec_context.height),
                "frames": frames, "audio": [(a.codec_context.name, a.codec_context.sample_rate)
                                            for a in audio]}


# The UI files, and one API twin (its inputs 0.33.0 does not declare are ignored there) with
# another seed, so that the stages after the loaders run again instead of coming from the cache.
RUNS = [(f"{name}.json", []) for name in NAMES] + [
    ("api/h3_multigpu_two_pass_t2v.json", ["--seed", "7"])]


def _pack_status(url: str) -> str:
    """The drop-in node's status text of the newest finished prompt, as the server shows it."""
    with urllib.request.urlopen(url + "/history?max_items=1", timeout=60) as response:
        history = json.load(response)
    for entry in history.values():
        for output in entry.get("outputs", {}).values():
            for text in output.get("text", []):
                if isinstance(text, str) and text.startswith("H3 Multi-GPU:"):
                    return text
    return f"no status in {history}"


@pytest.mark.parametrize(("name", "more"), RUNS, ids=[r[0] for r in RUNS])
def test_the_workflow_runs_to_a_video_with_audio(server, name, more, tmp_path,
                                                 record_property):
    url, log = server
    out = io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stdout(out):
        code = cli_main(["submit", str(WORKFLOWS / name), "--server", url, *TINY_RUN, *more,
                         "--out", str(tmp_path), "--timeout", "1800", "--json"])
    wall_s = time.monotonic() - t0
    events = _events(out.getvalue())
    failure = [e for e in events if e["event"] == "error"]
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-60:])
        pytest.fail(f"submit exited {code}: {failure}\nserver log:\n{tail}")
    # every stage ran (or was cached from the previous workflow's identical node)
    prompt = json.loads((WORKFLOWS / name).read_text())
    if "nodes" in prompt:
        with urllib.request.urlopen(url + "/object_info", timeout=60) as response:
            prompt = ui_to_api(prompt, json.load(response))
    executed = {e["title"] for e in events if e["event"] == "executing"}
    executed |= {prompt[i]["_meta"]["title"] for e in events if e["event"] == "cached"
                 for i in e["nodes"] if i in prompt}
    for title in ("Text Encoder", "Turbo LoRA", "Multi-GPU Placement", "PASS1 Sampler",
                  "Latent Upscale", "PASS2 Sampler", "Decode Video", "Decode Audio",
                  "Save Video"):
        assert title in executed, (title, sorted(executed))
    videos = [p for p in tmp_path.iterdir() if p.suffix == ".mp4"]
    assert len(videos) == 1, list(tmp_path.iterdir())
    streams = _streams(videos[0])
    assert streams["size"] == SIZE and streams["frames"] == FRAMES, streams
    assert len(streams["audio"]) == 1 and streams["audio"][0][1] > 0, streams
    status = _pack_status(url)
    assert status.startswith("H3 Multi-GPU: NOT ACTIVE: this server has no GPU that ComfyUI "
                             "computes on"), status
    assert "graph: 2 sampling passes with this pack's H3 Latent Upscale between them" in status
    record_property("wall_s", round(wall_s, 1))
    print(f"\n{name}: {wall_s:.1f} s wall, {streams}")
