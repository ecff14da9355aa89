"""Bad days without ComfyUI (CPU): the host-RAM rule of the planner (a faked small host, cgroup
limits read from fake cgroup files), the out-of-memory message, the guard's place among the
wrappers, and ComfyUI's cancel seen between the upscaler's blocks. The same cases on ComfyUI's
real sampler path: tests/test_bad_days_comfyui.py."""

from __future__ import annotations

import sys
import types
from dataclasses import replace

import pytest
import torch
from twin import TwinPatcher

from h3_multigpu.comfy_seam.interrupts import is_interrupt, raise_if_interrupted
from h3_multigpu.comfy_seam.names import GUARD_KEY
from h3_multigpu.guard import oom
from h3_multigpu.guard.device import guard_diffusion_model
from h3_multigpu.planner import PlanRequest, plan_job
from h3_multigpu.planner import host as host_mod
from h3_multigpu.planner.hardware import GiB, get_profile


# ------------------------------------------------------------------------------ host RAM
def small_host(ram_gib: float, name: str = "2xR9700"):
    return replace(get_profile(name), host_ram_bytes=int(ram_gib * GiB),
                   host_ram_source="a faked small host")


def test_a_host_with_too_little_ram_is_refused_with_the_numbers():
    roomy = plan_job(PlanRequest(seconds=15, profile=small_host(128)))
    assert roomy.fits and roomy.host.fits
    need = roomy.host.needed_bytes
    assert need > 20 * GiB  # text encoder, VAEs, LoRA, decoded frames, runtime
    plan = plan_job(PlanRequest(seconds=15, profile=small_host(need / GiB - 2)))
    assert not plan.fits and not plan.host.fits
    problem = next(p for p in plan.problems if p.startswith("host RAM"))
    assert f"{need / GiB:.1f} GiB in host memory" in problem
    assert f"{need / GiB - 2:.1f} GiB are available (a faked small host)" in problem
    assert "2.0 GiB short" in problem and "container's memory limit" in problem
    report = plan.report()
    first = report.splitlines()[0]
    assert first.startswith("DOES NOT FIT") and "host RAM needs" in first, first
    assert "host RAM: needs" in report and "DOES NOT FIT --" in report
    assert plan.to_dict()["host_ram"]["fits"] is False


def test_host_ram_counts_the_whole_dit_under_dynamic_vram_and_the_decoded_frames():
    legacy = plan_job(PlanRequest(seconds=5, profile=small_host(128), dynamic_vram="off"))
    dynamic = plan_job(PlanRequest(seconds=5, profile=small_host(128), dynamic_vram="on"))
    assert dynamic.host.parts["DiT host copy"] == dynamic.sizes.dit_bytes
    streamed = legacy.prefetch.streamed_blocks
    assert legacy.host.parts["DiT host copy"] == (
        (streamed + legacy.prefetch.streamed_refiner_blocks) * legacy.sizes.dit_block_bytes
        if streamed else 0)
    long = plan_job(PlanRequest(seconds=15, profile=small_host(128), dynamic_vram="on"))
    frames = long.host.parts["decoded video"] - dynamic.host.parts["decoded video"]
    assert frames == (362 - 124) * 1312 * 736 * 12


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize("files,expected", [
    ({"memory.max": "8589934592\n"}, 8 * GiB),  # cgroup v2, root group
    ({"memory.max": "max\n"}, None),  # v2 without a limit
    ({"memory/memory.limit_in_bytes": "4294967296\n"}, 4 * GiB),  # v1
    ({"memory/memory.limit_in_bytes": "9223372036854771712\n"}, None),  # v1 "no limit"
    ({}, None),
])
def test_cgroup_limits_are_read_from_v2_and_v1_files(tmp_path, monkeypatch, files, expected):
    monkeypatch.setattr(host_mod.Path, "read_text", _no_proc(host_mod.Path.read_text))
    for name, text in files.items():
        write(tmp_path / name, text)
    limit, source = host_mod.cgroup_limit_bytes(tmp_path)
    assert limit == expected
    assert (str(tmp_path) in source) == (expected is not None)


def _no_proc(read_text):
    def read(self, *args, **kwargs):
        if str(self) == "/proc/self/cgroup":
            raise OSError("no /proc here")
        return read_text(self, *args, **kwargs)
    return read


def test_the_hosts_limit_is_the_smaller_of_its_ram_and_its_cgroup(monkeypatch):
    monkeypatch.setattr(host_mod, "_physical_bytes", lambda: (64 * GiB, "physical RAM"))
    monkeypatch.setattr(host_mod, "cgroup_limit_bytes", lambda: (16 * GiB, "cgroup limit (x)"))
    assert host_mod.host_memory_limit() == (16 * GiB, "cgroup limit (x)")
    monkeypatch.setattr(host_mod, "cgroup_limit_bytes", lambda: (None, ""))
    assert host_mod.host_memory_limit() == (64 * GiB, "physical RAM")


# ------------------------------------------------------------------------------ OOM message
def test_the_oom_message_keeps_torchs_text_first_and_says_what_to_change():
    ctx = oom.RunContext(device="cuda:1", steps=4, done=2, latent_thw=(107, 46, 82), audio_t=603,
                         features=("dual_sage", "prefetch"))
    freed = oom.PackMemory(workspace_bytes=GiB, slot_bytes=2 * GiB)
    exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.18 GiB. GPU 1 has a "
                                 "total capacity of 31.86 GiB of which 3.2 GiB is free.")
    text = oom.oom_message(exc, ctx, freed)
    assert text.startswith(str(exc))
    assert "out of memory on gpu:1 (31.86 GiB) at sampling step 3 of 4" in text
    assert "1312x736 px" in text and f"{ctx.tokens:,} video+audio tokens" in text
    assert ctx.tokens == 107 * 23 * 41 + 2 * 603  # 362 frames
    assert "Dual-Sage workspaces 1.00 GiB, prefetch slots 2.00 GiB" in text
    assert "h3-multigpu plan --gpus auto --width 1312 --height 736 --frames 362" in text


