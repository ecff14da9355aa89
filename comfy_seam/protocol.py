"""Install / remove / describe: how every feature puts its hooks on a ComfyUI ModelPatcher.

A feature never calls the patcher's hook API itself. It declares what it installs, as `Hook`s,
and calls `install(patcher, feature, *hooks, state=obj)` on its clone. The seam
- applies each hook through the patcher's API (`add_wrapper_with_key`, `add_callback_with_key`,
  `set_model_patch_replace`, `add_object_patch`, the override in `transformer_options`), on
  ComfyUI's ModelPatcher and on the twin's `TwinPatcher` alike (it implements that API);
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

Status, written one way: a feature calls `record_status(patcher, feature, line, live=...)`
once, when it is applied. `line` is stored in `transformer_options[STATUS_KEY][feature]` (what
ComfyUI copies with the options). A line that becomes truer once the model runs (what the
chunks really were, a run-time refusal) passes `live`, its state's method returning the line
as it is now: it is kept in the feature's install record (shared by every clone made
afterwards), and `status_lines`, the one reader, calls it at read time. Nobody rewrites a line.

One module (a little over 400 lines) on purpose: the install record and the chain links are
private to it, and install, remove, find and describe read and write them together.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import Counter
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
_CHAINED = ("block_patch", "override")


@dataclass(frozen=True)
class Hook:
    """One thing a feature installs.

    kind: "wrapper" (where = WrappersMP type), "callback" (CallbacksMP type), "object_patch"
    (where = the patcher object name, e.g. "diffusion_model.blocks.3.forward"), "block_patch"
    (where = "dit.double_block.<i>"), "override" (the attention override).
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


@dataclass(frozen=True)
class Installed:
    feature: str
    hooks: tuple[Hook, ...]
    state: Any = None  # the feature's live object: what `find` answers
    status: Callable[[], str] | None = None  # the live status line (`record_status`'s `live`)


@dataclass(frozen=True)
class LinkInfo:
    """What the seam knows of one installed wrapper or chained link."""

    feature: str
    # the installing feature's state, weakly: a value of `_LINKS` that held it would keep its
    # own key alive through the state (a mode's helper clones carry the patcher's links), and
    # with it the mode and every clone it made, after the graph dropped the model
    state_ref: Callable[[], Any]
    previous: Any  # chained links: the link it wraps (None: the original); wrappers: None
    transparent: bool

    @property
    def state(self) -> Any:
        """The installing feature's state (None when it gave none or it is gone)."""
        return self.state_ref()


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


def installed(patcher: Any) -> tuple[Installed, ...]:
    return tuple(options(patcher).get(names.SEAM_KEY, ()))


def wrapper_table(patcher: Any) -> dict[str, dict[str, list]]:
    """The patcher's wrappers by type. ComfyUI internal: `ModelPatcher.wrappers` (0.33.0 and
    the newest files), the dict `add_wrapper_with_key` writes; read to order ours."""
    return patcher.wrappers


def wrappers_of(patcher: Any, wrapper_type: str, feature: str) -> list:
    return list(wrapper_table(patcher).get(wrapper_type, {}).get(KEYS[feature], []))


def object_patches(patcher: Any) -> dict:
    """ComfyUI internal: `ModelPatcher.object_patches`, the dict `add_object_patch` writes
    (0.33.0 and the newest files). Read to chain patches, written to remove them (ComfyUI has
    no call that removes one)."""
    return patcher.object_patches


def _options_of(patcher_or_options: Any) -> dict:
    """A forward's transformer_options as given, or the patcher's."""
    if isinstance(patcher_or_options, dict):
        return patcher_or_options
    return options(patcher_or_options)


def block_patch_at(patcher_or_options: Any, index: int) -> Any:
    """The ("double_block", index) replace patch installed now (on a patcher or in a forward's
    options), or None."""
    return block_patches(patcher_or_options).get((names.DOUBLE_BLOCK, index))


def block_patches(patcher_or_options: Any) -> dict:
    """{("double_block", i): patch} of the DiT (of a patcher or of a forward's options)."""
    to = _options_of(patcher_or_options)
    return dict(to.get(names.PATCHES_REPLACE, {}).get(names.DIT_PATCH, {}))


def override_of(patcher_or_options: Any) -> Any:
    """The attention override installed now (of a patcher or of a forward's options), or None."""
    return _options_of(patcher_or_options).get(names.OVERRIDE_KEY)


def has(patcher: Any, feature: str) -> bool:
    return any(entry.feature == feature for entry in installed(patcher))


