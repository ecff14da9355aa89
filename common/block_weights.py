"""What moves: one block's tensors, laid out in one flat byte buffer, and how they are bound.

Shared by the prefetcher (`offload/`: the host copy and the device slots) and the sequence
mode's own helper binding (`sequence/weights.py`: a helper's replica or streamed slots).

A block's weights are every parameter and buffer under its module (linears, q/k norms, AdaLN
projection, anything a loader added). Each tensor is flattened into *leaves*, the plain tensors
that hold its bytes: a plain tensor is its own leaf; a quantized tensor (comfy-kitchen's
`QuantizedTensor`, what ComfyUI's INT8/FP8/NVFP4 weights are) contributes its storage `_qdata`
and every tensor field of its layout params (scales, block scales). Leaves are moved as raw
bytes, never dequantized.

The same `BlockLayout` (offsets aligned to `alignment.ALIGNMENT`) is used for the host copy and for
every device slot, so streaming a block is one contiguous copy.

Binding keeps module objects and state-dict keys: a plain tensor gets `.data` swapped; a
quantized tensor gets its `_qdata` / `_params` swapped in place. `TensorRef` resolves the tensor
by (owner module, attribute name) every time, so a loader that replaced a parameter object
(ComfyUI re-patching a LoRA with `set_attr_param`) is noticed by `BlockWeights.is_bound_to`.

A quantized tensor's device is fixed when it is built (comfy-kitchen's `QuantizedTensor` is a
wrapper subclass: `.device` is its qdata's device at construction), so swapping its `_qdata`
for a view on another device would leave it reporting the old one, and ComfyUI's cast
(`ops.cast_bias_weight`: the weight is "not on the compute device") would copy the whole
weight on every call. Binding to a buffer on another device (a device slot, a helper GPU)
therefore puts a wrapper of its own in the module for as long as the block runs: a
`QuantizedTensor` built by comfy-kitchen's constructor from the views, with the tensor's layout
and non-tensor params (`swap_in`), and `restore` puts the module's own object back. The
wrappers are built once per buffer and tensor and reused while the layout holds.

Aliases: ComfyUI backs a weight up with `weight.to(offload_device, copy=False)`, which for a
weight bound to the host copy is the bound object itself. Before the host copy is overwritten
with other bytes, every object that was bound to it and is no longer the module's tensor (a
backup ComfyUI still holds) gets private storage (`detach_replaced`), so the backup keeps the
bytes it was taken with. Objects nobody holds any more are skipped (weak references).
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from .alignment import aligned

PLAIN = "plain"  # the field name of a plain tensor's single leaf
QDATA = "_qdata"
QUANTIZED, SWAPPED = "quantized", "swapped"  # kinds of `swap_in` records (and PLAIN)


def is_quantized(tensor: torch.Tensor) -> bool:
    """A comfy-kitchen style quantized tensor: raw storage plus a dataclass of scale tensors."""
    params = getattr(tensor, "_params", None)
    return (isinstance(getattr(tensor, QDATA, None), torch.Tensor)
            and dataclasses.is_dataclass(params) and hasattr(params, "_tensor_fields"))


def leaves_of(tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(field, plain tensor) pairs holding the bytes of `tensor`."""
    if is_quantized(tensor):
        params = tensor._params
        return [(QDATA, tensor._qdata)] + [(f, getattr(params, f)) for f in params._tensor_fields()]
    return [(PLAIN, tensor)]


@dataclass(frozen=True)
class TensorRef:
    """A parameter or buffer, found by its owner and attribute name (never cached)."""

    owner: torch.nn.Module
    name: str
    is_buffer: bool

    def current(self) -> torch.Tensor:
        table = self.owner._buffers if self.is_buffer else self.owner._parameters
        return table[self.name]


