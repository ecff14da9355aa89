"""Full-size single-block workloads on the twin, for the GPU tests and
`dev/bench/bench_chunking.py`.

One block's activation peak and time are what chunking changes, so a workload is a few
full-size DiT blocks (735 MiB each in bf16) with an on-activation LoRA on qkv_proj and fc1, fed
the packed sequence of a real pass (`[text | audio | video]`, its modulation segments and
rotation table). The block input is kept on the host, so every measured run starts from the
same x and the device holds only what the real run would hold.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from twin import MiniMaxH3Twin, TwinConfig, make_inputs, make_twin
from twin.adapters import ActivationAdapterHook, attach_activation_lora
from twin.dit import PackedInputs

from h3_multigpu.common import geometry

BlockForward = Callable[..., torch.Tensor]


@dataclass
class BlockWorkload:
    model: MiniMaxH3Twin
    hooks: list[ActivationAdapterHook]
    packed: PackedInputs  # packed.h lives on the host (pinned on CUDA); the rest on the device
    tokens: int

    @property
    def x_bytes(self) -> int:
        return self.packed.h.numel() * self.packed.h.element_size()


def make_block_model(cfg: TwinConfig, *, device, dtype: torch.dtype = torch.bfloat16,
                     lora_rank: int = 0, seed: int = 0) -> tuple[MiniMaxH3Twin,
                                                                 list[ActivationAdapterHook]]:
    """A twin (no refiner) with on-activation LoRA of `lora_rank` on every qkv_proj and fc1."""
    model = make_twin(cfg, dtype=dtype, device=device, seed=seed)
    hooks = []
    if lora_rank:
        for i, block in enumerate(model.blocks):
            hooks.append(attach_activation_lora(block.attn.qkv_proj, lora_rank, seed=seed + 2 * i))
            hooks.append(attach_activation_lora(block.mlp.fc1, lora_rank, seed=seed + 2 * i + 1))
    return model, hooks


def pack_workload(model: MiniMaxH3Twin, hooks: list[ActivationAdapterHook], *, latent_t: int,
                  latent_h: int, latent_w: int, audio_t: int, text_tokens: int,
                  seed: int = 0) -> BlockWorkload:
    """Pack one forward's inputs on the model's device; the block input x goes to the host."""
    param = next(model.blocks.parameters())
    x, timestep, context = make_inputs(model.cfg, latent_t=latent_t, latent_h=latent_h,
                                       latent_w=latent_w, audio_t=audio_t, text_len=text_tokens,
                                       dtype=param.dtype, device=param.device, seed=seed)
    with torch.no_grad():
        packed = model.pack(x, timestep, context, transformer_options={})
    host = packed.h.to("cpu")
    if param.device.type == "cuda":
        host = host.pin_memory()
    packed.h = host
    del x, context
    release_cached(param.device)
    return BlockWorkload(model, hooks, packed, host.shape[0])


def pass_workload(model: MiniMaxH3Twin, hooks: list[ActivationAdapterHook], *, width: int,
                  height: int, frames: int, text_tokens: int = 256,
                  seed: int = 0) -> BlockWorkload:
    """The packed sequence of an H3 pass at width x height and `frames` (17k+5)."""
    _, _, t, h, w = geometry.latent_shape(width, height, frames)
    return pack_workload(model, hooks, latent_t=t, latent_h=h, latent_w=w,
                         audio_t=geometry.audio_latent_steps(frames), text_tokens=text_tokens,
                         seed=seed)


def release_cached(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass
class BlockRun:
    output: torch.Tensor  # host copy of x after the blocks
    seconds: list[float]  # per run, all blocks
    activation_peak_bytes: int | None  # max over runs; x included, weights excluded


def run_blocks(workload: BlockWorkload, forwards: list[BlockForward], *, repeats: int = 1,
               warmup: int = 1) -> BlockRun:
    """Run x through `forwards` (one per block) `warmup + repeats` times from the same input.

    On CUDA each timed run is bracketed by events and its peak is
    `max_memory_allocated - (allocated before the run - x)`; on the CPU only wall time is kept.
    """
    packed = workload.packed
    device = packed.rope_freqs.device
    cuda = device.type == "cuda"
    seconds: list[float] = []
    peak: int | None = None
    output = None
    for i in range(warmup + repeats):
        x = packed.h.to(device, non_blocking=False)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device) - workload.x_bytes
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record()
        began = time.perf_counter()
        with torch.no_grad():
            for forward in forwards:
                x = forward(x, packed.t_emb, packed.mod_segments, packed.rope_freqs,
                            transformer_options={})
        if cuda:
            stop.record()
            torch.cuda.synchronize(device)
            if i >= warmup:
                seconds.append(start.elapsed_time(stop) / 1000.0)
                run_peak = torch.cuda.max_memory_allocated(device) - base
                peak = run_peak if peak is None else max(peak, run_peak)
        elif i >= warmup:
            seconds.append(time.perf_counter() - began)
        if i == warmup + repeats - 1:
            output = x.to("cpu")
        del x
    assert output is not None
    return BlockRun(output, seconds, peak)


def attention_output_needs_copy(device, dtype: torch.dtype = torch.bfloat16,
                                heads: int = geometry.HEADS, head_dim: int = geometry.HEAD_DIM,
                                tokens: int = 2048) -> bool:
    """Whether SDPA on the twin's strided q/k/v views returns a layout that `reshape` copies."""
    qkv = torch.zeros(tokens, 3 * heads * head_dim, dtype=dtype, device=device)
    q, k, v = (t.view(tokens, heads, head_dim).transpose(0, 1).unsqueeze(0)
               for t in qkv.split(heads * head_dim, dim=-1))
    with torch.no_grad():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return not out.transpose(1, 2).is_contiguous()


def rms_norm_temporary_bytes(device, dtype: torch.dtype = torch.bfloat16, hidden: int = 5376,
                             rows: int = 4096) -> float:
    """Bytes per [S, C] element RMSNorm allocates beyond its output (measured; 0 off-GPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0.0
    x = torch.randn(rows, hidden, dtype=dtype, device=device)
    norm = torch.nn.RMSNorm(hidden, dtype=dtype, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.no_grad():
        out = norm(x)
    extra = torch.cuda.max_memory_allocated(device) - before - out.numel() * out.element_size()
    return max(extra, 0) / x.numel()


class ChunkedBlockCall:
    """Block `index` of a chunked patcher called like a block forward: upstream's (the twin's)
    own `forward` with the chunk wrappers on for the call and the patcher's options (the
    head-group override) in force. `last_plan` / `last_chunks`: what the block last ran."""

    def __init__(self, patcher, index: int):
        from h3_multigpu.chunking import get_chunking

        self.runtime = get_chunking(patcher)
        self.chunker = self.runtime.chunkers[index]
        self.options = patcher.model_options["transformer_options"]

    @property
    def last_plan(self):
        return self.chunker.last_plan

    @property
    def last_chunks(self):
        return self.chunker.last_chunks

    def __call__(self, x, t_emb, mod_segments, rope_freqs, transformer_options=None):
        options = {**self.options, **(transformer_options or {})}
        with self.runtime.wrapped():
            return self.chunker.block.forward(x, t_emb, mod_segments, rope_freqs,
                                              transformer_options=options)


def chunked_forwards(patcher) -> list[ChunkedBlockCall]:
    """One `ChunkedBlockCall` per chunked block of `patcher`, in block order."""
    from h3_multigpu.chunking import get_chunking

    return [ChunkedBlockCall(patcher, i) for i in sorted(get_chunking(patcher).chunkers)]