def test_the_oom_message_names_a_capped_cards_allowance():
    """Under a per-process memory fraction (a smaller card emulated, or a user's cap) the
    allowance ran out, not the card: the message says both (as torch does)."""
    ctx = oom.RunContext(device="cuda:0", steps=1, done=0, latent_thw=(357, 46, 82), audio_t=10)
    exc = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 4.55 GiB. GPU 0 has a total capacity of 139.80 GiB"
        " of which 108.65 GiB is free. Including non-PyTorch memory, this process has 31.11 GiB "
        "memory in use. 32.00 GiB allowed; Of the allocated memory 25.51 GiB is allocated")
    text = oom.oom_message(exc, ctx, oom.PackMemory())
    assert "out of memory on gpu:0 (32.00 GiB allowed of 139.80 GiB) at sampling step 1" in text


def test_oom_detection_and_the_guards_place_among_the_wrappers():
    assert oom.is_oom(torch.OutOfMemoryError("x"))
    assert oom.is_oom(RuntimeError("HIP out of memory"))
    assert not oom.is_oom(RuntimeError("shapes do not match"))
    assert issubclass(oom.PackOutOfMemoryError, torch.OutOfMemoryError)
    patcher = TwinPatcher(torch.nn.Linear(2, 2))
    patcher.add_wrapper_with_key("outer_sample", "other", "f")
    guard_diffusion_model(guard_diffusion_model(patcher))  # twice: no second guard
    keys = list(patcher.wrappers["outer_sample"])
    assert keys == [GUARD_KEY, oom.OOM_GUARD_KEY, "other"]
    assert patcher.wrappers["outer_sample"][oom.OOM_GUARD_KEY] == [oom.outer_sample_oom_guard]


class _Executor:
    def __init__(self, fail, patcher):
        self.fail = fail
        self.class_obj = types.SimpleNamespace(model_patcher=patcher)

    def __call__(self, *args, **kwargs):
        callback = args[5]
        callback(0, None, None, 3)  # one step done
        raise self.fail


def test_the_wrapper_counts_steps_and_chains_the_cause():
    patcher = types.SimpleNamespace(load_device="cuda:1", model_options={
        "transformer_options": {"h3_multigpu": {"chunking": "on"}}})
    cause = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
    sigmas = torch.zeros(4)
    with pytest.raises(oom.PackOutOfMemoryError) as caught:
        oom.outer_sample_oom_guard(_Executor(cause, patcher), None, None, None, sigmas, None,
                                   None, False, 0, latent_shapes=[(1, 24, 37, 46, 82),
                                                                  (1, 32, 2, 203)])
    assert caught.value.__cause__ is cause
    text = str(caught.value)
    assert "on cuda:1 at sampling step 2 of 3" in text and "features on: chunking" in text
    assert "--frames 124" in text
    other = ValueError("no")
    with pytest.raises(ValueError) as plain:
        oom.outer_sample_oom_guard(_Executor(other, patcher), None, None, None, sigmas, None,
                                   None, False, 0)
    assert plain.value is other


# ------------------------------------------------------------------------------ cancel
class InterruptProcessingException(Exception):
    pass


@pytest.fixture
def fake_comfy(monkeypatch):
    """A stand-in for comfy.model_management's cancel flag (ComfyUI's semantics: the check
    clears the flag as it raises)."""
    state = {"flag": False, "checks": 0}
    mm = types.ModuleType("comfy.model_management")

    def throw():
        state["checks"] += 1
        if state["flag"]:
            state["flag"] = False
            raise InterruptProcessingException()

    mm.throw_exception_if_processing_interrupted = throw
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    return state


def test_check_interrupt_follows_comfyuis_flag(fake_comfy):
    raise_if_interrupted()
    fake_comfy["flag"] = True
    with pytest.raises(InterruptProcessingException) as caught:
        raise_if_interrupted()
    assert is_interrupt(caught.value) and not fake_comfy["flag"]
    assert not is_interrupt(RuntimeError("x"))


def test_the_upscaler_stops_between_blocks_on_a_cancel(fake_comfy):
    from h3_multigpu.upscale.network import H3LatentUpscaler, UpscalerShape

    net = H3LatentUpscaler(UpscalerShape(channels=32, in_blocks=3, out_blocks=3)).eval()
    ran = []
    for block in [*net.in_blocks, *net.out_blocks]:
        block.register_forward_pre_hook(lambda m, a: ran.append(m))
    second = net.in_blocks[1]
    handle = second.register_forward_hook(lambda m, a, out: fake_comfy.update(flag=True))
    x = torch.randn(1, 24, 2, 4, 4)
    with torch.inference_mode(), pytest.raises(InterruptProcessingException):
        net(x, 1.5, (2, 6, 6))
    assert len(ran) == 2  # the cancel after the second block stopped it before the third
    handle.remove()
    ran.clear()
    with torch.inference_mode():
        net(x, 1.5, (2, 6, 6))
    blocks = len(net.in_blocks) + len(net.out_blocks)
    assert len(ran) == blocks and fake_comfy["checks"] >= blocks