@dataclass(frozen=True)
class Leaf:
    ref_index: int
    field: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BlockLayout:
    """Where each leaf of a block lives in a flat uint8 buffer."""

    leaves: tuple[Leaf, ...]
    nbytes: int

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> BlockLayout:
        leaves, offset = [], 0
        for index, tensor in enumerate(tensors):
            for field, leaf in leaves_of(tensor):
                nbytes = leaf.numel() * leaf.element_size()
                leaves.append(Leaf(index, field, leaf.dtype, tuple(leaf.shape), offset, nbytes))
                offset += aligned(nbytes)
        return cls(tuple(leaves), offset)

    def signature(self) -> tuple:
        return tuple((leaf.ref_index, leaf.field, leaf.dtype, leaf.shape) for leaf in self.leaves)

    def views(self, flat_u8: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """Per tensor, {field: view into `flat_u8`} with the leaf's dtype and shape."""
        out: list[dict[str, torch.Tensor]] = [{} for _ in range(self.leaves[-1].ref_index + 1)] \
            if self.leaves else []
        for leaf in self.leaves:
            raw = flat_u8[leaf.offset:leaf.offset + leaf.nbytes]
            out[leaf.ref_index][leaf.field] = raw.view(leaf.dtype).view(leaf.shape)
        return out


class BlockWeights:
    """Every tensor of one block module, its layout, and binding to a flat buffer's views."""

    def __init__(self, block_id: str, module: torch.nn.Module):
        self.block_id = block_id
        self.module = module
        self.refs = _tensor_refs(module)
        self.layout = BlockLayout.of(self.tensors())
        # views per flat buffer (host copy, each slot): built once, bound every time the block runs
        self._views: dict[int, list[dict[str, torch.Tensor]]] = {}
        # per tensor, the object last bound to a buffer of ours (weakly: a dropped one is gone)
        self._bound: list[weakref.ref | None] = [None] * len(self.refs)
        # quantized wrappers on another device, per (buffer, tensor): see `swap_in`
        self._wrappers: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def tensors(self) -> list[torch.Tensor]:
        return [ref.current() for ref in self.refs]

    def device_bytes(self, device: torch.device) -> int:
        """Bytes of this block's leaves currently on `device` (for the 'auto' residency)."""
        return sum(leaf.numel() * leaf.element_size() for t in self.tensors()
                   for _, leaf in leaves_of(t) if leaf.device == device)

    def relayout(self) -> bool:
        """Recompute the layout from the current tensors; True when it changed."""
        self.refs = _tensor_refs(self.module)  # a loader may have added or dropped a tensor
        self._bound = (self._bound + [None] * len(self.refs))[:len(self.refs)]
        layout = BlockLayout.of(self.tensors())
        changed = layout.signature() != self.layout.signature()
        self.layout = layout
        self.forget_views()
        return changed

    def forget_views(self) -> None:
        """Drop cached views and wrappers (their buffers are being freed or replaced)."""
        self._views.clear()
        self._wrappers.clear()

    def views(self, flat_u8: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        key = flat_u8.data_ptr()
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = self.layout.views(flat_u8)
        return views

    def swap_in(self, flat_u8: torch.Tensor) -> list[tuple]:
        """Point the block's tensors at `flat_u8` for one run; returns what `restore` undoes.

        Plain tensors get `.data` swapped (their device follows). A quantized tensor on
        another device than `flat_u8` is replaced in its module, for the run, by a wrapper
        built on `flat_u8`'s device (see the module docstring); one on the same device is
        bound in place. The module's own objects and `_bound` are left as they were."""
        saved: list[tuple] = []
        for index, (ref, views) in enumerate(zip(self.refs, self.views(flat_u8), strict=True)):
            tensor = ref.current()
            if is_quantized(tensor) and tensor.device != flat_u8.device:
                table = ref.owner._buffers if ref.is_buffer else ref.owner._parameters
                saved.append((SWAPPED, table, ref.name, tensor))
                table[ref.name] = self._device_wrapper(flat_u8, index, tensor, views)
            elif is_quantized(tensor):
                saved.append((QUANTIZED, tensor, tensor._qdata, tensor._params))
                bind_leaves(tensor, views)
            else:
                saved.append((PLAIN, tensor, tensor.data, None))
                tensor.data = views[PLAIN]
        return saved

    @staticmethod
    def restore(saved: list[tuple]) -> None:
        """Undo `swap_in`: the module's own objects and bindings, in reverse order."""
        for kind, a, b, c in reversed(saved):
            if kind == SWAPPED:
                a[b] = c  # the module's own object back in its table
            elif kind == QUANTIZED:
                a._qdata, a._params = b, c
            else:
                a.data = b

    def _device_wrapper(self, flat_u8: torch.Tensor, index: int, tensor: torch.Tensor,
                        views: dict[str, torch.Tensor]) -> torch.Tensor:
        """A quantized tensor like `tensor` whose qdata and scales are `views` (on their
        device), cached per buffer and tensor while the layout and non-tensor params hold."""
        key = (flat_u8.data_ptr(), index)
        spec = (type(tensor), tensor._layout_cls, _non_tensor_params(tensor))
        cached = self._wrappers.get(key)
        if cached is not None and cached[0] == spec:
            return cached[1]
        wrapper = device_wrapper(tensor, views)
        self._wrappers[key] = (spec, wrapper)
        return wrapper

    def copy_into(self, flat_u8: torch.Tensor) -> None:
        """Write the current tensors' bytes into `flat_u8` (synchronous, setup only)."""
        for tensor, views in zip(self.tensors(), self.layout.views(flat_u8), strict=True):
            for field, leaf in leaves_of(tensor):
                views[field].copy_(leaf)

    def bind(self, flat_u8: torch.Tensor) -> None:
        """Point every tensor of the block at its view in `flat_u8`."""
        for index, (tensor, views) in enumerate(zip(self.tensors(), self.views(flat_u8),
                                                    strict=True)):
            bind_leaves(tensor, views)
            self._bound[index] = weakref.ref(tensor)

    def ref_index(self, owner: torch.nn.Module, name: str) -> int | None:
        """Which of the block's tensors `owner.<name>` is (None: not one of them)."""
        for index, ref in enumerate(self.refs):
            if ref.owner is owner and ref.name == name:
                return index
        return None

    def adopt(self, index: int, flat_u8: torch.Tensor) -> bool:
        """Copy tensor `index` (just replaced by the loader) into its view in `flat_u8` and bind
        it there; False when its shape or dtype no longer match the layout (re-register)."""
        tensor = self.refs[index].current()
        views = self.views(flat_u8)[index]
        leaves = dict(leaves_of(tensor))
        if leaves.keys() != views.keys() or any(
                leaves[f].dtype != v.dtype or leaves[f].shape != v.shape
                for f, v in views.items()):
            return False
        for field, view in views.items():
            view.copy_(leaves[field])
        bind_leaves(tensor, views)
        self._bound[index] = weakref.ref(tensor)
        return True

    def detach_replaced(self, flat_u8: torch.Tensor) -> int:
        """Give private storage to every object once bound into `flat_u8` that the block no
        longer holds (ComfyUI's backup of a patched weight). Returns how many were detached."""
        detached = 0
        tensors = self.tensors()
        for index, weak in enumerate(self._bound):
            old = None if weak is None else weak()
            if old is None or (index < len(tensors) and old is tensors[index]):
                continue
            if aliases(old, flat_u8):
                give_private_storage(old)
                detached += 1
            self._bound[index] = None
        return detached

    def materialize(self, flat_u8: torch.Tensor, device: torch.device) -> None:
        """Give every tensor still bound into `flat_u8` its own storage on `device` (a copy of
        its bytes there), and every earlier bound object its own storage where it is, so
        nothing refers to `flat_u8` afterwards. Tensors the loader replaced are left alone."""
        self.detach_replaced(flat_u8)
        device = torch.device(device)
        for ref in self.refs:
            tensor = ref.current()
            if not aliases(tensor, flat_u8):
                continue
            own = {f: leaf.to(device, copy=True) for f, leaf in leaves_of(tensor)}
            if is_quantized(tensor) and tensor.device != device:
                # a wrapper reports the device it was built on: build one there, for good
                table = ref.owner._buffers if ref.is_buffer else ref.owner._parameters
                table[ref.name] = device_wrapper(tensor, own)
            else:
                bind_leaves(tensor, own)
        self._bound = [None] * len(self.refs)

    def is_bound_to(self, flat_u8: torch.Tensor) -> bool:
        """True when every leaf still lives at its offset in `flat_u8`."""
        base = flat_u8.data_ptr()
        tensors = self.tensors()
        for leaf in self.layout.leaves:
            if leaf.ref_index >= len(tensors):
                return False
            fields = dict(leaves_of(tensors[leaf.ref_index]))
            current = fields.get(leaf.field)
            if leaf.nbytes == 0 and current is not None:
                continue  # empty tensors may report any pointer
            if current is None or current.data_ptr() != base + leaf.offset:
                return False
        return True


def aliases(tensor: torch.Tensor, flat_u8: torch.Tensor) -> bool:
    """True when any leaf of `tensor` lives inside `flat_u8`'s bytes."""
    if tensor.device != flat_u8.device:
        return False
    lo = flat_u8.data_ptr()
    hi = lo + flat_u8.numel()
    return any(leaf.numel() and lo <= leaf.data_ptr() < hi for _, leaf in leaves_of(tensor))


def give_private_storage(tensor: torch.Tensor) -> None:
    """Copy `tensor`'s leaves into storage of its own, in place (same object, same device)."""
    bind_leaves(tensor, {field: leaf.clone() for field, leaf in leaves_of(tensor)})


def _non_tensor_params(tensor: torch.Tensor) -> tuple:
    params = tensor._params
    tensor_fields = set(params._tensor_fields())
    return tuple((f.name, getattr(params, f.name)) for f in dataclasses.fields(params)
                 if f.name not in tensor_fields)


def device_wrapper(tensor: torch.Tensor, views: dict[str, torch.Tensor]) -> torch.Tensor:
    """A quantized tensor with `tensor`'s layout and non-tensor params whose leaves are `views`,
    reporting their device: comfy-kitchen's own constructor `QuantizedTensor(qdata,
    layout_cls, params)` (0.2.31 with ComfyUI 0.33.0, 0.2.40), nothing of its layout restated.
    Flagged as a parameter the way `torch.nn.Parameter` flags a tensor subclass."""
    params = dataclasses.replace(tensor._params,
                                 **{f: v for f, v in views.items() if f != QDATA})
    wrapper = type(tensor)(views[QDATA], tensor._layout_cls, params)
    if getattr(tensor, "_is_param", False):
        wrapper._is_param = True
    return wrapper


def bind_leaves(tensor: torch.Tensor, views: dict[str, torch.Tensor]) -> None:
    """Point `tensor` (plain or quantized) at `views`, one per leaf field."""
    if is_quantized(tensor):
        fields = {f: v for f, v in views.items() if f != QDATA}
        tensor._qdata = views[QDATA]
        tensor._params = dataclasses.replace(tensor._params, **fields)
    else:
        tensor.data = views[PLAIN]


def _tensor_refs(module: torch.nn.Module) -> list[TensorRef]:
    """Parameters then buffers of every submodule, each tensor object once."""
    refs, seen = [], set()
    for owner in module.modules():
        for is_buffer, table in ((False, owner._parameters), (True, owner._buffers)):
            for name, tensor in table.items():
                if tensor is None or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                refs.append(TensorRef(owner, name, is_buffer))
    return refs


def module_bytes(module: torch.nn.Module) -> int:
    """Flat-buffer bytes of a block (aligned leaves), read from shapes only: nothing moves."""
    return BlockLayout.of([ref.current() for ref in _tensor_refs(module)]).nbytes
