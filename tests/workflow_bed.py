"""Placeholder model files and input images for running the bundled workflows on a real ComfyUI.

The server needs every file a workflow names to exist (its loaders' lists and LoadImage's
check come from the folders), not to be valid: with these placeholders a prompt validates
completely and fails only when a loader reads the weights.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

WORKFLOWS = Path(__file__).resolve().parents[1] / "workflows"
# loader class -> (input naming the file, models folder)
LOADERS = {
    "UNETLoader": ("unet_name", "diffusion_models"),
    "CLIPLoader": ("clip_name", "text_encoders"),
    "VAELoader": ("vae_name", "vae"),
    "LoraLoaderModelOnly": ("lora_name", "loras"),
    "LatentUpscaleModelLoader": ("model_name", "latent_upscale_models"),
    "H3MultiGPULatentUpscalerLoader": ("upscaler_name", "latent_upscale_models"),
}
PLACEHOLDER = b"placeholder: not a model file\n"


def tiny_png(width: int = 64, height: int = 48) -> bytes:
    """A valid RGB PNG (LoadImage opens it when the graph runs)."""
    row = b"\x00" + bytes([200, 120, 40]) * width
    raw = row * height

    def chunk(tag: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + tag + data
                + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw))
            + chunk(b"IEND", b""))


def needed_files(api_paths) -> dict[str, set[str]]:
    """models folder -> file names the API workflows load; "input" -> images."""
    files: dict[str, set[str]] = {}
    for path in api_paths:
        for node in json.loads(Path(path).read_text()).values():
            kind, inputs = node["class_type"], node["inputs"]
            if kind in LOADERS:
                key, folder = LOADERS[kind]
                files.setdefault(folder, set()).add(inputs[key])
            if kind == "LoadImage":
                files.setdefault("input", set()).add(inputs["image"])
    return files


def make_bed(root: Path, api_paths=None) -> tuple[str, ...]:
    """Write placeholders under `root`; return the extra ComfyUI arguments that use them."""
    api_paths = api_paths or sorted((WORKFLOWS / "api").glob("*.json"))
    models = root / "models"
    inputs = root / "input"
    inputs.mkdir(parents=True, exist_ok=True)
    folders = []
    for folder, names in needed_files(api_paths).items():
        for name in names:
            target = (inputs if folder == "input" else models / folder) / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tiny_png() if folder == "input" else PLACEHOLDER)
        if folder != "input":
            folders.append(folder)
    config = root / "extra_model_paths.yaml"
    lines = ["h3_placeholders:", f"  base_path: {models}"]
    lines += [f"  {folder}: {folder}" for folder in sorted(set(folders))]
    config.write_text("\n".join(lines) + "\n")
    return ("--extra-model-paths-config", str(config), "--input-directory", str(inputs))


# ---------------------------------------------------------------------------------------------
# The node schemas the workflows are checked against, one set per ComfyUI release
# ---------------------------------------------------------------------------------------------

DATA = Path(__file__).resolve().parent / "data"
# release -> the core schemas it serves (this pack's own are object_info_pack.json for both)
RELEASES = {"newest": "object_info_h3.json", "0.33.0": "object_info_033.json"}
BUILT_FROM = "newest"  # dev/workflow_layout/build_workflows.py lays the files out for these
PACK_SCHEMAS = "object_info_pack.json"


def saved_schemas(release: str = BUILT_FROM) -> dict:
    """Core and pack schemas of `release` as saved in tests/data/ (file lists empty)."""
    core = json.loads((DATA / RELEASES[release]).read_text())["served"]
    pack = json.loads((DATA / PACK_SCHEMAS).read_text())["served"]
    return {**core, **pack}


def built_schemas() -> dict:
    return saved_schemas(BUILT_FROM)


def _input_essence(kind, opts: dict):
    """What of one input decides how a workflow lays it out and whether its value is valid:
    its type (a combo is COMBO, its options aside: they grow and hold the models folder), the
    editor's extra widgets, the range, and a dynamic input's structure."""
    opts = opts if isinstance(opts, dict) else {}
    out = {"type": "COMBO" if isinstance(kind, list) else kind}
    for key in ("forceInput", "image_upload", "multiselect", "min", "max"):
        if opts.get(key) not in (None, False):
            out[key] = opts[key]
    if opts.get("control_after_generate"):  # "fixed" (0.33.0) and true (newest) alike
        out["control_after_generate"] = True
    if kind == "COMFY_DYNAMICCOMBO_V3":
        out["options"] = [(o.get("key"), _inputs_essence(o.get("inputs") or {}))
                          for o in opts.get("options") or []]
    if kind == "COMFY_AUTOGROW_V3":
        template = opts.get("template") or {}
        out["template"] = {k: template.get(k) for k in ("prefix", "names", "min", "max")}
        out["template"]["input"] = _inputs_essence(template.get("input") or {})
    return out


def _inputs_essence(inputs: dict) -> dict:
    return {section: {name: _input_essence(spec[0] if spec else None,
                                           spec[1] if len(spec) > 1 else {})
                      for name, spec in (inputs.get(section) or {}).items()}
            for section in ("required", "optional") if inputs.get(section)}


def schema_essence(entry: dict) -> dict:
    """What matters of a node's /object_info entry for the workflows: inputs (as above), their
    order, hidden inputs' names, output types, whether it is an output node. Display names,
    tooltips, categories and the fields releases add (dev_only, essentials_category,
    search_aliases, price_badge, ...) are left out."""
    inputs = entry.get("input") or {}
    return {"input": _inputs_essence(inputs),
            "hidden": sorted(inputs.get("hidden") or {}),
            "input_order": {k: v for k, v in (entry.get("input_order") or {}).items()
                            if k in ("required", "optional")},
            "output": list(entry.get("output") or []),
            "output_node": bool(entry.get("output_node"))}


def schema_differences(served: dict, saved: dict) -> list[str]:
    """Classes of `saved` the server does not serve, or serves with another essence."""
    out = []
    for name, entry in saved.items():
        if name not in served:
            out.append(f"{name}: not served")
        elif schema_essence(served[name]) != schema_essence(entry):
            out.append(f"{name}: {schema_essence(served[name])} != {schema_essence(entry)}")
    return out


def served_release(served: dict) -> tuple[str | None, dict[str, list[str]]]:
    """(the release whose saved schemas the server serves, or None; each release's
    differences)."""
    differences = {r: schema_differences(served, saved_schemas(r)) for r in RELEASES}
    match = next((r for r, d in differences.items() if not d), None)
    return match, differences


def with_files(info: dict, api_paths=None) -> dict:
    """`info` as a server with the workflows' model files and images installed serves it."""
    info = json.loads(json.dumps(info))
    files = needed_files(api_paths or sorted((WORKFLOWS / "api").glob("*.json")))
    folder_of = {key: folder for key, folder in LOADERS.values()}
    folder_of["image"] = "input"
    for entry in info.values():
        for section in ("required", "optional"):
            for name, spec in (entry["input"].get(section) or {}).items():
                if name in folder_of and (isinstance(spec[0], list) or spec[0] == "COMBO"):
                    names = sorted(files.get(folder_of[name], ()))
                    if isinstance(spec[0], list):
                        spec[0] = sorted(set(spec[0]) | set(names))
                    else:
                        spec[1]["options"] = sorted(set(spec[1]["options"]) | set(names))
    return info


