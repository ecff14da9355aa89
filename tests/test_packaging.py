"""The wheel and the sdist: every product module ships and imports from a clean install, no test
or development code ships, and the console script runs.

The wheel is built from a copy of the checkout (a build writes build/ and *.egg-info beside
the sources, and a stale build/ would leak removed modules into the wheel) with pip and the
running interpreter's setuptools, offline (`--no-build-isolation`). It is installed with
`--no-deps` into a fresh venv that reaches torch, numpy and the other dependencies through a
.pth file naming the folders that hold them: plain path lines, so the running environment's own
.pth files (an editable install of this checkout among them) are not processed there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from importlib.util import find_spec
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Test and development folders: in the repository, never in the wheel or the sdist.
DEV_FOLDERS = ("tests", "dev")
# Folders shipped for their data only; their .py files generate that data (development code).
DATA_FOLDERS = ("workflows", "workflows/api")
# Scripts of the root that are not modules of the package.
ROOT_SCRIPTS = ("setup.py", "h3-multigpu.py")
# Product modules that cannot be imported without ComfyUI, each with the reason. The import
# must fail on comfy_api and nothing else (a missing module of the pack fails the test).
NEEDS_COMFYUI = {
    "h3_multigpu.nodes.comfy_types": "ComfyUI's V3 types (comfy_api.latest)",
    "h3_multigpu.nodes.extension": "the V3 extension class (comfy_api.latest)",
    "h3_multigpu.nodes.v3_decode": "a V3 node module (comfy_api.latest)",
    "h3_multigpu.nodes.v3_dropin": "a V3 node module (comfy_api.latest)",
    "h3_multigpu.nodes.v3_features": "a V3 node module (comfy_api.latest)",
    "h3_multigpu.nodes.v3_plan": "a V3 node module (comfy_api.latest)",
    "h3_multigpu.nodes.v3_upscale": "a V3 node module (comfy_api.latest)",
    "h3_multigpu.nodes.v3_utils": "V3 helpers (comfy_api.latest)",
}
# `python -m h3_multigpu` runs the CLI when imported: run as a command below instead.
RUN_AS_COMMAND = {"h3_multigpu.__main__"}
# Distributions the installed wheel needs at import time (its dependencies, not installed).
DEPENDENCY_MODULES = ("torch", "numpy", "safetensors", "websocket", "comfy_kitchen")
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "*.egg-info",
                                     "__pycache__", ".pytest_cache", ".ruff_cache",
                                     "node_modules", ".carry", ".whl")


def _clean_env() -> dict[str, str]:
    """No PYTHONPATH (the test run's may point at this checkout) and no user site."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _run(args: list, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], cwd=cwd, env=_clean_env(), capture_output=True,
                          text=True, timeout=timeout)


def _product_folders() -> set[str]:
    """Folders of the checkout holding product .py files, relative, "" for the root."""
    found = set()
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        parts = rel.parts[:-1]
        if any(p.startswith(".") or p in ("venv", "build", "dist", "site-packages",
                                          "node_modules", "__pycache__") for p in parts):
            continue  # a virtual environment or build output beside the pack
        folder = "/".join(parts)
        if parts and parts[0] in DEV_FOLDERS or folder in DATA_FOLDERS:
            continue
        found.add(folder)
    return found


def _dependency_dirs() -> list[Path]:
    """The folders holding the dependencies, for the fresh venv's .pth file."""
    dirs: list[Path] = []
    for name in DEPENDENCY_MODULES:
        spec = find_spec(name)
        if spec is None or spec.origin is None:
            continue  # optional here (websocket-client): the modules needing it would fail
        folder = Path(spec.origin).resolve().parent.parent
        assert not (folder / "h3_multigpu").exists() and folder != ROOT, (
            f"{folder} would put a second h3_multigpu beside the installed one")
        if folder not in dirs:
            dirs.append(folder)
    return dirs


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("packaging")
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=COPY_IGNORE, symlinks=True)
    out = tmp / "dist"
    wheel = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                  "-q", "-w", out, source], cwd=tmp, timeout=300)
    assert wheel.returncode == 0, wheel.stdout + wheel.stderr
    sdist = _run([sys.executable, "-c",
                  "import sys; from setuptools import build_meta; "
                  "build_meta.build_sdist(sys.argv[1])", out], cwd=source, timeout=300)
    assert sdist.returncode == 0, sdist.stdout + sdist.stderr
    (whl,) = out.glob("*.whl")
    (tar,) = out.glob("*.tar.gz")
    return {"tmp": tmp, "wheel": whl, "sdist": tar}


