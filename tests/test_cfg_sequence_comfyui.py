"""Sequence parallel inside ComfyUI's own MultiGPU CFG Split (2x2), on ComfyUI's real H3.

CPU stand-in GPUs as in test_cfg_split_comfyui.py: ComfyUI's device list answers cpu, cpu:0,
cpu:1 and cpu:2. Core's CFG Split (its node's own `execute`, max_gpus 2) runs cond on the root
(cpu) and uncond on its deep copy (cpu:0); the pack's sequence mode, given the helpers cpu:1
and cpu:2, runs one group a cond: cpu+cpu:1 and cpu:0+cpu:2. CFGGuider at CFG 4, two threads,
ComfyUI's default attention. "Exact" is ComfyUI's own output of the same graph: core's
CFG-split output, bit for bit (row shares >= 16 rows and >= 2 heads a device, the CPU's exact
range, `test_sequence_comfyui.py`). Checked per module: every block forward is counted with the
model it belongs to, so each GPU is seen to run one DiT, each share its own rows.

    COMFYUI_PATH=/path/to/ComfyUI python -m pytest -m comfyui tests/test_cfg_sequence_comfyui.py
"""

from __future__ import annotations

import pytest
import torch
from comfyui_h3 import TinyH3Config, make_inputs, make_tiny_h3, run_like_sampler
from test_cfg_split_comfyui import (  # noqa: F401 (fixtures)
    CFG,
    _same,
    cfg_split,
    sample,
    split_calls,
    stand_in_gpus,
)

from h3_multigpu.comfy_seam import protocol
from h3_multigpu.comfy_seam.clones import cfg_split_clones
from h3_multigpu.nodes.features import apply_from_strings
from h3_multigpu.sequence import get_sequence_parallel

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("fresh_comfyui", "two_cpu_threads")]

CONFIG = TinyH3Config(heads=4)
LONGER = (3, 8, 8)  # 74 rows: >= 16 rows on each share of a pair
HELPERS = "cpu:1,cpu:2"


@pytest.fixture
def job():
    inputs = make_inputs(CONFIG, latent_thw=LONGER, keyframe=True, audio_mask=True, seed=1)
    gen = torch.Generator().manual_seed(7)
    negative = [[torch.randn(inputs.positive[0][0].shape, generator=gen), {}]]
    return inputs, negative


class ModelForwards:
    """Every DiT block forward (upstream's `DiTBlock.forward`, every model, every thread), with
    the rows it ran on and the model it belongs to."""

    def __init__(self, monkeypatch):
        import comfy.ldm.minimax.model as h3

        self.calls: list[tuple[int, int]] = []  # (id of the block module, rows)
        original = h3.DiTBlock.forward

        def forward(block, x, *args, **kwargs):
            self.calls.append((id(block), x.shape[0]))
            return original(block, x, *args, **kwargs)

        monkeypatch.setattr(h3.DiTBlock, "forward", forward)

    def per_model(self, models: dict[str, torch.nn.Module]) -> dict[str, list[int]]:
        """Per named diffusion model, the rows of every block call it ran."""
        owner = {id(b): name for name, model in models.items() for b in model.blocks}
        out: dict[str, list[int]] = {name: [] for name in models}
        for block, rows in self.calls:
            out[owner.get(block, "other")] = [*out.get(owner.get(block, "other"), []), rows]
        return out


def _sequence(patcher, helpers: str = HELPERS):
    return apply_from_strings(patcher, "sequence", parallel="sequence", helpers=helpers)


def _models(model) -> dict[str, torch.nn.Module]:
    """The diffusion models the run can use, by device: the root's, CFG Split's copy and the
    helper clones of each group."""
    mode = get_sequence_parallel(model)
    out = {str(model.load_device): model.model.diffusion_model}
    for clone in cfg_split_clones(model):
        out[str(clone.load_device)] = clone.model.diffusion_model
    for group in mode.cfg.finished:
        for k, base in group.bases.items():
            out[str(group.devices[k])] = base.model.diffusion_model
    return out


@pytest.mark.parametrize("order", ["sequence first", "cfg split first"])
def test_two_by_two_equals_core_cfg_split(stand_in_gpus, split_calls, job, monkeypatch,  # noqa: F811
                                          order):
    patcher = make_tiny_h3(CONFIG, seed=0)
    reference = sample(cfg_split(patcher, 2), job)
    calls_before = len(split_calls)
    if order == "sequence first":
        model = cfg_split(_sequence(patcher), 2)
    else:
        model = _sequence(cfg_split(patcher, 2))
    forwards = ModelForwards(monkeypatch)
    out = sample(model, job)
    assert len(split_calls) > calls_before  # core's CFG Split ran the conds
    assert _same(out, reference)

    mode = get_sequence_parallel(model)
    groups = mode.cfg.finished
    assert [[str(d) for d in g.devices] for g in groups] == [["cpu", "cpu:1"],
                                                             ["cpu:0", "cpu:2"]]
    assert all(g.steps["sequence"] == 1 and g.blocks_run == CONFIG.blocks for g in groups)
    assert mode.steps["sequence"] == 0  # the mode itself ran nothing: its groups did
    # one DiT a GPU, each a distinct model, and each share ran its own rows of each block
    models = _models(model)
    assert set(models) == {"cpu", "cpu:0", "cpu:1", "cpu:2"}
    assert len({id(m) for m in models.values()}) == 4
    rows = forwards.per_model(models)
    assert "other" not in rows
    for group in groups:
        (seq_len,) = group.decisions
        shares = [b - a for a, b in group.split.rows_for(seq_len)]
        assert min(shares) >= 16
        for k, device in enumerate(group.devices):
            assert sorted(rows[str(device)]) == [shares[k]] * CONFIG.blocks
    assert "one sequence group a cond (2x2): cpu+cpu:1, cpu:0+cpu:2" in \
        protocol.status_lines(model)["sequence"]


