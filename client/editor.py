"""How the ComfyUI editor (frontend 1.58) lays a node out, read from the node's /object_info entry.

UI-format workflows store widget values by position (`widgets_values`) and links by input slot
index, so reading or writing one needs the editor's order of widgets and input slots:

- widgets follow `input_order` (required, then optional); an INT named `seed`/`noise_seed` or
  any input with `control_after_generate` is followed by its "control after generate" widget;
  an image-upload combo is followed by its "upload" widget; a DynamicCombo
  (`COMFY_DYNAMICCOMBO_V3`) is one combo followed by the widgets of its selected option, named
  `<combo>.<input>` (SaveVideo: `format`, `format.codec`), recursively; a DynamicCombo marked
  hidden is still a widget;
- input slots: the sockets first (in `input_order`; an Autogrow (`COMFY_AUTOGROW_V3`) input
  becomes its connected slots `<name>.<prefix><i>` plus one free slot), then one slot per
  widget that feeds an API input, in widget order (a DynamicCombo option's slots right after
  the combo's own slot, where the editor puts them when it loads and saves a workflow).

API format names a DynamicCombo's inner inputs by their dotted path (`format.codec`) and an
Autogrow slot by `<name>.<slot>` (`ref_images.ref_image_0`). `tests/browser/` checks these rules
against the real frontend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

WIDGET_TYPES = frozenset({"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"})
DYNAMIC_COMBO = "COMFY_DYNAMICCOMBO_V3"
AUTOGROW = "COMFY_AUTOGROW_V3"
# Values of the editor-only "control after generate" widget; it feeds no API input.
CONTROL_VALUES = frozenset({"fixed", "increment", "decrement", "randomize"})
CONTROL_WIDGET = "control_after_generate"
UPLOAD_WIDGET = "upload"
SEED_NAMES = ("seed", "noise_seed")


@dataclass(frozen=True)
class Widget:
    """One editor widget: `name` as the editor calls it, `input` the API input it feeds (None
    for the editor-only control and upload widgets), `spec` the input's (type, options)."""

    name: str
    input: str | None
    kind: Any
    options: dict
    optional: bool = False


@dataclass(frozen=True)
class Slot:
    """One input slot of a node in the editor: `name` (also the API input name), its type as
    the editor writes it, and whether it is a widget's slot."""

    name: str
    type: str
    optional: bool
    widget: bool
    label: str


def declared_inputs(info: dict) -> list[tuple[str, Any, dict, bool]]:
    """(name, type, options, optional) of a node's inputs in the editor's order."""
    declared = info.get("input") or {}
    order = info.get("input_order") or {
        section: list(declared.get(section) or {}) for section in ("required", "optional")
    }
    out = []
    for section in ("required", "optional"):
        specs = declared.get(section) or {}
        for name in order.get(section) or []:
            spec = specs.get(name)
            if spec is None:
                continue
            kind = spec[0] if spec else None
            opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            out.append((name, kind, opts, section == "optional"))
    return out


def is_widget(kind: Any, opts: dict) -> bool:
    """A plain widget input (not a socket, not a dynamic input)."""
    if opts.get("forceInput"):
        return False
    return isinstance(kind, list) or kind in WIDGET_TYPES


def has_control(name: str, kind: Any, opts: dict) -> bool:
    if "control_after_generate" in opts:
        return bool(opts["control_after_generate"])
    return kind == "INT" and name in SEED_NAMES


def combo_keys(opts: dict) -> list:
    """The choices of a DynamicCombo."""
    return [option["key"] for option in opts.get("options") or []]


def dynamic_option_inputs(opts: dict, key: Any) -> dict:
    """The `{"required": ..., "optional": ...}` inputs of a DynamicCombo's option `key`."""
    for option in opts.get("options") or []:
        if option.get("key") == key:
            return option.get("inputs") or {}
    return {}


def _option_info(inputs: dict) -> dict:
    return {"input": inputs,
            "input_order": {s: list(inputs.get(s) or {}) for s in ("required", "optional")}}


def default_value(kind: Any, opts: dict) -> Any:
    """The value the editor gives a new widget."""
    if "default" in opts:
        return opts["default"]
    if isinstance(kind, list):
        return kind[0] if kind else None
    if kind == DYNAMIC_COMBO:
        keys = combo_keys(opts)
        return keys[0] if keys else None
    if kind == "COMBO":
        options = opts.get("options") or []
        return options[0] if options else None
    return {"INT": 0, "FLOAT": 0.0, "STRING": "", "BOOLEAN": False}.get(kind)


