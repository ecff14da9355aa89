"""The pack beside ComfyUI's own MultiGPU CFG Split, on ComfyUI's real H3 and real clones.

CPU stand-in GPUs: ComfyUI's device list (`model_management.get_all_torch_devices`) answers
cpu, cpu:0, cpu:1 and cpu:2, four distinct `torch.device` keys whose tensors all live on the
CPU, so core's CFG Split (`MultiGPU_WorkUnits`' own `execute`, comfy/multigpu.py) makes its
deep clones from the loader's factory and runs cond and uncond in its thread pool as it does on
GPUs. CFGGuider at CFG 4, two threads, ComfyUI's default attention. "Exact" is ComfyUI's own
output of the same graph: the pack's placement guard before or after CFG Split must equal core's
CFG-split output bit for bit (and that equals the unsplit run here); the pack's splitting or
streaming features are refused with CFG Split's name and the fix, at the node or before the
sampler's first model call, leaving ComfyUI usable.

    COMFYUI_PATH=/path/to/ComfyUI python -m pytest -m comfyui tests/test_cfg_split_comfyui.py
"""

from __future__ import annotations

import pytest
import torch
from comfyui_h3 import TinyH3Config, make_inputs, make_tiny_h3, run_like_sampler

from h3_multigpu.comfy_seam.clones import cfg_split_devices
from h3_multigpu.guard.device import guard_diffusion_model
from h3_multigpu.nodes.features import apply_from_strings

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("fresh_comfyui", "two_cpu_threads")]

CONFIG = TinyH3Config(heads=4)
CFG = 4.0


@pytest.fixture
def stand_in_gpus(monkeypatch):
    """ComfyUI's device list as four CPU stand-ins (the root model's device first)."""
    import comfy.model_management as mm

    devices = [torch.device("cpu"), *(torch.device("cpu", i) for i in range(3))]
    monkeypatch.setattr(mm, "get_all_torch_devices",
                        lambda exclude_current=False: list(devices))
    return devices


@pytest.fixture
def split_calls(monkeypatch):
    """The devices of every step core's CFG Split ran (`_calc_cond_batch_multigpu`)."""
    import comfy.samplers as samplers

    calls: list[list] = []
    original = samplers._calc_cond_batch_multigpu

    def counted(model, conds, x_in, timestep, model_options):
        calls.append(list(model_options["multigpu_clones"]))
        return original(model, conds, x_in, timestep, model_options)

    monkeypatch.setattr(samplers, "_calc_cond_batch_multigpu", counted)
    return calls


def cfg_split(patcher, max_gpus: int):
    """What the MultiGPU CFG Split node returns for `patcher` (its own execute where this
    ComfyUI has the node, else the function it calls)."""
    try:
        from comfy_extras.nodes_multigpu import MultiGPUCFGSplitNode
    except ImportError:
        import comfy.multigpu

        return comfy.multigpu.create_multigpu_deepclones(patcher, max_gpus, reuse_loaded=True)
    return MultiGPUCFGSplitNode.execute(patcher, max_gpus).args[0]


@pytest.fixture
def job():
    inputs = make_inputs(CONFIG, seed=1)
    gen = torch.Generator().manual_seed(7)
    negative = [[torch.randn(inputs.positive[0][0].shape, generator=gen), {}]]
    return inputs, negative