def test_two_by_two_runs_again_on_the_same_clones(stand_in_gpus, split_calls, job):  # noqa: F811
    """A second run keeps the groups and their base clones (no new deep copy), same output."""
    patcher = make_tiny_h3(CONFIG, seed=0)
    reference = sample(cfg_split(patcher, 2), job)
    model = cfg_split(_sequence(patcher), 2)
    first = sample(model, job)
    mode = get_sequence_parallel(model)
    bases = {key: dict(b) for key, b in mode.cfg.bases.items()}
    second = sample(model, job)
    assert _same(first, reference) and _same(second, reference)
    assert {key: dict(b) for key, b in mode.cfg.bases.items()} == bases and len(bases) == 2
    assert mode.cfg.steps["sequence"] == 4  # two groups, one step each, twice
    assert all(g.runner is None for g in mode.cfg.finished)  # freed after each run
    # after the run nothing of the pack holds CFG Split's copy
    copy = cfg_split_clones(model)[0].model.diffusion_model
    assert all(g.diffusion_model is not copy for g in mode.cfg.finished)


@pytest.mark.parametrize("max_gpus, helpers, left", [
    (2, "cpu:1", "cpu:1 are left"),
    (4, "cpu:0,cpu:1,cpu:2", "none are left"),
    (2, "cpu:0,cpu:1", "cpu:1 are left"),
])
def test_helpers_that_do_not_divide_over_the_conds_are_refused_at_the_node(
        stand_in_gpus, max_gpus, helpers, left):  # noqa: F811
    split = cfg_split(make_tiny_h3(CONFIG), max_gpus)
    with pytest.raises(ValueError) as err:
        _sequence(split, helpers)
    text = str(err.value)
    assert "MultiGPU CFG Split" in text and "the same number of helper GPUs" in text
    assert left in text and "max_gpus to 1" in text and "2x2" in text


def test_uneven_helpers_after_the_pack_are_refused_before_any_model_call(
        stand_in_gpus, split_calls, job):  # noqa: F811
    patcher = make_tiny_h3(CONFIG, seed=0)
    alone = sample(patcher, job)
    model = cfg_split(_sequence(patcher, "cpu:1"), 2)
    forwards_before = len(split_calls)
    with pytest.raises(ValueError, match="the same number of helper GPUs"):
        sample(model, job)
    assert len(split_calls) == forwards_before  # the sampler never ran the model
    assert get_sequence_parallel(model).cfg.bases == {}  # no clone was made
    assert _same(sample(patcher, job), alone)  # ComfyUI is usable afterwards


def test_at_cfg_1_only_the_root_group_runs(stand_in_gpus, job, monkeypatch):  # noqa: F811
    """One cond a step: CFG Split gives the copy nothing, the root's group still splits."""
    inputs, _ = job
    patcher = make_tiny_h3(CONFIG, seed=0)
    reference = run_like_sampler(cfg_split(patcher, 2), inputs)
    model = cfg_split(_sequence(patcher), 2)
    out = run_like_sampler(model, inputs)
    assert _same(out, reference)
    groups = {tuple(str(d) for d in g.devices): g for g in
              get_sequence_parallel(model).cfg.finished}
    assert groups[("cpu", "cpu:1")].steps["sequence"] == 1
    assert groups[("cpu:0", "cpu:2")].steps["sequence"] == 0


@pytest.mark.parametrize("with_cfg_split", [False, True], ids=["sequence", "2x2"])
def test_a_dropped_model_frees_the_mode_and_its_clones(stand_in_gpus, job, with_cfg_split):  # noqa: F811
    """Once the graph drops the model, nothing of the pack keeps the mode, its base clones
    (whole DiT copies) or CFG Split's copy alive: the seam holds its states weakly."""
    import gc
    import weakref

    patcher = make_tiny_h3(CONFIG, seed=0)
    model = _sequence(patcher, HELPERS if with_cfg_split else "cpu:1")
    if with_cfg_split:
        model = cfg_split(model, 2)
    sample(model, job)
    mode = get_sequence_parallel(model)
    bases = [*mode.bases.values(), *(b for d in mode.cfg.bases.values() for b in d.values())]
    assert bases  # the run made its helpers' clones
    refs = [weakref.ref(mode), *(weakref.ref(b.model) for b in bases),
            *(weakref.ref(c.model) for c in cfg_split_clones(model))]
    del model, mode, bases
    from comfyui_h3 import unload_all

    unload_all()
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


