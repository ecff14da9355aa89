"""The README's install and command lines, run as a ComfyUI user runs them, with ComfyUI's own
Python (the one running this test) and nothing else installed for the pack.

    COMFYUI_PATH=/path/to/ComfyUI python -m pytest -m comfyui tests/test_readme_comfyui.py

The `git clone` line is stood in for by a copy of the tracked files (what a clone holds), into
a ComfyUI-like folder; every other line is taken from the README's code blocks as written, with
`python` meaning this interpreter. `submit --check` and `submit` then talk to a real ComfyUI of
COMFYUI_PATH with the pack, on loopback.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from comfyui_harness import start_comfyui

pytestmark = pytest.mark.comfyui

ROOT = Path(__file__).resolve().parents[1]
FOLDER = "custom_nodes/comfyui-h3-multigpu"


def _readme_commands() -> list[str]:
    """The shell lines of the README's code blocks (comments and Windows lines left out)."""
    text = (ROOT / "README.md").read_text()
    lines = []
    for block in re.findall(r"```(?:bash|sh|shell|console)?\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#") and "python_embeded" not in line:
                lines.append(line)
    return lines


def _clean_env() -> dict[str, str]:
    """This Python as ComfyUI runs it: the pack is not importable as an installed package."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


@pytest.fixture(scope="module")
def comfy_folder(tmp_path_factory) -> Path:
    """A ComfyUI folder holding the pack as the README's clone line puts it there."""
    home = tmp_path_factory.mktemp("user") / "ComfyUI"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    for name in files:
        source, target = ROOT / name, home / FOLDER / name
        if source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return home


def _run(line: str, cwd: Path) -> subprocess.CompletedProcess:
    words = shlex.split(line)
    assert words[0] == "python", line
    if words[1:4] == ["-m", "pip", "install"]:
        words.append("--no-index")  # offline: everything the pack needs is already satisfied
    return subprocess.run([sys.executable, *words[1:]], cwd=cwd, env=_clean_env(),
                          capture_output=True, text=True, timeout=300)


def test_the_readme_installs_and_plans_with_comfyuis_python(comfy_folder):
    commands = _readme_commands()
    clone = [c for c in commands if c.startswith("git clone")]
    assert clone and clone[0].endswith(FOLDER), clone  # the clone lands where ComfyUI looks
    assert "https://github.com/" in clone[0]
    pip = next(c for c in commands if c.startswith("python -m pip install -r"))
    assert pip.endswith(f"{FOLDER}/requirements.txt")
    done = _run(pip, comfy_folder)
    assert done.returncode == 0, done.stdout + done.stderr
    plan = next(c for c in commands if "h3-multigpu.py plan --profile" in c)
    done = _run(plan, comfy_folder)
    assert done.returncode == 0, done.stderr
    assert "fits" in done.stdout.splitlines()[0].lower() or "FIT" in done.stdout, done.stdout
    # the package that ran is the cloned folder, not an install
    probe = subprocess.run(
        [sys.executable, f"{FOLDER}/h3-multigpu.py", "--version"], cwd=comfy_folder,
        env=_clean_env(), capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0 and "h3-multigpu" in probe.stdout, probe


def _tiny_graph(path: Path) -> Path:
    """A graph of the pack's own nodes only: it runs on any server without model files."""
    graph = {
        "1": {"class_type": "H3MultiGPUPlan", "_meta": {"title": "Plan"},
              "inputs": {"pass2_width": 1312, "pass2_height": 736, "pass1_width": 864,
                         "pass1_height": 480, "seconds": 5.0, "devices": "2xR9700",
                         "lora_rank": 128}},
        "2": {"class_type": "H3MultiGPUShowText", "_meta": {"title": "Report"},
              "inputs": {"text": ["1", 1]}},
    }
    path.write_text(json.dumps(graph))
    return path


def test_submit_and_check_run_with_comfyuis_python(comfy_folder, tmp_path):
    launcher = f"{FOLDER}/h3-multigpu.py"
    graph = _tiny_graph(tmp_path / "graph.json")
    with start_comfyui(os.environ["COMFYUI_PATH"], python=sys.executable) as url:
        check = subprocess.run([sys.executable, launcher, "submit", str(graph), "--server", url,
                                "--check"], cwd=comfy_folder, env=_clean_env(),
                               capture_output=True, text=True, timeout=300)
        assert check.returncode == 0, check.stdout + check.stderr
        assert '"H3MultiGPUPlan"' in check.stdout  # the checked API prompt is printed
        run = subprocess.run([sys.executable, launcher, "submit", str(graph), "--server", url,
                              "--out", str(tmp_path / "out"), "--json", "--timeout", "240"],
                             cwd=comfy_folder, env=_clean_env(), capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
        assert any(e.get("event") == "done" for e in events), events[-5:]
