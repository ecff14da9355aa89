"""The drop-in node's root/helper choice reaches Dual-Sage (CPU: fake GPUs, nothing runs on them).

The plan names root and helpers; the Advanced node's root_gpu/helper_gpu overrides change the
placement, and Dual-Sage must follow the placement: a role swap must not put the helper on the
root, and with three GPUs the helper the user picked must be the one that takes heads.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from h3_multigpu.dual_sage import DualSageConfig
from h3_multigpu.dual_sage.apply import build_sharded_attention
from h3_multigpu.nodes import features
from h3_multigpu.nodes.devices import GiB, GpuInfo
from h3_multigpu.nodes.placement import decide_placement

GPUS = [GpuInfo(i, "NVIDIA H200", 141 * GiB) for i in range(3)]


def three_gpu_plan():
    """A plan for 3 GPUs: DiT on gpu:1, Dual-Sage helpers gpu:0 and gpu:2 (20:18:18 heads)."""
    off = SimpleNamespace(ffn_chunk=0, qkv_chunk=0, head_group=0, streamed_blocks=0,
                          reason="not needed")
    return SimpleNamespace(
        root_device=1, helper_devices=[0, 2],
        dual_sage=SimpleNamespace(enabled=True, helper_devices=(0, 2), split=(20, 18, 18),
                                  min_tokens=4096, transport="peer", reason="pays off"),
        chunking=off, prefetch=off)


@pytest.fixture
def fake_gpus(monkeypatch):
    """torch believes 3 GPUs with peer access exist (only device checks run in these tests)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)


class H3Patcher:
    """What Dual-Sage reads of a ModelPatcher: the load device and the DiT's 56 heads."""

    def __init__(self, load_device="cpu"):
        self.load_device = torch.device(load_device)
        self.model_options = {"transformer_options": {}}

    def get_model_object(self, name):
        attn = SimpleNamespace(heads=56)
        return SimpleNamespace(blocks=[SimpleNamespace(attn=attn)])


def applied_config(monkeypatch, plan, placement):
    seen = {}

    def capture(model, feature, config):
        seen[feature] = config
        return model

    monkeypatch.setattr(features, "apply_feature", capture)
    features.apply_plan(H3Patcher(), plan, placement)
    return seen["dual_sage"]


def plan_devices(config: DualSageConfig, root: int) -> tuple[tuple[str, ...], tuple]:
    shard = build_sharded_attention(H3Patcher(f"cuda:{root}"), config)
    return tuple(map(str, shard.plan.devices)), shard.plan.head_counts


@pytest.mark.parametrize("root,helper,devices,counts", [
    (None, None, ("cuda:1", "cuda:0", "cuda:2"), (20, 18, 18)),  # the plan as it is
    (None, 2, ("cuda:1", "cuda:2", "cuda:0"), (20, 18, 18)),  # the helper the user picked first
    (0, 1, ("cuda:0", "cuda:1", "cuda:2"), (18, 20, 18)),  # roles swapped: shares follow GPUs
    (2, 0, ("cuda:2", "cuda:0"), (28, 28)),  # gpu:2 is the root now: not also a helper
])
def test_placement_overrides_reach_dual_sage(monkeypatch, fake_gpus, root, helper, devices,
                                             counts):
    placement = decide_placement(GPUS, root=1 if root is None else root,
                                 helper=0 if helper is None else helper)
    config = applied_config(monkeypatch, three_gpu_plan(), placement)
    assert plan_devices(config, placement.root) == (devices, counts)


def test_swapped_roles_on_two_gpus_do_not_raise(monkeypatch, fake_gpus):
    plan = three_gpu_plan()
    plan.helper_devices, plan.dual_sage.helper_devices, plan.dual_sage.split = [0], (0,), (28, 28)
    placement = decide_placement(GPUS[:2], root=0, helper=1)
    config = applied_config(monkeypatch, plan, placement)
    assert plan_devices(config, 0) == (("cuda:0", "cuda:1"), (28, 28))
