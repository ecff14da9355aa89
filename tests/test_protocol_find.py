"""`protocol.find` / `link_info` / `live`: how features ask the seam for each other.

The features never read each other's function attributes or modules; these tests pin down what
the seam answers, on the twin's patcher (the same code path as ComfyUI's ModelPatcher: the
record lives in transformer_options, which ComfyUI copies per forward)."""

from __future__ import annotations

import copy
import gc

import pytest
from twin import TwinPatcher

from h3_multigpu.comfy_seam import names, protocol


class State:
    """A feature's live object (weak-referenceable, as install requires)."""


def _patcher(tiny_twin):
    return TwinPatcher(tiny_twin)


def test_find_answers_the_state_installed_with_on_the_patcher_and_in_a_forwards_options(
        tiny_twin):
    patcher = _patcher(tiny_twin).clone()
    state = State()
    protocol.install(patcher, "prefetch", protocol.wrapper(names.DIFFUSION_MODEL, lambda e: e()),
                     state=state)
    assert protocol.find(patcher, "prefetch") is state
    assert protocol.find(patcher, "sequence") is None
    # a forward's transformer_options are a copy of the patcher's: the record travels with it
    forward_options = copy.copy(patcher.model_options[names.TRANSFORMER_OPTIONS])
    assert protocol.find(forward_options, "prefetch") is state
    assert protocol.find({}, "prefetch") is None
    assert protocol.find(object(), "prefetch") is None


def test_the_latest_installation_wins_and_a_clone_keeps_its_parents_record(tiny_twin):
    parent = _patcher(tiny_twin).clone()
    first, second = State(), State()
    protocol.install(parent, "chunking", state=first)
    child = parent.clone()
    protocol.install(child, "chunking", state=second)
    assert protocol.find(child, "chunking") is second
    assert protocol.find(parent, "chunking") is first


def test_link_info_names_the_feature_its_previous_link_and_transparency(tiny_twin):
    patcher = _patcher(tiny_twin).clone()
    below, above = State(), State()

    def original(args, extra):
        return args

    protocol.install(patcher, "prefetch",
                     protocol.block_patch(0, lambda previous: (lambda a, e: a), transparent=True),
                     state=below)
    inner = protocol.block_patch_at(patcher, 0)
    protocol.install(patcher, "sequence",
                     protocol.block_patch(0, lambda previous: (lambda a, e: previous(a, e))),
                     state=above)
    outer = protocol.block_patch_at(patcher, 0)
    info = protocol.link_info(outer)
    assert (info.feature, info.state, info.previous, info.transparent) == (
        "sequence", above, inner, False)
    info = protocol.link_info(inner)
    assert (info.feature, info.state, info.previous, info.transparent) == (
        "prefetch", below, None, True)
    assert protocol.link_info(original) is None  # not one the seam installed
    assert protocol.link_info(3) is None  # not even weak-referenceable


def test_remove_re_registers_the_rebuilt_links(tiny_twin):
    patcher = _patcher(tiny_twin).clone()
    kept = State()
    protocol.install(patcher, "prefetch",
                     protocol.block_patch(0, lambda previous: (lambda a, e: a), transparent=True),
                     state=State())
    protocol.install(patcher, "sequence",
                     protocol.block_patch(0, lambda previous: (lambda a, e: a)), state=kept)
    without = protocol.remove(patcher, "prefetch")
    link = protocol.block_patch_at(without, 0)
    info = protocol.link_info(link)
    assert (info.feature, info.state, info.previous) == ("sequence", kept, None)
    assert protocol.find(without, "sequence") is kept
    assert protocol.find(without, "prefetch") is None


def test_live_lists_installed_states_while_they_are_alive(tiny_twin):
    patcher = _patcher(tiny_twin).clone()
    state = State()
    protocol.install(patcher, "dual_sage", state=state)
    assert state in protocol.live("dual_sage")
    del patcher, state
    gc.collect()
    assert not [s for s in protocol.live("dual_sage") if isinstance(s, State)]


def test_an_unknown_feature_is_refused(tiny_twin):
    with pytest.raises(ValueError, match="not one the seam orders"):
        protocol.install(_patcher(tiny_twin).clone(), "sequnce", state=State())