# ---------------------------------------------------------------------------------------------
# Deliberately bad (and surprising but good) values, one per way the server checks an input:
# the default suite checks the client against the saved schemas, test_workflows_comfyui.py
# checks the server and the client against each other. All go into the t2v graph's nodes
# (each feeds Save Video, so the server checks it).
# ---------------------------------------------------------------------------------------------

MISSING = object()  # the input is removed


class Edit:
    """Set `name` of the first node of `class_type` (or the one titled `title`) to `value`;
    `server_error` is the error type the server answers with (None: it accepts the value)."""

    def __init__(self, label: str, class_type: str, name: str, value, server_error: str | None,
                 title: str | None = None):
        self.label, self.class_type, self.name, self.value = label, class_type, name, value
        self.server_error, self.title = server_error, title

    def __repr__(self) -> str:
        return self.label

    def apply(self, api: dict) -> str:
        """Edit `api` in place; return the id of the node edited."""
        node_id = next(i for i, n in api.items() if n["class_type"] == self.class_type
                       and (self.title is None or n["_meta"]["title"] == self.title))
        inputs = api[node_id]["inputs"]
        if self.value is MISSING:
            del inputs[self.name]
        elif isinstance(self.value, LinkTo):
            source = next(i for i, n in api.items() if n["_meta"]["title"] == self.value.title)
            inputs[self.name] = [source, self.value.slot]
        else:
            inputs[self.name] = self.value
        return node_id


class LinkTo:
    def __init__(self, title: str, slot: int):
        self.title, self.slot = title, slot


REFUSED = [
    Edit("INT above its max", "PrimitiveInt", "value", 2 ** 63, "value_bigger_than_max",
         title="Seed"),
    Edit("FLOAT below its min", "BasicScheduler", "denoise", -0.5, "value_smaller_than_min",
         title="PASS2 Schedule"),
    Edit("a string where an INT is wanted", "PrimitiveInt", "value", "twelve",
         "invalid_input_type", title="Seed"),
    Edit("a string where a FLOAT is wanted", "BasicScheduler", "denoise", "0,3",
         "invalid_input_type", title="PASS2 Schedule"),
    Edit("nothing where an INT is wanted", "PrimitiveInt", "value", None,
         "invalid_input_type", title="PASS1 Steps"),
    Edit("a combo option not offered", "KSamplerSelect", "sampler_name", "euler_turbo",
         "value_not_in_list"),
    Edit("a model file not installed", "UNETLoader", "unet_name", "h3_dit_v2.safetensors",
         "value_not_in_list"),
    Edit("a missing required input", "BasicScheduler", "scheduler", MISSING,
         "required_input_missing", title="PASS1 Schedule"),
    Edit("a link of the wrong type", "BasicGuider", "conditioning",
         LinkTo("Multi-GPU Placement", 0), "return_type_mismatch"),
]
ACCEPTED = [
    Edit("an INT written as text", "PrimitiveInt", "value", "7", None, title="Seed"),
    Edit("an INT written as a float", "PrimitiveInt", "value", 7.0, None, title="Seed"),
    Edit("a FLOAT written as an int", "BasicScheduler", "denoise", 1, None,
         title="PASS2 Schedule"),
    Edit("a FLOAT written as text", "BasicScheduler", "denoise", "0.25", None,
         title="PASS2 Schedule"),
    Edit("an input the node does not declare", "BasicScheduler", "sigma_shift", 3.0, None,
         title="PASS2 Schedule"),
]