def widgets(info: dict, values: dict | None = None, prefix: str = "") -> list[Widget]:
    """The widgets the editor gives a node, in order. `values` (API input name -> value)
    chooses the option of each DynamicCombo; without it the first option is used."""
    values = values or {}
    out: list[Widget] = []
    for name, kind, opts, optional in declared_inputs(info):
        full = prefix + name
        if kind == DYNAMIC_COMBO:
            out.append(Widget(full, full, kind, opts, optional))
            key = values.get(full, default_value(kind, opts))
            inner = dynamic_option_inputs(opts, key)
            out += widgets(_option_info(inner), values, prefix=full + ".")
            continue
        if not is_widget(kind, opts):
            continue
        out.append(Widget(full, full, kind, opts, optional))
        if has_control(name, kind, opts):
            out.append(Widget(CONTROL_WIDGET, None, "COMBO", {}, optional))
        if opts.get("image_upload"):
            out.append(Widget(UPLOAD_WIDGET, None, "IMAGEUPLOAD", {}, optional))
    return out


def autogrow_names(name: str, opts: dict) -> list[str]:
    """Every slot name an Autogrow input can have, e.g. ref_images.ref_image_0 .. _8."""
    template = opts.get("template") or {}
    if "names" in template:
        names = list(template["names"])
    else:
        names = [f"{template.get('prefix', '')}{i}" for i in range(int(template.get("max", 1)))]
    return [f"{name}.{n}" for n in names]


def autogrow_type(opts: dict) -> str:
    inputs = (opts.get("template") or {}).get("input") or {}
    for section in ("required", "optional"):
        for spec in (inputs.get(section) or {}).values():
            return spec[0]
    return "*"


def _slot_type(kind: Any) -> str:
    return "COMBO" if isinstance(kind, list) else str(kind)


def slots(info: dict, values: dict | None = None, connected: set[str] | frozenset = frozenset()
          ) -> list[Slot]:
    """The input slots the editor gives a node, in order (link records name these indices).

    `connected`: API input names that carry a link (Autogrow grows one slot past them)."""
    sockets: list[Slot] = []
    for name, kind, opts, optional in declared_inputs(info):
        if kind == AUTOGROW:
            names = autogrow_names(name, opts)
            used = [i for i, n in enumerate(names) if n in connected]
            count = min(len(names), (max(used) + 2) if used else 1)
            for slot_name in names[:count]:
                sockets.append(Slot(slot_name, autogrow_type(opts), True, False,
                                    slot_name.split(".", 1)[1]))
        elif kind != DYNAMIC_COMBO and not is_widget(kind, opts):
            sockets.append(Slot(name, _slot_type(kind), optional, False, name))
    widget_slots: list[Slot] = []
    for widget in widgets(info, values):
        if widget.name == CONTROL_WIDGET:
            continue
        label = widget.name.rsplit(".", 1)[-1]
        if widget.name == UPLOAD_WIDGET:
            widget_slots.append(Slot(UPLOAD_WIDGET, "IMAGEUPLOAD", False, True,
                                     "choose file to upload"))
            continue
        widget_slots.append(Slot(widget.name, _slot_type(widget.kind), widget.optional, True,
                                 label))
    return sockets + widget_slots


def widget_values_by_input(info: dict, stored: list | dict) -> dict[str, Any]:
    """Map a node's saved `widgets_values` (list, or dict by name) to API inputs."""
    if isinstance(stored, dict):
        names = {w.input for w in widgets(info, stored) if w.input}
        return {name: value for name, value in stored.items() if name in names}
    stored = list(stored or [])
    values: dict[str, Any] = {}
    # A DynamicCombo's option decides which widgets follow it: resolve left to right.
    layout = widgets(info, values)
    position = 0
    index = 0
    while index < len(layout) and position < len(stored):
        widget = layout[index]
        value = stored[position]
        if widget.name == CONTROL_WIDGET and not (isinstance(value, str)
                                                  and value in CONTROL_VALUES):
            index += 1  # an older save without the control value
            continue
        position += 1
        if widget.input is not None:
            values[widget.input] = value
            if widget.kind == DYNAMIC_COMBO:
                # Widgets before this one do not depend on its value: same prefix, new tail.
                layout = widgets(info, values)
        index += 1
    return values