def test_a_2x2_plan_sets_up_the_groups_and_core_cfg_split(stand_in_gpus, split_calls, job,  # noqa: F811
                                                         monkeypatch):
    """The drop-in node's apply_plan with a 2x2 plan (four H200s at CFG 4): the pack's sequence
    mode on the plan's three helpers, then core's own CFG Split; output equals core's CFG-split
    output. Two changes to the plan's config, for the stand-ins: its GPU numbers map onto them
    (root gpu:1 -> cpu, CFG Split's gpu:0 -> cpu:0, gpu:2 -> cpu:1, gpu:3 -> cpu:2), and the
    sequence mode is forced (its 'auto', timing H200s, keeps this tiny job's 74 rows whole)."""
    import dataclasses

    import h3_multigpu.sequence as sequence_package
    from h3_multigpu.nodes.features import apply_plan
    from h3_multigpu.nodes.placement import Placement
    from h3_multigpu.planner import PlanRequest, get_profile, plan_job

    pair = get_profile("2xH200")
    four = dataclasses.replace(pair, name="4xH200", gpus=pair.gpus * 2)
    plan = plan_job(PlanRequest(profile=four, seconds=5, lora_rank=128, pass1_cfg=CFG,
                                pass2_cfg=CFG))
    assert {p.mode for p in plan.parallel.passes.values()} == {"cfg_sequence"}
    assert plan.root_device == 1 and list(plan.helper_devices) == [0, 2, 3]
    stand_in = {"cuda:0": "cpu:0", "cuda:2": "cpu:1", "cuda:3": "cpu:2"}
    planned = sequence_package.config_from_plan
    configs = []

    def on_stand_ins(plan, **overrides):
        config = planned(plan, **overrides)
        configs.append(config)
        return dataclasses.replace(config, helpers=tuple(stand_in[h] for h in config.helpers),
                                   parallel="sequence")

    monkeypatch.setattr(sequence_package, "config_from_plan", on_stand_ins)
    patcher = make_tiny_h3(CONFIG, seed=0)
    reference = sample(cfg_split(patcher, 2), job)
    model, lines = apply_plan(patcher.clone(), plan, Placement(root=1, helper=0, gpus=()))
    assert [(c.helpers, c.split, len(c.gpu_speeds)) for c in configs] == [
        (("cuda:0", "cuda:2", "cuda:3"), "1:1:1:1", 4)]
    assert lines["cfg_split"].startswith("ComfyUI's MultiGPU CFG Split (max_gpus 2): cond and "
                                         "uncond one a GPU on cpu, cpu:0")
    assert lines["dual_sage"].startswith("off") and lines["chunking"].startswith("off")
    out = sample(model, job)
    assert split_calls and _same(out, reference)
    groups = get_sequence_parallel(model).cfg.finished
    assert [[str(d) for d in g.devices] for g in groups] == [["cpu", "cpu:1"],
                                                             ["cpu:0", "cpu:2"]]
    assert all(g.steps["sequence"] == 1 for g in groups)
    assert "one sequence group a cond (2x2): cpu+cpu:1, cpu:0+cpu:2" in \
        protocol.status_lines(model)["sequence"]


def test_two_by_two_on_a_bf16_checkpoint_from_comfys_loader(stand_in_gpus, split_calls,  # noqa: F811
                                                            tmp_path):
    """A random-weight bf16 DiT in the official layout, loaded by ComfyUI's UNETLoader path
    (`comfy.sd.load_diffusion_model`, its compute dtype): the 2x2 equals core's CFG split."""
    import types

    from comfyui_h3 import load_dit
    from h3_checkpoints import DiTShape, write_dit

    shape = DiTShape.tiny(heads=4)
    path = write_dit(tmp_path / "dit_bf16.safetensors", shape, "bf16", seed=0)
    patcher = load_dit(path)
    inputs = make_inputs(types.SimpleNamespace(text_dim=shape.text_dim), latent_thw=LONGER,
                         keyframe=True, audio_mask=True, seed=1)
    gen = torch.Generator().manual_seed(7)
    job = inputs, [[torch.randn(inputs.positive[0][0].shape, generator=gen), {}]]
    reference = sample(cfg_split(patcher, 2), job)
    model = cfg_split(_sequence(patcher), 2)
    out = sample(model, job)
    assert split_calls and _same(out, reference)
    groups = get_sequence_parallel(model).cfg.finished
    assert len(groups) == 2 and all(g.steps["sequence"] == 1 for g in groups)
    assert all(g.blocks_run == shape.blocks for g in groups)
