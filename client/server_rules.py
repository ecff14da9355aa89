"""How a ComfyUI server checks one input of a queued prompt, so that `submit --check` refuses
what the server refuses and accepts what it accepts.

Read in ComfyUI's `execution.validate_inputs` and `comfy_execution.validation.
validate_node_input` (ComfyUI internals; the same rules in 0.33.0 and in 0.3.64, whose
`execution.py` the newest-files bed runs):

- a literal for an INT, FLOAT, STRING or BOOLEAN input is converted with `int()`, `float()`,
  `str()`, `bool()`; a value that does not convert refuses the node (`invalid_input_type`).
  So "24" is a fine INT and 8.7 is one too (the server truncates it to 8), but "abc" and 8.5
  written as "8.5" are not. `{"__value__": v}` stands for `v`;
- the converted value is compared with the input's `min` and `max`; `step` is not checked;
- a combo's value must be one of its options, compared as Python compares (8 == 8.0); a
  DynamicCombo's key is not checked at validation (a key it does not offer fails at run time);
- an input named by the node's own VALIDATE_INPUTS / validate_inputs gets neither the range
  nor the option check: the node checks it itself;
- a link's source type and the input's type must share one type ("A,B" lists; "*" and
  MatchType match anything);
- an input the node does not declare is ignored; only the nodes that feed an output node are
  checked at all.
"""

from __future__ import annotations

import math
from typing import Any

from .editor import DYNAMIC_COMBO
from .errors import shown
from .workflow import combo_options

ANY_TYPE = "*"
MATCH_TYPE = "COMFY_MATCHTYPE_V3"
CONVERT = {"INT": int, "FLOAT": float, "STRING": str, "BOOLEAN": bool}


def unwrap(value: Any) -> Any:
    """A value as the server reads it: `{"__value__": v}` is `v` (how list values travel)."""
    if isinstance(value, dict) and "__value__" in value:
        return value["__value__"]
    return value


def convert(kind: Any, value: Any) -> tuple[Any, str | None]:
    """(the value the server works with, None) or (None, why it refuses to convert it)."""
    value = unwrap(value)
    cast = CONVERT.get(kind) if isinstance(kind, str) else None
    if cast is None:
        return value, None
    try:
        return cast(value), None
    except (TypeError, ValueError, OverflowError) as exc:
        return None, f"is not {_an(kind)} ({exc})"


def check_literal(kind: Any, opts: dict, value: Any, self_checked: bool = False
                  ) -> tuple[str | None, str | None]:
    """(refusal, note) for one literal input, each None when there is nothing to say.

    `self_checked`: the node's validate_inputs names this input, so the server skips the range
    and option checks (the node checks it when the prompt is queued)."""
    converted, error = convert(kind, value)
    if error:
        return f"= {shown(value)} {error}; give {_an(kind)}", None
    if self_checked:
        return None, None
    if kind == "FLOAT" and isinstance(converted, float) and not math.isfinite(converted):
        # Stricter than the server on purpose: NaN passes its range check (every comparison
        # is false) and inf passes an open one; the node would compute garbage after the
        # models have loaded.
        default = "" if opts.get("default") is None else f" (its default is {opts['default']})"
        return f"= {shown(value)} is not a finite number; give a number{default}", None
    low, high = opts.get("min"), opts.get("max")
    allowed = f"allowed: {'-inf' if low is None else low} to {'inf' if high is None else high}"
    for bound, below, word in ((low, True, "below the minimum"),
                               (high, False, "above the maximum")):
        if bound is None:
            continue
        try:
            outside = converted < bound if below else converted > bound
        except TypeError:  # the server's comparison raises too, and it refuses the prompt
            return f"= {shown(value)} cannot be compared with the {word.split()[-1]} {bound}", None
        if outside:
            return f"= {shown(value)} is {word} {bound} ({allowed})", None
    if isinstance(kind, list) or kind == "COMBO":
        options = combo_options(kind, opts) or []
        picked = converted if isinstance(converted, list) and opts.get("multiselect") else [
            converted]
        if any(not _offered(v, options) for v in picked):
            return f"= {shown(value)} is not offered by the server", None
    elif kind == DYNAMIC_COMBO and not _offered(converted, combo_options(kind, opts) or []):
        # Stricter than the server on purpose: it queues such a key, and the node fails when
        # it runs (after every model before it has loaded).
        return (f"= {shown(value)} is not offered by the server (it would queue it and fail when "
                f"the node runs)"), None
    return None, _lossy(kind, value, converted)