def sample(patcher, job):
    inputs, negative = job
    return run_like_sampler(patcher, inputs, negative=negative, cfg=CFG)


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _blocks_called(patcher) -> list[int]:
    """A counter of DiT block calls on the patcher's model (hooks; no change to the math)."""
    calls = [0]
    for block in patcher.model.diffusion_model.blocks:
        block.register_forward_pre_hook(lambda module, args: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("max_gpus", [2, 4])
def test_core_cfg_split_runs_on_the_stand_ins_as_on_one_gpu(stand_in_gpus, split_calls, job,
                                                            max_gpus):
    """The yardstick: core's CFG Split engages on the stand-ins, one clone per extra device,
    and its output equals the unsplit run's."""
    patcher = make_tiny_h3(CONFIG)
    alone = sample(patcher, job)
    split = cfg_split(patcher, max_gpus)
    assert cfg_split_devices(split) == stand_in_gpus[:max_gpus]
    out = sample(split, job)
    assert split_calls and all(len(devices) == max_gpus for devices in split_calls)
    assert _same(out, alone)


@pytest.mark.parametrize("order", ["guard first", "cfg split first"])
def test_the_pack_placement_guard_composes_with_cfg_split(stand_in_gpus, split_calls, job,
                                                          order):
    """The guard the pack's placement installs, before or after CFG Split (max_gpus 2): core
    splits the conds, each clone on its own device, and the output is core's own."""
    patcher = make_tiny_h3(CONFIG)
    reference = sample(cfg_split(patcher, 2), job)
    calls_before = len(split_calls)
    if order == "guard first":
        model = cfg_split(guard_diffusion_model(patcher.clone()), 2)
    else:
        model = guard_diffusion_model(cfg_split(patcher, 2).clone())
    clones = model.get_additional_models_with_key("multigpu")
    assert [c.load_device for c in clones] == [stand_in_gpus[1]]  # placed per module copy
    assert clones[0].model is not patcher.model  # a fresh copy from the loader's factory
    out = sample(model, job)
    assert len(split_calls) > calls_before
    assert _same(out, reference)


@pytest.mark.parametrize("max_gpus", [2, 4])
@pytest.mark.parametrize("feature, options", [
    ("chunking", {"ffn_chunk": "16"}),
    ("sequence", {"parallel": "sequence", "helpers": "cpu"}),
    ("dual_sage", {"helpers": "cpu", "split": "auto"}),
])
def test_a_splitting_feature_after_cfg_split_is_refused_at_the_node(stand_in_gpus, max_gpus,
                                                                    feature, options):
    split = cfg_split(make_tiny_h3(CONFIG), max_gpus)
    with pytest.raises(ValueError) as err:
        apply_from_strings(split, feature, **options)
    text = str(err.value)
    where = ", ".join(str(d) for d in stand_in_gpus[:max_gpus])
    assert "MultiGPU CFG Split" in text and where in text and feature in text
    assert "max_gpus to 1" in text


def test_chunking_before_cfg_split_is_refused_before_any_model_call(stand_in_gpus, split_calls,
                                                                   job):
    patcher = make_tiny_h3(CONFIG)
    alone = sample(patcher, job)
    chunked = apply_from_strings(patcher, "chunking", ffn_chunk="16")
    split = cfg_split(chunked, 2)
    calls = _blocks_called(split)
    with pytest.raises(ValueError, match=r"MultiGPU CFG Split .* cpu, cpu:0.* chunking"):
        sample(split, job)
    assert calls[0] == 0 and split_calls == []  # the sampler never ran the model
    assert _same(sample(patcher, job), alone)  # ComfyUI is usable afterwards


def test_at_max_gpus_1_there_are_no_clones_and_chunking_runs_as_alone(stand_in_gpus,
                                                                      split_calls, job):
    """CFG Split at max_gpus 1 sets nothing up: the pack's chunking engages and gives what it
    gives without the node (chunking's own exactness is test_chunking_comfyui.py's)."""
    patcher = make_tiny_h3(CONFIG)
    alone = sample(apply_from_strings(patcher, "chunking", ffn_chunk="16"), job)
    one = cfg_split(patcher, 1)
    assert cfg_split_devices(one) == []
    chunked = apply_from_strings(one, "chunking", ffn_chunk="16")
    from h3_multigpu.chunking import get_chunking

    runtime = get_chunking(chunked)
    out = sample(chunked, job)
    assert split_calls == []
    assert runtime is not None and sum(sum(c.calls.values()) for c in
                                       runtime.chunkers.values()) > 0
    assert _same(out, alone)


def test_a_plan_that_splits_cfg_sets_up_core_cfg_split(stand_in_gpus, split_calls, job):
    """The drop-in node's apply_plan with a plan that splits CFG (two H200s at CFG 4): core's
    own CFG Split is set up on the placed model (its extra device the one beside the root), the
    pack's split features stay off, and the output is core's CFG-split output."""
    from h3_multigpu.nodes.features import apply_plan
    from h3_multigpu.nodes.placement import Placement
    from h3_multigpu.nodes.planning import make_plan

    plan = make_plan(pass2_width=1312, pass2_height=736, pass1_width=864, pass1_height=480,
                     seconds=5.0, devices="2xH200", lora_rank=128, pass1_cfg=CFG,
                     pass2_cfg=CFG)
    assert {p.mode for p in plan.parallel.passes.values()} == {"cfg"}
    patcher = make_tiny_h3(CONFIG)
    reference = sample(cfg_split(patcher, 2), job)
    placed = guard_diffusion_model(patcher.clone())
    model, lines = apply_plan(placed, plan, Placement(root=1, helper=0, gpus=()))
    assert lines["cfg_split"].startswith("ComfyUI's MultiGPU CFG Split (max_gpus 2): cond and "
                                         "uncond one a GPU on cpu, cpu:0")
    assert all(lines[f].startswith("off") for f in ("sequence", "dual_sage", "chunking"))
    assert cfg_split_devices(model) == stand_in_gpus[:2] and cfg_split_devices(placed) == []
    out = sample(model, job)
    assert split_calls and _same(out, reference)