def _wheel_files(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return [n for n in z.namelist() if n.startswith("h3_multigpu/")]


def test_wheel_ships_every_product_folder_and_no_dev_code(built):
    files = _wheel_files(built["wheel"])
    rel = [n.removeprefix("h3_multigpu/") for n in files]
    shipped = {"/".join(Path(r).parts[:-1]) for r in rel if r.endswith(".py")}
    expected = _product_folders()
    assert shipped == expected, (
        f"product folders missing from the wheel: {sorted(expected - shipped)} (a package "
        f"needs an __init__.py to be found); shipped but not product: "
        f"{sorted(shipped - expected)}")
    for folder in expected - {""}:
        assert (ROOT / folder / "__init__.py").is_file(), f"{folder}/ needs an __init__.py"
    assert not [r for r in rel if Path(r).parts[0] in DEV_FOLDERS]
    assert not [r for r in rel if r.endswith(".py") and "/".join(Path(r).parts[:-1])
                in DATA_FOLDERS], "workflow generator code shipped"
    assert not set(rel) & set(ROOT_SCRIPTS)
    # every data file of the product folders ships: the workflows, the planner's profiles ...
    data = {p.relative_to(ROOT).as_posix() for folder in (*expected, *DATA_FOLDERS) if folder
            for p in (ROOT / folder).glob("*.json")}
    assert {f"workflows/{p.name}" for p in (ROOT / "workflows").glob("*.json")} <= data
    assert {"workflows/api/h3_multigpu_two_pass_t2v.json", "planner/profiles.json"} <= data
    assert data <= set(rel), f"data files missing from the wheel: {sorted(data - set(rel))}"


def test_sdist_has_no_test_or_dev_code(built):
    with tarfile.open(built["sdist"]) as tar:
        names = [n.split("/", 1)[1] for n in tar.getnames() if "/" in n]
    assert not [n for n in names if n.split("/")[0] in DEV_FOLDERS]
    assert not [n for n in names if n.endswith(".py") and n.rsplit("/", 1)[0] in DATA_FOLDERS]
    assert "h3-multigpu.py" not in names
    # what a wheel is built from: the build files and the product's modules and data
    assert {"pyproject.toml", "setup.py", "cli.py", "comfy_seam/__init__.py",
            "workflows/api/h3_multigpu_two_pass_t2v.json"} <= set(names)


def test_wheel_installs_and_imports_in_a_clean_venv(built):
    tmp = built["tmp"]
    venv = tmp / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp)
    assert made.returncode == 0, made.stderr
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / ("python.exe" if os.name == "nt" else "python")
    # the running pip installs into the venv (it has none of its own: faster, and offline)
    install = _run([sys.executable, "-m", "pip", "--python", python, "install", "-q",
                    "--no-deps", built["wheel"]], cwd=tmp)
    assert install.returncode == 0, install.stdout + install.stderr
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                cwd=tmp).stdout.strip()
    (Path(site) / "h3_dependencies.pth").write_text(
        "".join(f"{d}\n" for d in _dependency_dirs()))

    modules = sorted(
        n.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        for n in _wheel_files(built["wheel"]) if n.endswith(".py"))
    assert set(NEEDS_COMFYUI) <= set(modules), "a listed exception is no longer shipped"
    probe = (
        "import importlib, json, sys\n"
        "result = {}\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "        result[name] = None\n"
        "    except Exception as exc:\n"
        "        result[name] = [type(exc).__name__, getattr(exc, 'name', None), str(exc)]\n"
        "import h3_multigpu\n"
        "print(json.dumps({'file': h3_multigpu.__file__, 'result': result}))\n")
    work = tmp / "elsewhere"  # not the checkout, whose folder would be importable from cwd
    work.mkdir()
    ran = _run([python, "-c", probe, *(m for m in modules if m not in RUN_AS_COMMAND)],
               cwd=work, timeout=300)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    answer = json.loads(ran.stdout.strip().splitlines()[-1])
    assert Path(answer["file"]).resolve().is_relative_to(venv.resolve()), answer["file"]
    failed = {m: e for m, e in answer["result"].items() if e and m not in NEEDS_COMFYUI}
    assert not failed, f"product modules that do not import from the wheel: {failed}"
    for name in NEEDS_COMFYUI:
        error = answer["result"][name]
        assert error and error[0] == "ModuleNotFoundError" and error[1].startswith("comfy_api"), (
            f"{name}: {error} (listed as needing only ComfyUI; drop it from NEEDS_COMFYUI if it "
            f"imports without)")

    script = bindir / ("h3-multigpu.exe" if os.name == "nt" else "h3-multigpu")
    plan = _run([script, "plan", "--profile", "2xR9700"], cwd=work)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert plan.stdout.startswith("FITS") and "2xR9700" in plan.stdout, plan.stdout
    profiles = _run([python, "-m", "h3_multigpu", "profiles"], cwd=work)
    assert profiles.returncode == 0 and "2xR9700" in profiles.stdout, profiles.stderr
