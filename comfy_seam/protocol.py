"""Install / remove / describe: how every feature puts its hooks on a ComfyUI ModelPatcher.

A feature never calls the patcher's hook API itself. It declares what it installs, as `Hook`s,
and calls `install(patcher, feature, *hooks)` on its clone. The seam
- applies each hook through the patcher's public API (`add_wrapper_with_key`,
  `add_callback_with_key`, `set_model_patch_replace`, `add_object_patch`, `set_attachments`,
  the override in `transformer_options`), on ComfyUI's ModelPatcher and on the twin's
  `TwinPatcher` alike;
- keeps ONE stated order: wrappers of a type run outermost first in `ORDER` (the device guard
  encloses everything, then the prefetcher, the sequence mode, Dual-Sage, chunking), whatever
  order the nodes were applied in; wrappers of other packs run inside ours. Chained hooks (the
  block-replace patches and the attention override) chain in install order, each link calling
  the one installed before it (a link's behaviour may depend on what it wraps: Dual-Sage and the
  SageAttention node honour each other in both orders);
- records what it installed in `transformer_options[SEAM_KEY]` (an immutable tuple, so a clone
  never writes into its parent's record), which `describe` reads for the status line and
  `remove` uses to take a feature off a clone cleanly (chains rebuilt without its links);
- answers features' questions about each other, so none reads another's attributes or
  modules: `find(patcher or a forward's options, feature)` is the live object a feature
  installed with (`install(..., state=obj)`); `link_info(fn)` says which feature installed a
  wrapper or chained link, with what state, around which previous link, and whether the link is
  transparent (runs what it wraps unchanged); `live(feature)` lists every installed state still
  alive in this process (the out-of-memory guard frees their buffers).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import names

# Outermost first. A feature not named here is refused (a typo would silently reorder).
ORDER = ("guard", "oom", "prefetch", "sequence", "dual_sage", "chunking", "attention", "decode")
KEYS = {"guard": names.GUARD_KEY, "oom": names.OOM_GUARD_KEY, "prefetch": names.PREFETCH_KEY,
        "sequence": names.SEQUENCE_KEY, "dual_sage": names.DUAL_SAGE_KEY,
        "chunking": names.CHUNKING_KEY, "attention": names.ATTENTION_KEY,
        "decode": names.DECODE_KEY}
_UNSET = object()


@dataclass(frozen=True)
class Hook:
    """One thing a feature installs.

    kind: "wrapper" (where = WrappersMP type), "callback" (CallbacksMP type), "object_patch"
    (where = the patcher object name, e.g. "diffusion_model.blocks.3.forward"), "block_patch"
    (where = "dit.double_block.<i>"), "override" (the attention override), "attachment".
    value: the callable or object; for chained kinds a factory `value(previous) -> link`.
    """

    kind: str
    where: str
    value: Any
    previous: Any = _UNSET  # what the slot held before (set by install)
    installed: Any = _UNSET  # the object put there (for chained kinds: the built link)
    transparent: bool = False  # a chained link that runs what it wraps unchanged


def wrapper(wrapper_type: str, fn: Callable) -> Hook:
    return Hook("wrapper", wrapper_type, fn)


def callback(callback_type: str, fn: Callable) -> Hook:
    return Hook("callback", callback_type, fn)


def object_patch(name: str, obj: Any) -> Hook:
    return Hook("object_patch", name, obj)


def block_patch(index: int, make: Callable[[Any], Callable], transparent: bool = False) -> Hook:
    """A ("double_block", index) replace patch; `make(previous)` builds it around the patch
    already there (None: the original block). transparent: the link runs the block it wraps
    with the same arguments and returns its result unchanged (the prefetcher's stream wait)."""
    return Hook("block_patch", f"{names.DIT_PATCH}.{names.DOUBLE_BLOCK}.{index}", make,
                transparent=transparent)


def override(make: Callable[[Any], Callable], transparent: bool = False) -> Hook:
    """The attention override; `make(previous)` builds it around the one already there."""
    return Hook("override", names.OVERRIDE_KEY, make, transparent=transparent)


def attachment(key: str, obj: Any) -> Hook:
    return Hook("attachment", key, obj)


@dataclass(frozen=True)
class Installed:
    feature: str
    hooks: tuple[Hook, ...]
    state: Any = None  # the feature's live object: what `find` answers


@dataclass(frozen=True)
class LinkInfo:
    """What the seam knows of one installed wrapper or chained link."""

    feature: str
    state: Any  # the installing feature's state (None when it gave none)
    previous: Any  # chained links: the link it wraps (None: the original); wrappers: None
    transparent: bool


# Keyed by the installed callable itself, weakly: a link is known while a patcher holds it.
_LINKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LIVE: dict[str, weakref.WeakSet] = {}


# ---------------------------------------------------------------- reading the patcher
def options(patcher: Any) -> dict:
    """The patcher's `transformer_options` (created when missing)."""
    return patcher.model_options.setdefault(names.TRANSFORMER_OPTIONS, {})


def is_patcher(obj: Any) -> bool:
    """A ModelPatcher (or the twin's): it has model_options."""
    return isinstance(getattr(obj, "model_options", None), dict)


def status_lines(patcher: Any) -> dict[str, str]:
    """{feature: status line} the features recorded on a patcher (empty when none)."""
    if not is_patcher(patcher):
        return {}
    recorded = patcher.model_options.get(names.TRANSFORMER_OPTIONS, {}).get(names.STATUS_KEY, {})
    return {name: str(text) for name, text in recorded.items()}


def record_status(patcher: Any, feature: str, line: str) -> dict:
    """Write `feature`'s status line on a patcher (a fresh dict: a clone never writes into the
    one its parent shares); returns the dict, which a feature may keep to rewrite the line."""
    to = options(patcher)
    to[names.STATUS_KEY] = {**to.get(names.STATUS_KEY, {}), feature: line}
    return to[names.STATUS_KEY]


def installed(patcher: Any) -> tuple[Installed, ...]:
    return tuple(options(patcher).get(names.SEAM_KEY, ()))


def wrapper_table(patcher: Any) -> dict[str, dict[str, list]]:
    """The patcher's wrappers by type. ComfyUI internal: `ModelPatcher.wrappers` (0.33.0 and
    the newest files); the twin keeps them in transformer_options["wrappers"] as older
    ComfyUI did."""
    table = getattr(patcher, "wrappers", None)
    if isinstance(table, dict):
        return table
    return options(patcher).setdefault(names.WRAPPERS, {})


def wrappers_of(patcher: Any, wrapper_type: str, feature: str) -> list:
    return list(wrapper_table(patcher).get(wrapper_type, {}).get(KEYS[feature], []))


def _options_of(patcher_or_options: Any) -> dict:
    """A forward's transformer_options as given, or the patcher's."""
    if isinstance(patcher_or_options, dict):
        return patcher_or_options
    return options(patcher_or_options)


def block_patch_at(patcher_or_options: Any, index: int) -> Any:
    """The ("double_block", index) replace patch installed now (on a patcher or in a forward's
    options), or None."""
    to = _options_of(patcher_or_options)
    dit = to.get(names.PATCHES_REPLACE, {}).get(names.DIT_PATCH, {})
    return dit.get((names.DOUBLE_BLOCK, index))


def block_patches(patcher_or_options: Any) -> dict:
    """{("double_block", i): patch} of the DiT (of a patcher or of a forward's options)."""
    to = _options_of(patcher_or_options)
    return dict(to.get(names.PATCHES_REPLACE, {}).get(names.DIT_PATCH, {}))


def forward_wrappers(forward_options: dict, wrapper_type: str) -> dict[str, list]:
    """{key: [wrapper, ...]} of one type in a forward's transformer_options (ComfyUI copies
    the patcher's wrappers there per call, under "wrappers": 0.33.0 and the newest files)."""
    return forward_options.get(names.WRAPPERS, {}).get(wrapper_type, {})


def override_of(patcher_or_options: Any) -> Any:
    """The attention override installed now (of a patcher or of a forward's options), or None."""
    return _options_of(patcher_or_options).get(names.OVERRIDE_KEY)


def has(patcher: Any, feature: str) -> bool:
    return any(entry.feature == feature for entry in installed(patcher))


def find(patcher_or_options: Any, feature: str) -> Any:
    """The state `feature` installed with on this patcher, or in a forward's transformer_options
    (ComfyUI copies the record into each forward's options); the latest installation wins; None
    when it is not installed there or gave no state."""
    if isinstance(patcher_or_options, dict):
        entries = tuple(patcher_or_options.get(names.SEAM_KEY, ()))
    elif is_patcher(patcher_or_options):
        entries = installed(patcher_or_options)
    else:
        return None
    for entry in reversed(entries):
        if entry.feature == feature and entry.state is not None:
            return entry.state
    return None


def link_info(fn: Any) -> LinkInfo | None:
    """Who installed this wrapper / block patch / attention override, or None (another pack's,
    ComfyUI's own, or nothing)."""
    try:
        return _LINKS.get(fn)
    except TypeError:  # not weak-referenceable: not one the seam installed
        return None


def live(feature: str) -> list[Any]:
    """Every state `feature` installed with in this process that is still alive."""
    return list(_LIVE.get(feature, ()))


# ---------------------------------------------------------------- install
def install(patcher: Any, feature: str, *hooks: Hook, state: Any = None) -> Any:
    """Apply `hooks` for `feature` on `patcher` (in place: pass a clone) and record them, with
    `state`, the feature's live object that `find` and `link_info` answer (weak-referenceable)."""
    if feature not in KEYS:
        raise ValueError(f"feature {feature!r} is not one the seam orders; use one of {ORDER}")
    done = tuple(_apply(patcher, feature, hook) for hook in hooks)
    for kind in {h.where for h in done if h.kind == "wrapper"}:
        _order_wrappers(patcher, kind)
    _register(feature, state, done)
    to = options(patcher)
    to[names.SEAM_KEY] = (*to.get(names.SEAM_KEY, ()), Installed(feature, done, state))
    return patcher


def _register(feature: str, state: Any, hooks: tuple[Hook, ...]) -> None:
    if state is not None:
        _LIVE.setdefault(feature, weakref.WeakSet()).add(state)
    for hook in hooks:
        if hook.kind not in ("wrapper", "block_patch", "override") or hook.installed is None:
            continue
        previous = None if hook.previous is _UNSET else hook.previous
        if hook.kind == "wrapper":
            previous = None
        _LINKS[hook.installed] = LinkInfo(feature, state, previous, hook.transparent)


def _apply(patcher: Any, feature: str, hook: Hook) -> Hook:
    key = KEYS[feature]
    if hook.kind == "wrapper":
        add = getattr(patcher, "add_wrapper_with_key", None)
        if add is not None:
            add(hook.where, key, hook.value)
        else:
            wrapper_table(patcher).setdefault(hook.where, {}).setdefault(key, []).append(
                hook.value)
        return dataclasses.replace(hook, installed=hook.value)
    if hook.kind == "callback":
        add = getattr(patcher, "add_callback_with_key", None)
        if add is None:  # the twin has no lifecycle: nothing would call it
            return dataclasses.replace(hook, installed=None)
        add(hook.where, key, hook.value)
        return dataclasses.replace(hook, installed=hook.value)
    if hook.kind == "object_patch":
        previous = object_patches(patcher).get(hook.where, _UNSET)
        patcher.add_object_patch(hook.where, hook.value)
        return dataclasses.replace(hook, previous=previous, installed=hook.value)
    if hook.kind == "attachment":
        if hasattr(patcher, "set_attachments"):
            patcher.set_attachments(hook.where, hook.value)
        else:
            patcher.attachments[hook.where] = hook.value
        return dataclasses.replace(hook, installed=hook.value)
    if hook.kind in ("block_patch", "override"):
        previous = _slot(patcher, hook)
        link = hook.value(previous)
        _set_slot(patcher, hook, link)
        return dataclasses.replace(hook, previous=previous, installed=link)
    raise ValueError(f"hook kind {hook.kind!r} is unknown")


def _order_wrappers(patcher: Any, wrapper_type: str) -> None:
    """Ours outermost first in ORDER, then other packs' in the order they were added."""
    table = wrapper_table(patcher)
    by_key = table.get(wrapper_type, {})
    ours = [KEYS[f] for f in ORDER if KEYS[f] in by_key]
    table[wrapper_type] = {**{k: by_key[k] for k in ours},
                           **{k: v for k, v in by_key.items() if k not in ours}}


def object_patches(patcher: Any) -> dict:
    """ComfyUI internal: `ModelPatcher.object_patches`, the dict `add_object_patch` writes
    (0.33.0 and the newest files; the twin's too). Read to chain and remove patches."""
    return getattr(patcher, "object_patches", None) or {}


def _block_index(hook: Hook) -> int:
    return int(hook.where.rsplit(".", 1)[1])


def _slot(patcher: Any, hook: Hook) -> Any:
    if hook.kind == "override":
        return override_of(patcher)
    return block_patch_at(patcher, _block_index(hook))


def _set_slot(patcher: Any, hook: Hook, value: Any) -> None:
    if hook.kind == "override":
        to = options(patcher)
        if value is None:
            to.pop(names.OVERRIDE_KEY, None)
        else:
            to[names.OVERRIDE_KEY] = value
        return
    index = _block_index(hook)
    if value is not None:
        patcher.set_model_patch_replace(value, names.DIT_PATCH, names.DOUBLE_BLOCK, index)
        return
    to = options(patcher)
    replace = dict(to.get(names.PATCHES_REPLACE, {}))
    dit = dict(replace.get(names.DIT_PATCH, {}))
    dit.pop((names.DOUBLE_BLOCK, index), None)
    replace[names.DIT_PATCH] = dit
    to[names.PATCHES_REPLACE] = replace


# ---------------------------------------------------------------- remove
def remove(patcher: Any, feature: str) -> Any:
    """A clone of `patcher` without what `feature` installed (every installation of it).

    Chains are rebuilt from what was there before the pack's first link, with the remaining
    features' links in their install order. A link of another pack installed on top of ours
    cannot be re-wired: that is refused with a ValueError naming the slot.
    """
    entries = installed(patcher)
    if not any(e.feature == feature for e in entries):
        raise ValueError(f"{feature} is not installed on this model (installed: "
                         f"{', '.join(e.feature for e in entries) or 'nothing'})")
    clone = patcher.clone()
    key = KEYS[feature]
    mine = [h for e in entries if e.feature == feature for h in e.hooks]
    for hook in mine:
        if hook.kind == "wrapper":
            table = wrapper_table(clone)
            by_key = dict(table.get(hook.where, {}))
            by_key.pop(key, None)
            table[hook.where] = by_key
        elif hook.kind == "callback" and hook.installed is not None:
            clone.remove_callbacks_with_key(hook.where, key)
        elif hook.kind == "object_patch":
            patches = object_patches(clone)
            if hook.previous is _UNSET:
                patches.pop(hook.where, None)
            else:
                patches[hook.where] = hook.previous
        elif hook.kind == "attachment":
            attachments = getattr(clone, "attachments", {})
            attachments.pop(hook.where, None)
    kept: list[Installed] = []
    rebuilt: dict[tuple[str, str], Any] = {}
    slots = {(h.kind, h.where) for h in mine if h.kind in ("block_patch", "override")}
    for slot in slots:
        links = [(e, h) for e in entries for h in e.hooks if (h.kind, h.where) == slot]
        top = links[-1][1]
        if _slot(clone, top) is not top.installed:
            raise ValueError(f"{slot[1]} was patched by another pack after {feature}: remove "
                             f"that one first, or rebuild the model without {feature}")
        rebuilt[slot] = links[0][1].previous
    for entry in entries:
        if entry.feature == feature:
            continue
        hooks = []
        for hook in entry.hooks:
            slot = (hook.kind, hook.where)
            if slot in rebuilt:
                previous = rebuilt[slot]
                link = hook.value(previous)
                rebuilt[slot] = link
                hook = dataclasses.replace(hook, previous=previous, installed=link)
            hooks.append(hook)
        _register(entry.feature, entry.state, tuple(hooks))
        kept.append(Installed(entry.feature, tuple(hooks), entry.state))
    for (kind, where), value in rebuilt.items():
        _set_slot(clone, Hook(kind, where, None), value)
    options(clone)[names.SEAM_KEY] = tuple(kept)
    return clone


# ---------------------------------------------------------------- describe
@dataclass(frozen=True)
class Row:
    position: int  # wrappers: place in ORDER (0 = outermost); chains: install order
    feature: str
    kind: str
    where: str


def describe(patcher: Any) -> list[Row]:
    """What the pack installed on this patcher, by whom, in which order: wrappers in the order
    they run (outermost first), then the chained hooks in install order."""
    entries = installed(patcher)
    rows: list[Row] = []
    for feature in ORDER:
        for entry in entries:
            if entry.feature != feature:
                continue
            for hook in entry.hooks:
                if hook.kind in ("wrapper", "callback", "object_patch", "attachment"):
                    rows.append(Row(ORDER.index(feature), feature, hook.kind, hook.where))
    for i, entry in enumerate(entries):
        for hook in entry.hooks:
            if hook.kind in ("block_patch", "override"):
                rows.append(Row(i, entry.feature, hook.kind, hook.where))
    return rows


def describe_line(patcher: Any) -> str:
    """One status line: features outermost first, with what each installed, then the chains."""
    entries = installed(patcher)
    if not entries:
        return "nothing installed"
    parts = []
    for feature in ORDER:
        hooks = [h for e in entries if e.feature == feature for h in e.hooks]
        if not hooks:
            continue
        counts: dict[str, int] = {}
        for hook in hooks:
            label = {"wrapper": f"{hook.where} wrapper", "callback": f"{hook.where} callback",
                     "block_patch": "block patch", "object_patch": "object patch",
                     "override": "attention override", "attachment": "attachment"}[hook.kind]
            counts[label] = counts.get(label, 0) + 1
        what = ", ".join(f"{n}x {k}" if n > 1 else k for k, n in counts.items())
        parts.append(f"{feature} ({what})")
    chained = [e.feature for e in entries
               if any(h.kind in ("block_patch", "override") for h in e.hooks)]
    line = "hooks, outermost first: " + " > ".join(parts)
    if chained:
        line += "; chained in install order: " + " < ".join(chained)
    return line