def _an(kind: str) -> str:
    return f"{'an' if kind[:1] in 'AEIOU' else 'a'} {kind}"


def _offered(value: Any, options: list) -> bool:
    try:
        return value in options
    except TypeError:
        return False


def _lossy(kind: Any, value: Any, converted: Any) -> str | None:
    """A note when the server accepts a value by changing it (what the user may not expect)."""
    value = unwrap(value)
    if kind == "INT" and isinstance(value, float) and math.isfinite(value) \
            and not value.is_integer():
        return f"= {shown(value)}: the server truncates it to {converted}"
    if kind == "BOOLEAN" and not isinstance(value, bool):
        return f"= {shown(value)}: the server reads it as {converted} (any non-empty value is true)"
    if kind in ("INT", "FLOAT") and isinstance(value, str):
        return f"= {shown(value)}: the server reads the text as {converted!r}"
    return None


def link_types_meet(received: Any, wanted: Any) -> bool:
    """Whether an output of type `received` may feed an input of type `wanted`, as the
    server's validate_node_input (non-strict) decides."""
    if received == wanted:
        return True
    if ANY_TYPE in (received, wanted) or MATCH_TYPE in (received, wanted):
        return True
    if isinstance(received, list) and wanted == "COMBO":
        return True
    if not isinstance(received, str) or not isinstance(wanted, str):
        return False
    got = {t.strip() for t in received.split(",")}
    accepted = {t.strip() for t in wanted.split(",")}
    return ANY_TYPE in got or ANY_TYPE in accepted or bool(got & accepted)


def reachable_from_outputs(prompt: dict, object_info: dict) -> set[str]:
    """Ids of the nodes the server validates and runs: output nodes and all they read from."""
    pending = [node_id for node_id, node in prompt.items()
               if (object_info.get(node.get("class_type")) or {}).get("output_node")]
    seen: set[str] = set()
    while pending:
        node_id = pending.pop()
        if node_id in seen or node_id not in prompt:
            continue
        seen.add(node_id)
        for value in (prompt[node_id].get("inputs") or {}).values():
            if isinstance(value, list) and len(value) == 2:
                pending.append(str(value[0]))
    return seen


# Inputs this pack's nodes check in their own validate_inputs, so the server skips their range
# and option checks (test_workflows_comfyui.py compares this table with the real node classes).
# The client checks what it can of them without ComfyUI: H3 canvases, frame counts, seconds.
_SIZES = ("pass2_width", "pass2_height", "pass1_width", "pass1_height", "seconds", "devices",
          "lora_rank")
PACK_SELF_CHECKED: dict[str, tuple[str, ...]] = {
    "H3MultiGPU": _SIZES,
    "H3MultiGPUAdvanced": (*_SIZES, "root_gpu", "helper_gpu"),
    "H3MultiGPUPlan": _SIZES,
    "H3MultiGPUSeconds": ("seconds",),
    "H3MultiGPUDualSage": ("helpers", "split", "min_tokens"),
    "H3MultiGPUDualSageAdvanced": ("helpers", "split", "min_tokens"),
    "H3MultiGPUChunking": ("ffn_chunk", "qkv_chunk", "head_group"),
    "H3MultiGPUChunkingAdvanced": ("ffn_chunk", "qkv_chunk", "head_group"),
    "H3MultiGPUPrefetch": ("resident_blocks", "pinned_budget"),
    "H3MultiGPUPrefetchAdvanced": ("resident_blocks", "pinned_budget"),
    "H3MultiGPUUpscalerDevice": ("device",),
    "H3MultiGPUVideoDecode": ("helpers", "shares", "make_room"),
    "H3MultiGPULatentUpscale": ("width", "height"),
}
