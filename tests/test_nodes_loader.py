"""The nodes report and apply what the loader that runs does (CPU, on the twin, no ComfyUI):
a DynamicVRAM model is streamed by ComfyUI and the status says so; the pack's streamer serves
the legacy loader; a plan for one loader does not silently stream a model of the other."""

from __future__ import annotations

from twin import TwinConfig, TwinPatcher, make_twin

from h3_multigpu.nodes.devices import GiB, GpuInfo
from h3_multigpu.nodes.features import apply_plan, plan_feature_strings
from h3_multigpu.nodes.placement import decide_placement
from h3_multigpu.nodes.planning import comfy_loader_inputs, make_plan
from h3_multigpu.offload import get_block_prefetch

PAIR = [GpuInfo(0, "NVIDIA GeForce RTX 5060 Ti", 16 * GiB),
        GpuInfo(1, "NVIDIA GeForce RTX 5060 Ti", 16 * GiB)]
SIZES = dict(pass2_width=1312, pass2_height=736, pass1_width=864, pass1_height=480,
             seconds=10.0, devices="2x5060Ti", lora_rank=128)


class DynamicTwinPatcher(TwinPatcher):
    """The twin answering `is_dynamic()` as ComfyUI's ModelPatcherDynamic does (which needs a
    GPU to exist: the GPU tests use the real one)."""

    def is_dynamic(self) -> bool:
        return True


def dynamic(twin) -> DynamicTwinPatcher:
    patcher = DynamicTwinPatcher.__new__(DynamicTwinPatcher)
    patcher.__dict__.update(TwinPatcher(twin).__dict__)
    return patcher


def test_a_dynamic_vram_plan_leaves_the_pack_streamer_out():
    plan = make_plan(**SIZES)  # NVIDIA profile: DynamicVRAM
    assert plan.loader.mode == "dynamic" and plan.prefetch.streamed_blocks > 0
    wanted = plan_feature_strings(plan)["prefetch"]
    assert wanted.startswith("off: ComfyUI DynamicVRAM: its VBAR on gpu:1")
    legacy = make_plan(**SIZES, dynamic_vram="off")
    assert isinstance(plan_feature_strings(legacy)["prefetch"], dict)  # the pack streams


def test_the_status_says_comfyui_streams_a_dynamic_model(tiny_twin):
    plan = make_plan(**SIZES)
    model = dynamic(tiny_twin)
    out, lines = apply_plan(model, plan, decide_placement(PAIR),
                            disabled=("dual_sage", "chunking", "sequence"))
    line = lines["prefetch"]
    assert line.startswith("off: ComfyUI's DynamicVRAM streams this model's weights")
    assert "streaming: ComfyUI DynamicVRAM (comfy-aimdo VBAR on" in line
    assert f"plan: {plan.prefetch.resident_blocks} of 50 blocks resident" in line
    assert out is model and get_block_prefetch(out) is None  # nothing of ours installed


def test_a_legacy_plan_on_a_dynamic_model_still_stands_aside(tiny_twin):
    plan = make_plan(**SIZES, dynamic_vram="off")
    out, lines = apply_plan(dynamic(tiny_twin), plan, decide_placement(PAIR),
                            disabled=("dual_sage", "chunking", "sequence"))
    assert "streaming: ComfyUI DynamicVRAM" in lines["prefetch"]
    assert "made for the legacy loader" in lines["prefetch"]
    assert get_block_prefetch(out) is None


def test_a_dynamic_plan_on_a_legacy_model_is_not_active(tiny_twin):
    plan = make_plan(**SIZES)
    model = TwinPatcher(tiny_twin)
    out, lines = apply_plan(model, plan, decide_placement(PAIR),
                            disabled=("dual_sage", "chunking", "sequence"))
    assert lines["prefetch"].startswith("NOT ACTIVE: the plan leaves the DiT's streaming to "
                                        "ComfyUI's DynamicVRAM")
    assert out is model


def test_the_legacy_loader_gets_the_pack_streamer():
    plan = make_plan(**SIZES, dynamic_vram="off")
    twin = make_twin(TwinConfig.tiny(blocks=50), seed=0)  # the plan's residency is of 50
    out, lines = apply_plan(TwinPatcher(twin), plan, decide_placement(PAIR),
                            disabled=("dual_sage", "chunking", "sequence"))
    assert "streaming: this prefetcher" in lines["prefetch"]
    assert get_block_prefetch(out) is not None


def test_outside_comfyui_the_plan_uses_the_profiles_defaults():
    assert comfy_loader_inputs("auto") == {}  # ComfyUI not running in this process
    assert comfy_loader_inputs("2x5060Ti", object()) == {}  # a profile previews other hardware
