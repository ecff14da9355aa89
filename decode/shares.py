"""What a split decode is given and what it reports: one device's windows, and the report the
status line, the tests and the benchmark read."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class DeviceShare:
    """One device's part: its windows [start, stop) and the model that decodes them there.

    model: the root's loaded model, a helper's model that ComfyUI loaded there (its multi-GPU
    clone), or None: a copy of the root's model is made on `device` (`decode.replica`).
    """

    device: torch.device
    windows: tuple[int, int]
    model: nn.Module | None = None

    @property
    def count(self) -> int:
        return self.windows[1] - self.windows[0]


@dataclass
class DecodeReport:
    """What one split decode did (for the status line, the tests and the benchmark)."""

    devices: list[str]
    windows: list[tuple[int, int]]
    seconds: float = 0.0
    copy_seconds: dict[str, float] = field(default_factory=dict)  # decoder copy per helper
    failed: dict[str, str] = field(default_factory=dict)  # helper -> error, its windows redone
    handovers: int = 0  # cuts cross-faded from the pieces of two ranges (one per cut)
    tile_batches: dict[int, tuple[int, ...]] = field(default_factory=dict)  # window -> calls

    @property
    def same_tile_batches(self) -> bool:
        """Every window decoded with the same tile batches (the one-device decode's pattern)."""
        return len(set(self.tile_batches.values())) <= 1

    def describe(self) -> str:
        pairs = zip(self.devices, self.windows, strict=True)
        parts = [f"{d} windows {a}-{b - 1}" for d, (a, b) in pairs if b > a]
        text = f"decoded on {len(parts)} device(s): " + ", ".join(parts)
        if self.failed:
            text += "; " + "; ".join(f"{d} failed ({e}), its windows redone on the root"
                                     for d, e in self.failed.items())
        return text


class NotFollowed(RuntimeError):
    """The VAE's window loop did not behave as the split follows it (a release it does not
    know): the caller decodes the whole clip on the root with the model's own loop."""
