"""The features ask the seam for each other: what each installs with (`state=`), which links it
marks transparent, and the status lines read through the seam only.

Each test runs a real `apply_*` on the twin and asks `comfy_seam.protocol` what another feature
would ask (the sequence mode, the out-of-memory guard, the nodes' status): an answer that goes
wrong (a state not given, a transparent link not marked, a getter sniffing again) fails here.
"""

from __future__ import annotations

import copy

from twin import TwinPatcher

from h3_multigpu.chunking import ChunkingConfig, apply_activation_chunking, get_chunking
from h3_multigpu.comfy_seam import names, protocol
from h3_multigpu.dual_sage import (
    DualSageConfig,
    ShardedAttention,
    apply_dual_sage,
    get_sharded_attention,
)
from h3_multigpu.guard import oom
from h3_multigpu.nodes.attention_override import apply_backend_override
from h3_multigpu.offload import (
    BlockPrefetch,
    PrefetchConfig,
    apply_block_prefetch,
    get_block_prefetch,
)


def _dual(patcher):
    return apply_dual_sage(patcher, DualSageConfig(helpers=("cpu",), split="5:3", min_tokens=0))


def _prefetch(patcher):
    return apply_block_prefetch(patcher, PrefetchConfig(resident_blocks=0, lookahead=1))


def test_the_prefetcher_is_found_from_a_patcher_and_a_forwards_options(tiny_twin, tiny_inputs):
    patched = _prefetch(TwinPatcher(tiny_twin))
    prefetch = protocol.find(patched, "prefetch")
    assert isinstance(prefetch, BlockPrefetch) and get_block_prefetch(patched) is prefetch
    assert prefetch in protocol.live("prefetch")
    forward = copy.copy(patched.model_options[names.TRANSFORMER_OPTIONS])
    assert protocol.find(forward, "prefetch") is prefetch  # what the sequence mode asks
    # every block patch is the prefetcher's, transparent, around the original block
    patches = protocol.block_patches(patched)
    assert len(patches) == len(tiny_twin.blocks)
    for patch in patches.values():
        info = protocol.link_info(patch)
        assert (info.feature, info.state, info.previous, info.transparent) == (
            "prefetch", prefetch, None, True)
    patched.apply_model(*tiny_inputs)
    assert prefetch.streamer is not None and prefetch.streamer.prepared  # the one that ran


def test_dual_sage_is_found_wherever_its_override_sits(tiny_twin, tiny_inputs):
    dual = _dual(TwinPatcher(tiny_twin))
    sharded = protocol.find(dual, "dual_sage")
    assert isinstance(sharded, ShardedAttention) and sharded in protocol.live("dual_sage")
    info = protocol.link_info(protocol.override_of(dual))
    assert (info.feature, info.state, info.transparent) == ("dual_sage", sharded, False)
    # its attention recorders are transparent links (the sequence mode splits across them)
    for patch in protocol.block_patches(dual).values():
        info = protocol.link_info(patch)
        assert (info.feature, info.state, info.transparent) == ("dual_sage", sharded, True)
    # chunking's head groups wrap its override: still found, and it is the one that runs
    wrapped = apply_activation_chunking(dual, ChunkingConfig(head_group=4))
    assert protocol.link_info(protocol.override_of(wrapped)).feature == "chunking"
    assert get_sharded_attention(wrapped) is sharded
    wrapped.apply_model(*tiny_inputs)
    assert sharded.routes["split"] + sharded.routes["root"] > 0


def test_chunking_and_the_attention_node_install_with_their_state(tiny_twin):
    chunked = apply_activation_chunking(TwinPatcher(tiny_twin), ChunkingConfig(ffn_chunk=8))
    runtime = get_chunking(chunked)
    assert runtime is protocol.find(chunked, "chunking") and sorted(runtime.chunkers) == [0, 1, 2]
    wrapper = protocol.wrappers_of(chunked, names.DIFFUSION_MODEL, "chunking")[0]
    assert protocol.link_info(wrapper).state is runtime
    node = apply_backend_override(TwinPatcher(tiny_twin), "sdpa")
    info = protocol.link_info(protocol.override_of(node))
    assert info.feature == "attention" and info.state.backend == "sdpa"
    # Dual-Sage over the node learns the node's kernel from the seam: its line names it
    line = protocol.status_lines(_dual(node))["dual_sage"]
    assert "the H3 Sage Attention node's backend sdpa" in line, line


def test_the_oom_guard_frees_what_the_seam_lists(tiny_twin, monkeypatch):
    patched = _prefetch(_dual(TwinPatcher(tiny_twin)))
    sharded, prefetch = protocol.find(patched, "dual_sage"), protocol.find(patched, "prefetch")
    released = []
    monkeypatch.setattr(sharded, "release", lambda: released.append("shard"))
    prefetch.prepare()
    monkeypatch.setattr(prefetch.streamer, "release_device", lambda: released.append("slots"))
    oom.release_pack_memory()
    assert released == ["shard", "slots"]


def test_remove_takes_callbacks_and_wrappers_off_the_twin_too(tiny_twin):
    patched = _prefetch(TwinPatcher(tiny_twin))
    key = protocol.KEYS["prefetch"]
    assert key in patched.callbacks[names.ON_DETACH]
    assert key in patched.wrappers[names.DIFFUSION_MODEL]
    bare = protocol.remove(patched, "prefetch")
    assert key not in bare.callbacks[names.ON_DETACH]
    assert key not in bare.wrappers.get(names.DIFFUSION_MODEL, {})
    assert not protocol.block_patches(bare) and not bare.object_patches
    assert key in patched.callbacks[names.ON_DETACH]  # the original is untouched


def test_a_live_status_line_is_read_at_read_time_and_travels_with_clones(tiny_twin):
    patched = TwinPatcher(tiny_twin).clone()

    class State:
        line = "before"

    state = State()
    protocol.install(patched, "chunking", state=state)
    protocol.record_status(patched, "chunking", "before", live=lambda: state.line)
    protocol.record_status(patched, "attention", "fixed")
    later = patched.clone()
    state.line = "after the run"
    assert protocol.status_lines(patched) == {"chunking": "after the run", "attention": "fixed"}
    assert protocol.status_lines(later)["chunking"] == "after the run"
    # the live line goes with the feature's record
    assert protocol.status_lines(protocol.remove(later, "chunking"))["chunking"] == "before"
