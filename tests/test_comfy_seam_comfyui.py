"""Every ComfyUI internal the seam lists still exists in this ComfyUI (COMFYUI_PATH).

Run once per bed (ComfyUI 0.33.0 and the newest-files bed): an entry checked on the running
release (`internals.release_of_running`) must resolve; one listed for the other release only is
reported as absent here, not failed.

    COMFYUI_PATH=/path/to/ComfyUI python -m pytest -m comfyui tests/test_comfy_seam_comfyui.py
"""

from __future__ import annotations

import pytest
from comfyui_h3 import import_comfyui_or_skip

from h3_multigpu.comfy_seam import internals

pytestmark = pytest.mark.comfyui


@pytest.fixture(scope="module")
def release():
    import_comfyui_or_skip()
    found = internals.release_of_running()
    assert found in ("0.33.0", "newest"), found
    return found


@pytest.mark.parametrize("entry", internals.INTERNALS,
                         ids=lambda e: f"{e.kind}:{e.target}:{str(e.expect)[:30]}")
def test_internal_exists(entry, release):
    problem = internals.check(entry)
    if release not in entry.releases:
        pytest.skip(f"listed for {entry.releases} only; here: {problem or 'present'}")
    assert problem is None, f"{problem} (used by {entry.used_by})"


def test_a_missing_internal_is_reported(release):
    gone = internals.Internal("comfy.model_patcher:ModelPatcher.no_such_method")
    assert "no attribute 'no_such_method'" in internals.check(gone)
    renamed = internals.Internal("comfy.patcher_extension:WrappersMP.DIFFUSION_MODEL", "value",
                                 "diffusion_model_renamed")
    assert "the pack spells" in internals.check(renamed)
    moved = internals.Internal("comfy.ldm.minimax.model", "source", "no such call(")
    assert "no longer has" in internals.check(moved)
