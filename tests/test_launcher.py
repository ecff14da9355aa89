"""`h3-multigpu.py`: the command line from a git clone in custom_nodes, run with ComfyUI's
Python, nothing installed but the requirements.

The checkout is copied to TMP/custom_nodes/comfyui-h3-multigpu (a folder name Python cannot
import). A fresh venv stands for ComfyUI's Python: it reaches torch and the other requirements
through a .pth file of plain paths, so the running environment's editable install of this
checkout is not processed there and `import h3_multigpu` fails in it (checked first).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "*.egg-info",
                                     "__pycache__", ".pytest_cache", ".ruff_cache",
                                     "node_modules", ".carry", ".whl")
REQUIREMENT_MODULES = ("torch", "numpy", "safetensors", "websocket", "comfy_kitchen")
PLAN = ["plan", "--profile", "2xR9700", "--width", "1312", "--height", "736", "--seconds", "15"]
# Runs the launcher as `python SCRIPT ARGS` does (the script's folder first on sys.path), then
# says which package it imported and where a top-level `nodes` (ComfyUI's) would come from.
PROBE = r"""
import importlib.util, os, runpy, sys
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(script)
try:
    runpy.run_path(script, run_name="__main__")
finally:
    nodes = importlib.util.find_spec("nodes")
    print("PACKAGE=" + sys.modules["h3_multigpu"].__file__, file=sys.stderr)
    print("NODES=" + str(nodes and nodes.origin), file=sys.stderr)
"""


def _env(keep_pythonpath: bool = False) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if keep_pythonpath or not k.startswith("PYTHON")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _run(args: list, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def _probe_lines(stderr: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in stderr.splitlines()
                if line.startswith(("PACKAGE=", "NODES=")))


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("launcher")
    pack = tmp / "custom_nodes" / "comfyui-h3-multigpu"
    shutil.copytree(ROOT, pack, ignore=COPY_IGNORE, symlinks=True)
    venv = tmp / "comfyui_python"
    made = _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp, env=_env())
    assert made.returncode == 0, made.stderr
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                cwd=tmp, env=_env()).stdout.strip()
    dirs = []
    for name in REQUIREMENT_MODULES:
        spec = find_spec(name)
        if spec is not None and spec.origin is not None:
            folder = str(Path(spec.origin).resolve().parent.parent)
            if folder not in dirs:
                dirs.append(folder)
    (Path(site) / "requirements.pth").write_text("".join(f"{d}\n" for d in dirs))
    unimportable = _run([python, "-c", "import h3_multigpu"], cwd=tmp, env=_env())
    assert unimportable.returncode != 0, "h3_multigpu is importable without the launcher"
    return {"tmp": tmp, "pack": pack, "script": pack / "h3-multigpu.py", "python": python}


def test_plan_runs_from_the_clone_with_comfyuis_python(clone):
    ran = _run([clone["python"], clone["script"], *PLAN], cwd=clone["tmp"], env=_env())
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout.startswith("FITS") and "2xR9700" in ran.stdout, ran.stdout
    assert "362 frames" in ran.stdout  # --seconds 15 reached the planner


def test_profiles_and_submit_help_run_from_the_clone(clone):
    profiles = _run([clone["python"], clone["script"], "profiles"], cwd=clone["tmp"],
                    env=_env())
    assert profiles.returncode == 0 and "2xR9700" in profiles.stdout, profiles.stderr
    helped = _run([clone["python"], clone["script"], "submit", "--help"], cwd=clone["tmp"],
                  env=_env())
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: h3-multigpu submit"), helped.stdout


def test_the_clone_is_the_package_and_its_folders_shadow_nothing(clone):
    ran = _run([clone["python"], "-c", PROBE, clone["script"], "profiles"], cwd=clone["tmp"],
               env=_env())
    assert ran.returncode == 0, ran.stderr
    seen = _probe_lines(ran.stderr)
    assert Path(seen["PACKAGE"]) == clone["pack"] / "__init__.py", seen
    # the clone's nodes/ must not answer `import nodes` (ComfyUI's module)
    assert seen["NODES"] == "None", seen


def test_the_clone_wins_over_another_importable_h3_multigpu(clone):
    """The running interpreter imports h3_multigpu from this checkout (the test run's
    PYTHONPATH or editable install); the launcher still runs the clone it sits in."""
    env = _env(keep_pythonpath=True)
    other = _run([sys.executable, "-c", "import h3_multigpu; print(h3_multigpu.__file__)"],
                 cwd=clone["tmp"], env=env)
    assert other.returncode == 0 and Path(other.stdout.strip()).parent != clone["pack"]
    ran = _run([sys.executable, "-c", PROBE, clone["script"], *PLAN], cwd=clone["tmp"],
               env=env)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert Path(_probe_lines(ran.stderr)["PACKAGE"]) == clone["pack"] / "__init__.py"
