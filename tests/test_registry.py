"""What the ComfyUI Registry reads (`comfy node validate` / `publish`): pyproject.toml's
[tool.comfy] and project fields, the icon its URL points at, the GPL-3 LICENSE, and the
.comfyignore that keeps test and development code out of the Registry's archive."""

from __future__ import annotations

import fnmatch
import importlib.util
import struct
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = "https://github.com/h3-multigpu/comfyui-h3-multigpu"
RAW = "https://raw.githubusercontent.com/h3-multigpu/comfyui-h3-multigpu/main/"
# the Registry's accelerator classifiers (comfy-cli warns on any other "Environment ::" one)
ACCELERATORS = {"Environment :: GPU :: NVIDIA CUDA", "Environment :: GPU :: AMD ROCm"}


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_the_registry_fields_are_filled(pyproject):
    comfy = pyproject["tool"]["comfy"]
    for key in ("PublisherId", "DisplayName", "Icon", "requires-comfyui"):
        assert isinstance(comfy.get(key), str) and comfy[key].strip(), f"[tool.comfy] {key}"
    assert comfy["PublisherId"] == "h3-multigpu"
    assert comfy["requires-comfyui"] == ">=0.33.0"  # the release with the H3 nodes
    project = pyproject["project"]
    for key in ("name", "version", "description", "license", "requires-python"):
        assert project.get(key), f"[project] {key}"
    urls = project["urls"]
    assert urls["Repository"] == REPOSITORY
    for key in ("Homepage", "Documentation", "Bug Tracker", "Issues"):
        assert urls[key].startswith(REPOSITORY), key
    classifiers = set(project["classifiers"])
    assert ACCELERATORS <= classifiers
    assert "Operating System :: OS Independent" in classifiers
    assert {c for c in classifiers if c.startswith("Environment ::")} <= ACCELERATORS
    low = project["requires-python"].removeprefix(">=")
    assert f"Programming Language :: Python :: {low}" in classifiers
    # PEP 639: the SPDX expression replaces a License classifier (setuptools refuses both)
    assert not [c for c in classifiers if c.startswith("License ::")]


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_the_icon_url_points_at_a_square_png_in_the_repository(pyproject):
    url = pyproject["tool"]["comfy"]["Icon"]
    assert url.startswith(RAW), f"{url} is not a file of the repository's main branch"
    icon = ROOT / url.removeprefix(RAW)
    assert icon.is_file(), f"{icon} is missing"
    width, height = _png_size(icon.read_bytes())
    assert width == height >= 200


def test_the_icon_is_what_its_script_draws():
    script = ROOT / "dev" / "tools" / "make_icon.py"
    spec = importlib.util.spec_from_file_location("make_icon", script)
    make_icon = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_icon)
    assert make_icon.png_bytes(make_icon.draw()) == make_icon.OUT.read_bytes(), (
        "docs/images/icon.png differs from dev/tools/make_icon.py: "
        "run python dev/tools/make_icon.py")


def test_license_is_the_gpl3_text_and_ships(pyproject):
    project = pyproject["project"]
    assert project["license"] == "GPL-3.0-or-later"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.lstrip().startswith("GNU GENERAL PUBLIC LICENSE")
    assert "Version 3, 29 June 2007" in text and "END OF TERMS AND CONDITIONS" in text
    assert len(text) > 30_000  # the full text, not a notice


def _ignored(patterns: list[str], path: str) -> bool:
    """gitignore's rules for the patterns .comfyignore uses: "dir/" (a folder and all below
    it), "a/*" and "a/*.py" (anchored globs, as any pattern with a slash inside), "!" (keep);
    the last matching pattern decides."""
    ignored = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        folder_only = pattern.endswith("/")
        pattern = pattern.strip("/")
        parts = path.split("/")
        if folder_only:  # the path lies in such a folder: one of its parents matches
            candidates = ["/".join(parts[:i]) for i in range(1, len(parts))]
        else:
            candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if "/" not in pattern:  # unanchored: matches a name at any depth
            candidates = [c.rsplit("/", 1)[-1] for c in candidates]
        if any(fnmatch.fnmatchcase(c, pattern) for c in candidates):
            ignored = not negate
    return ignored


@pytest.fixture(scope="module")
def comfyignore() -> list[str]:
    lines = (ROOT / ".comfyignore").read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("path", [
    "tests/test_cli.py", "tests/data/object_info_033.json", "dev/bench/bench_decode.py",
    "dev/tools/make_icon.py", "tests/twin/model.py", ".ci/run", "docs/results/decode.json",
    "docs/images/h3_multigpu_two_pass_t2v.png", "dev/workflow_layout/build_workflows.py",
])
def test_comfyignore_leaves_out_test_and_development_files(comfyignore, path):
    assert (ROOT / path).exists(), f"{path} is no longer in the repository: update the list"
    assert _ignored(comfyignore, path)


@pytest.mark.parametrize("path", [
    "__init__.py", "cli.py", "h3-multigpu.py", "requirements.txt", "pyproject.toml", "LICENSE",
    "planner/profiles.json", "comfy_seam/names.py", "nodes/v3_plan.py",
    "workflows/h3_multigpu_two_pass_t2v.json", "workflows/api/h3_multigpu_two_pass_t2v.json",
    "docs/images/icon.png", "docs/nodes.md",
])
def test_comfyignore_keeps_the_product(comfyignore, path):
    assert (ROOT / path).exists(), f"{path} is no longer in the repository: update the list"
    assert not _ignored(comfyignore, path)


def test_triton_is_an_extra_never_a_requirement(pyproject):
    """kernels/triton_sage.py is opt-in: `pip install comfyui-h3-multigpu[triton]` adds it."""
    project = pyproject["project"]
    assert not [d for d in project["dependencies"] if d.startswith("triton")]
    extra = project["optional-dependencies"]["triton"]
    assert "triton>=3.2; sys_platform != 'win32'" in extra
    assert "triton-windows>=3.2; sys_platform == 'win32'" in extra