def find(patcher_or_options: Any, feature: str) -> Any:
    """The state `feature` installed with on this patcher, or in a forward's transformer_options
    (ComfyUI copies the record into each forward's options); the latest installation wins; None
    when it is not installed there or gave no state."""
    if not (isinstance(patcher_or_options, dict) or is_patcher(patcher_or_options)):
        return None
    entries = tuple(_options_of(patcher_or_options).get(names.SEAM_KEY, ()))
    return next((e.state for e in reversed(entries)
                 if e.feature == feature and e.state is not None), None)


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


# ---------------------------------------------------------------- status
def record_status(patcher: Any, feature: str, line: str,
                  live: Callable[[], str] | None = None) -> None:
    """Write `feature`'s status line on a patcher (a fresh dict: a clone never writes into the
    one its parent shares). live: the line as it is now, called by `status_lines` at read time
    (a feature installed on this patcher only)."""
    to = options(patcher)
    to[names.STATUS_KEY] = {**to.get(names.STATUS_KEY, {}), feature: line}
    if live is not None:
        entries = list(installed(patcher))
        last = max((i for i, e in enumerate(entries) if e.feature == feature), default=None)
        if last is None:
            raise ValueError(f"a live status line needs {feature} installed on this patcher")
        entries[last] = dataclasses.replace(entries[last], status=live)
        to[names.SEAM_KEY] = tuple(entries)


def status_lines(patcher: Any) -> dict[str, str]:
    """{feature: status line} of a patcher (empty when none): the lines recorded, each live
    one as its feature says it now."""
    if not is_patcher(patcher):
        return {}
    to = patcher.model_options.get(names.TRANSFORMER_OPTIONS, {})
    lines = {name: str(text) for name, text in to.get(names.STATUS_KEY, {}).items()}
    for entry in to.get(names.SEAM_KEY, ()):
        if entry.status is not None:
            lines[entry.feature] = entry.status()
    return lines


# ---------------------------------------------------------------- install
def install(patcher: Any, feature: str, *hooks: Hook, state: Any = None) -> Any:
    """Apply `hooks` for `feature` on `patcher` (in place: pass a clone) and record them, with
    `state`, the feature's live object that `find` and `link_info` answer (weak-referenceable)."""
    if feature not in KEYS:
        raise ValueError(f"feature {feature!r} is not one the seam orders; use one of {ORDER}")
    done = tuple(_apply(patcher, KEYS[feature], hook) for hook in hooks)
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
        if hook.kind in ("wrapper", *_CHAINED):
            previous = None if hook.kind == "wrapper" or hook.previous is _UNSET \
                else hook.previous
            _LINKS[hook.installed] = LinkInfo(feature, _weak(state), previous,
                                              hook.transparent)


def _weak(state: Any) -> Callable[[], Any]:
    if state is None:
        return lambda: None
    return weakref.ref(state)  # install() asks for a weak-referenceable state


def _apply(patcher: Any, key: str, hook: Hook) -> Hook:
    if hook.kind == "wrapper":
        patcher.add_wrapper_with_key(hook.where, key, hook.value)
    elif hook.kind == "callback":
        patcher.add_callback_with_key(hook.where, key, hook.value)
    elif hook.kind == "object_patch":
        previous = object_patches(patcher).get(hook.where, _UNSET)
        patcher.add_object_patch(hook.where, hook.value)
        return dataclasses.replace(hook, previous=previous, installed=hook.value)
    elif hook.kind in _CHAINED:
        previous = _slot(patcher, hook)
        link = hook.value(previous)
        _set_slot(patcher, hook, link)
        return dataclasses.replace(hook, previous=previous, installed=link)
    else:
        raise ValueError(f"hook kind {hook.kind!r} is unknown")
    return dataclasses.replace(hook, installed=hook.value)


def _order_wrappers(patcher: Any, wrapper_type: str) -> None:
    """Ours outermost first in ORDER, then other packs' in the order they were added."""
    table = wrapper_table(patcher)
    by_key = table.get(wrapper_type, {})
    ours = [KEYS[f] for f in ORDER if KEYS[f] in by_key]
    table[wrapper_type] = {**{k: by_key[k] for k in ours},
                           **{k: v for k, v in by_key.items() if k not in ours}}


def _block_index(hook: Hook) -> int:
    return int(hook.where.rsplit(".", 1)[1])


def _slot(patcher: Any, hook: Hook) -> Any:
    if hook.kind == "override":
        return override_of(patcher)
    return block_patch_at(patcher, _block_index(hook))


