"""`ChunkingConfig`: FFN rows, QKV rows and heads per attention call (0 = off, or "auto")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .sizing import exactness_note

AUTO = "auto"
ChunkValue = int | Literal["auto"]
_FIELDS = ("ffn_chunk", "qkv_chunk", "head_group")
_UNITS = {"ffn_chunk": "rows", "qkv_chunk": "rows", "head_group": "heads per attention call"}


def _validate(name: str, value: Any) -> ChunkValue:
    if isinstance(value, str) and value == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int >= 0 ({_UNITS[name]}, 0 = off) or 'auto', "
                         f"got {value!r}; parse text with ChunkingConfig.from_strings")
    if value < 0:
        raise ValueError(f"{name} must be >= 0 ({_UNITS[name]}, 0 = off) or 'auto', got {value}; "
                         f"use 0 to turn it off")
    return value


def _parse(name: str, text: Any) -> ChunkValue:
    if isinstance(text, int) and not isinstance(text, bool):
        return _validate(name, text)
    if not isinstance(text, str):
        raise ValueError(f"{name} must be text such as 'auto', 'off' or '16384', got {text!r}")
    word = text.strip().lower()
    if word in (AUTO, ""):
        return AUTO
    if word in ("off", "0", "none"):
        return 0
    try:
        value = int(word.replace("_", "").replace(",", ""))
    except ValueError:
        raise ValueError(f"{name} {text!r} is not understood; use 'auto', 'off' or a whole "
                         f"number of {_UNITS[name]} such as 16384") from None
    return _validate(name, value)


@dataclass(frozen=True)
class ChunkingConfig:
    """How one DiT block forward is chunked.

    ffn_chunk: rows per fc1 -> SwiGLU -> fc2 chunk. qkv_chunk: rows per qkv projection chunk
    (LoRA/bypass adapters included) and per out_proj chunk. head_group: heads per attention call.
    0 = off; "auto" sizes it at run time from the memory free on the block's device (off on CPU).
    Chunks of at least `common.floors.EXACT_MIN_ROWS` rows are realised at or above each phase's
    measured row floor (`exact_rows`, per weight format: higher with on-activation adapters,
    none for INT8 ConvRot on NVIDIA GPUs, never a split for NVFP4 without input_scale) and
    groups of at least `common.floors.EXACT_MIN_HEADS` heads stay exact on the GPU ("auto" stays
    there); smaller explicit values run as asked and the status says they may differ at bf16
    rounding, as it does when memory needs a phase chunked that has no known floor.
    blocks: DiT block indices to patch (None = all). headroom_bytes: kept free by "auto" for
    fragmentation, cuBLAS workspaces and weight casts.
    """

    ffn_chunk: ChunkValue = 0
    qkv_chunk: ChunkValue = 0
    head_group: ChunkValue = 0
    blocks: tuple[int, ...] | None = None
    headroom_bytes: int = 512 << 20

    def __post_init__(self) -> None:
        for name in _FIELDS:
            _validate(name, getattr(self, name))
        if self.blocks is not None:
            blocks = tuple(self.blocks)
            if any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in blocks):
                raise ValueError(f"blocks must be DiT block indices >= 0, got {self.blocks!r}")
            object.__setattr__(self, "blocks", blocks)
        if (isinstance(self.headroom_bytes, bool) or not isinstance(self.headroom_bytes, int)
                or self.headroom_bytes < 0):
            raise ValueError(f"headroom_bytes must be an int >= 0, got {self.headroom_bytes!r}")

    @classmethod
    def from_strings(cls, ffn_chunk: str = AUTO, qkv_chunk: str = AUTO,
                     head_group: str = AUTO) -> ChunkingConfig:
        """From node text inputs: "auto", "off"/"0", or a number such as "16384"."""
        return cls(ffn_chunk=_parse("ffn_chunk", ffn_chunk),
                   qkv_chunk=_parse("qkv_chunk", qkv_chunk),
                   head_group=_parse("head_group", head_group))

    @classmethod
    def from_plan(cls, chunking: Any) -> ChunkingConfig:
        """From the planner's `Plan.chunking` (any object with the three fields, or a dict)."""
        get = chunking.get if isinstance(chunking, dict) else (
            lambda name: getattr(chunking, name))
        return cls(**{name: get(name) for name in _FIELDS})

    @property
    def enabled(self) -> bool:
        return any(getattr(self, name) for name in _FIELDS)

    def idle_reasons(self, heads: int | None = None) -> dict[str, str]:
        """Fields set to a size that can never chunk anything, with why (empty when none).

        A row chunk at least as long as any sequence H3's nodes can make splits no call, and a
        head group of all the model's heads is one attention call, as without chunking.
        """
        from ..common.geometry import MAX_SEQUENCE_TOKENS

        idle = {}
        for name in ("ffn_chunk", "qkv_chunk"):
            value = getattr(self, name)
            if isinstance(value, int) and value >= MAX_SEQUENCE_TOKENS:
                idle[name] = (f"{value} rows is longer than any H3 sequence "
                              f"({MAX_SEQUENCE_TOKENS:,} tokens at most)")
        if heads and isinstance(self.head_group, int) and self.head_group >= heads:
            idle["head_group"] = f"{self.head_group} heads/call is all {heads} heads"
        return idle

    def active_with(self, heads: int | None = None) -> bool:
        """True when some field can chunk a call of a model with `heads` heads."""
        idle = self.idle_reasons(heads)
        return any(getattr(self, name) and name not in idle for name in _FIELDS)

    def status(self, block_count: int, heads: int | None = None, *, note: str | None = None,
               kept: tuple[str, ...] = ()) -> str:
        """One line for `transformer_options["h3_multigpu"]["chunking"]`.

        note: the exactness note (default: `exactness_note` of these values alone; chunking
        passes the one for the block's floors). kept: phases left whole to stay exact."""
        if not self.enabled:
            return "off"
        idle = self.idle_reasons(heads)
        if not self.active_with(heads):
            return f"off: {'; '.join(idle.values())}, so nothing would be chunked"

        def show(name: str, unit: str) -> str:
            value = getattr(self, name)
            if name in idle:
                return f"off ({idle[name]})"
            return "off" if value == 0 else f"{value}" if value == AUTO else f"{value} {unit}"

        where = (f"all {block_count} blocks" if self.blocks is None
                 else f"blocks {','.join(map(str, self.blocks))}")
        if note is None:
            note = exactness_note(self.ffn_chunk, self.qkv_chunk, self.head_group)
        left = "".join(f"; {k}" for k in kept)
        return (f"on ({where}): ffn {show('ffn_chunk', 'rows')}, qkv {show('qkv_chunk', 'rows')}"
                f", attention {show('head_group', 'heads/call')}{left}; {note}")
