"""A server's /object_info checked for the shapes the client reads from it (`editor.py`,
`validate.py`, `server_rules.py`), so a server (or a proxy, or a custom node pack) that
describes a node class some other way is named as the server's fault (exit 4), not a crash.

Checked, per node class: `input` an object of sections (`required`, `optional`, `hidden`), each
an object of input name -> spec; a spec a non-empty list whose first entry is the type (text)
or a V1 combo's options (a list) and whose second, when there, is an object of options;
`input_order` an object of lists of input names; `output` a list; inside the options: a
combo's `options` a list, a DynamicCombo's options a list of `{key, inputs}` whose inputs are
sections again, an Autogrow's `template` with a whole-number `min`/`max`, text `prefix`, a
list of `names` and sections of `input`. `hidden` specs are not read, so not checked.
"""

from __future__ import annotations

from typing import Any

from .editor import AUTOGROW, DYNAMIC_COMBO
from .errors import shown

SECTIONS = ("required", "optional")
MAX_DEPTH = 16  # DynamicCombos inside DynamicCombos: no real node nests more than two


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _options(kind: Any, opts: dict, where: str, depth: int) -> str | None:
    if kind == DYNAMIC_COMBO:
        choices = opts.get("options")
        if not isinstance(choices, list):
            return f"{where}: its DynamicCombo options are {shown(choices)}, not a list"
        for index, choice in enumerate(choices):
            if not (isinstance(choice, dict) and isinstance(choice.get("key"), (str, int, float))
                    and not isinstance(choice.get("key"), bool)):
                return (f"{where}: DynamicCombo option {index} is {shown(choice)}, not "
                        f"{{key, inputs}}")
            problem = _sections(choice.get("inputs") or {}, f"{where}, option "
                                f"{choice['key']!r}", depth + 1)
            if problem:
                return problem
        return None
    if kind == AUTOGROW:
        template = opts.get("template")
        if not isinstance(template, dict):
            return f"{where}: its Autogrow template is {shown(template)}, not an object"
        for key, ok, wanted in (("min", _whole, "a whole number"), ("max", _whole,
                                                                     "a whole number"),
                                ("prefix", lambda v: isinstance(v, str), "text"),
                                ("names", lambda v: isinstance(v, list) and all(
                                    isinstance(n, str) for n in v), "a list of names")):
            if key in template and not ok(template[key]):
                return f"{where}: its Autogrow '{key}' is {shown(template[key])}, not {wanted}"
        if "max" in template and not 0 <= template["max"] <= 1024:
            return f"{where}: its Autogrow 'max' {template['max']} is not a slot count"
        return _sections(template.get("input") or {}, f"{where} (Autogrow slot)", depth + 1)
    if "options" in opts and not isinstance(opts["options"], list):
        return f"{where}: its 'options' is {shown(opts['options'])}, not a list"
    return None


def _sections(inputs: Any, where: str, depth: int = 0) -> str | None:
    """The first defect of an `input`-style object of sections, or None."""
    if depth > MAX_DEPTH:
        return f"{where}: its inputs nest more than {MAX_DEPTH} levels deep"
    if not isinstance(inputs, dict):
        return f"{where}: its inputs are {shown(inputs)}, not an object of sections"
    for section, specs in inputs.items():
        if not isinstance(specs, dict):
            return f"{where}: its '{section}' inputs are {shown(specs)}, not an object"
        if section not in SECTIONS:
            continue  # hidden inputs: never read
        for name, spec in specs.items():
            at = f"{where}, input {name!r}"
            if not isinstance(name, str):
                return f"{at}: the name is not text"
            if not (isinstance(spec, list) and spec and isinstance(spec[0], (str, list))):
                return f"{at} is described as {shown(spec)}, not [type, {{options}}]"
            opts = spec[1] if len(spec) > 1 else {}
            if not isinstance(opts, dict):
                return f"{at}: its options are {shown(opts)}, not an object"
            problem = _options(spec[0], opts, at, depth)
            if problem:
                return problem
    return None


def object_info_problem(info: dict) -> str | None:
    """The first shape defect of a whole /object_info answer, or None when it can be read."""
    for class_type, entry in info.items():
        where = f"node class {class_type!r}"
        if not isinstance(entry, dict):
            return f"{where} is described as {shown(entry)}, not an object"
        problem = _sections(entry.get("input", {}), where)
        if problem:
            return problem
        order = entry.get("input_order", {})
        if not (isinstance(order, dict) and all(
                isinstance(names, list) and all(isinstance(n, str) for n in names)
                for names in order.values())):
            return f"{where}: its input_order is {shown(order)}, not lists of input names"
        outputs = entry.get("output", [])
        if not (isinstance(outputs, list) and all(isinstance(o, (str, list)) for o in outputs)):
            return f"{where}: its outputs are {shown(outputs)}, not a list of types"
    return None