def _set_slot(patcher: Any, hook: Hook, value: Any) -> None:
    to = options(patcher)
    if hook.kind == "override":
        to[names.OVERRIDE_KEY] = value
        if value is None:
            del to[names.OVERRIDE_KEY]
    elif value is not None:
        patcher.set_model_patch_replace(value, names.DIT_PATCH, names.DOUBLE_BLOCK,
                                        _block_index(hook))
    else:  # ComfyUI has no call that removes a replace patch: fresh dicts without it
        replace = dict(to.get(names.PATCHES_REPLACE, {}))
        replace[names.DIT_PATCH] = {k: v for k, v in replace.get(names.DIT_PATCH, {}).items()
                                    if k != (names.DOUBLE_BLOCK, _block_index(hook))}
        to[names.PATCHES_REPLACE] = replace


# ---------------------------------------------------------------- remove
def remove(patcher: Any, feature: str) -> Any:
    """A clone of `patcher` without what `feature` installed (every installation of it).

    Chains are rebuilt from what was there before the feature's first link, with the remaining
    features' links in their install order. A link of another pack installed on top of ours
    cannot be re-wired: that is refused with a ValueError naming the slot.
    """
    entries = installed(patcher)
    if not has(patcher, feature):
        raise ValueError(f"{feature} is not installed on this model (installed: "
                         f"{', '.join(e.feature for e in entries) or 'nothing'})")
    clone = patcher.clone()
    mine = [h for e in entries if e.feature == feature for h in e.hooks]
    for hook in mine:
        _unhook(clone, KEYS[feature], hook)
    bases = {(h.kind, h.where): _chain_base(clone, feature, entries, h)
             for h in mine if h.kind in _CHAINED}
    kept = tuple(_relink(entry, bases) for entry in entries if entry.feature != feature)
    for (kind, where), value in bases.items():
        _set_slot(clone, Hook(kind, where, None), value)
    options(clone)[names.SEAM_KEY] = kept
    return clone


def _unhook(clone: Any, key: str, hook: Hook) -> None:
    """Take one non-chained hook off (chained ones are rebuilt by `_relink`)."""
    if hook.kind == "wrapper":
        clone.remove_wrappers_with_key(hook.where, key)
    elif hook.kind == "callback":
        clone.remove_callbacks_with_key(hook.where, key)
    elif hook.kind == "object_patch":
        patches = object_patches(clone)
        if hook.previous is _UNSET:
            patches.pop(hook.where, None)
        else:
            patches[hook.where] = hook.previous


def _chain_base(clone: Any, feature: str, entries: tuple[Installed, ...], hook: Hook) -> Any:
    """What the slot held before the pack's first link there; refused when another pack's link
    sits on top of ours (it holds our link and cannot be re-wired)."""
    links = [h for e in entries for h in e.hooks if (h.kind, h.where) == (hook.kind, hook.where)]
    if _slot(clone, hook) is not links[-1].installed:
        raise ValueError(f"{hook.where} was patched by another pack after {feature}: remove "
                         f"that one first, or rebuild the model without {feature}")
    return links[0].previous


def _relink(entry: Installed, bases: dict[tuple[str, str], Any]) -> Installed:
    """`entry` with its links in the rebuilt chains built again around the new previous link
    (`bases` advances to each new top link)."""
    hooks = []
    for hook in entry.hooks:
        slot = (hook.kind, hook.where)
        if slot in bases:
            link = hook.value(bases[slot])
            hook = dataclasses.replace(hook, previous=bases[slot], installed=link)
            bases[slot] = link
        hooks.append(hook)
    _register(entry.feature, entry.state, tuple(hooks))
    return dataclasses.replace(entry, hooks=tuple(hooks))


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
    rows = [Row(ORDER.index(f), f, h.kind, h.where) for f in ORDER for e in entries
            if e.feature == f for h in e.hooks if h.kind not in _CHAINED]
    return rows + [Row(i, e.feature, h.kind, h.where) for i, e in enumerate(entries)
                   for h in e.hooks if h.kind in _CHAINED]


_LABELS = {"block_patch": "block patch", "object_patch": "object patch",
           "override": "attention override"}


def describe_line(patcher: Any) -> str:
    """One status line: features outermost first, with what each installed, then the chains."""
    entries = installed(patcher)
    if not entries:
        return "nothing installed"
    parts = []
    for feature in ORDER:
        counts = Counter(_LABELS.get(h.kind, f"{h.where} {h.kind}") for e in entries
                         if e.feature == feature for h in e.hooks)
        if counts:
            what = ", ".join(f"{n}x {k}" if n > 1 else k for k, n in counts.items())
            parts.append(f"{feature} ({what})")
    chained = [e.feature for e in entries if any(h.kind in _CHAINED for h in e.hooks)]
    line = "hooks, outermost first: " + " > ".join(parts)
    if chained:
        line += "; chained in install order: " + " < ".join(chained)
    return line
