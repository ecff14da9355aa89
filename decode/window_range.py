"""One range of windows of a split decode on one device (`decode.executor`): the VAE's own
window loop on a view of the device's model that counts windows, records tile batches and keeps
the two boundary pieces the split cross-fades afterwards."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..comfy_seam import vae
from .replica import drop_restored_methods

if TYPE_CHECKING:
    from .executor import SplitDecode


class Stopped(Exception):
    """Raised inside a worker's window loop once the decode is stopped (interrupt, root error)."""


class WindowRange:
    """One range of windows on one device: the model's own `decode_temporal` on a view of the
    device's model whose `_adaptive_decode`, `_decode_pixels` and `_finalize_pixels` are wrapped
    to count windows, record tile batches and keep the two boundary pieces. The wrappers call
    the class's own methods with the same arguments and return their results unchanged."""

    def __init__(self, run: SplitDecode, model: nn.Module, windows: tuple[int, int],
                 on_window: Callable[[int], None]) -> None:
        self.run, self.windows, self.on_window = run, windows, on_window
        self.cls = type(model)
        view = copy.copy(model)  # shares every module and tensor; our wrappers live on it only
        drop_restored_methods(view, model)
        vae.drop_loop_patch(view)  # our own object patch, when on the root
        view._adaptive_decode = self._adaptive_decode
        view._decode_pixels = self._decode_pixels
        view._finalize_pixels = self._finalize_pixels
        self.view = view
        self.done = 0  # windows decoded so far
        self.window: int | None = None  # the window being decoded (for the tile batches)
        self.first_part: torch.Tensor | None = None  # the first head, raw, before any blend
        self.last_part: torch.Tensor | None = None  # the last part of the last window
        self.last_window_parts = 0  # parts of the last window (2: a head and a tail)

    @property
    def count(self) -> int:
        return self.windows[1] - self.windows[0]

    def _adaptive_decode(self, clip: torch.Tensor) -> torch.Tensor:
        if self.run.stop.is_set():
            raise Stopped()
        self.window = self.windows[0] + self.done
        out = self.cls._adaptive_decode(self.view, clip)
        self.window = None
        self.done += 1
        self.on_window(self.windows[0] + self.done - 1)
        return out

    def _decode_pixels(self, z: torch.Tensor) -> torch.Tensor:
        self.run.record_call(self.window, int(z.shape[0]))
        return self.cls._decode_pixels(self.view, z)

    def _finalize_pixels(self, part: torch.Tensor) -> torch.Tensor:
        if self.first_part is None and self.windows[0] > 0:
            self.first_part = part.clone()  # a view would keep the whole window alive
        if self.done == self.count:
            self.last_window_parts += 1
            self.last_part = part
        return self.cls._finalize_pixels(self.view, part)

    def decode(self, z_BCTHW: torch.Tensor, output: torch.Tensor) -> None:
        self.cls.decode_temporal(self.view, z_BCTHW, output)

    @property
    def tail(self) -> torch.Tensor | None:
        """The last window's tail (None when the model keeps no tails)."""
        return self.last_part if self.last_window_parts >= 2 else None
