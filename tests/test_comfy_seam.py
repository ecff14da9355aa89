"""The seam owns every ComfyUI name: no other module spells one; install / remove / describe.

Two tests read the package's own source (not tests/, dev/, docs/, workflows/ or the twin, which
stands in for ComfyUI). The allow-list test parses every product module outside `comfy_seam/`:
it imports nothing of ComfyUI (nor looks a ComfyUI module up by name) beyond the allowed
public APIs, and names no model-management or patcher function that `internals` lists. The
grep test fails on a ComfyUI hook call, key or wrapper type outside `comfy_seam/`. Docstrings
and comments may name them (they say what is used where).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest
import torch
from twin import TwinConfig, TwinPatcher, make_inputs, make_twin

from h3_multigpu.comfy_seam import internals, names, protocol

ROOT = Path(__file__).resolve().parent.parent
NOT_PRODUCT = {"tests", "dev", "comfy_seam", "workflows", "docs", "venv",
               ".venv"}
# Modules allowed to name a ComfyUI internal outside the seam, {file: labels}. Empty: every
# feature (sequence included) goes through comfy_seam, and the decode's VAE window loop is
# spelled in comfy_seam.vae (its internals listed in comfy_seam.internals, checked per release).
PENDING: dict[str, tuple[str, ...]] = {}
# what names a ComfyUI internal in code: (label, regex)
TOKENS = (
    *((t, re.escape(t)) for t in (
        "add_wrapper_with_key", "add_callback_with_key", "remove_wrappers_with_key",
        "remove_callbacks_with_key", "set_model_patch_replace", "add_object_patch",
        "set_attachments", "WrappersMP", "CallbacksMP", "args[3]", "model.size", "._apply",
        "set_model_optimized_attention", "model_options")),
    ("object_patches", r"(?<!protocol)\.object_patches"),
    *((f'"{v}"', re.escape(f'"{v}"')) for v in (
        names.OVERRIDE_KEY, names.PATCHES_REPLACE, names.DOUBLE_BLOCK,
        names.PREFETCH_DYNAMIC_VBARS, names.TRANSFORMER_OPTIONS, names.SEAM_KEY,
        names.PARALLEL_KEY, names.GUARD_KEY, names.PREFETCH_KEY, names.DUAL_SAGE_KEY,
        names.SEQUENCE_KEY, names.CHUNKING_KEY, names.VAE_DECODE_LOOP, names.OUTER_SAMPLE,
        names.PREPARE_SAMPLING, names.ON_LOAD, names.ON_DETACH, names.ON_CLEANUP,
        names.ON_APPLY_HOOKS)),
    (f'["{names.STATUS_KEY}"]', re.escape(f'["{names.STATUS_KEY}"]')),
)
# (Imports and module look-ups are the allow-list's: `comfyui_uses`. The "dit" patch group is
# not searched for: the planner names its DiT component "dit".)


def _in_checkout(parts: tuple[str, ...]) -> bool:
    """Not in a hidden or virtual-environment folder a user or a tool puts beside the pack
    (.venv, .carry, site-packages): those are not the pack's code."""
    return not any(p.startswith(".") or p in ("site-packages", "venv", "node_modules")
                   for p in parts[:-1])


def product_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py")
                  if _in_checkout(p.relative_to(ROOT).parts)
                  and not (set(p.relative_to(ROOT).parts[:-1]) & NOT_PRODUCT)
                  and p.relative_to(ROOT).parts[0] not in NOT_PRODUCT)


def code_text(path: Path) -> str:
    """The file without comments and docstrings (what runs)."""
    source = path.read_text()
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(
                    getattr(body[0], "value", None), ast.Constant) and isinstance(
                    body[0].value.value, str):
                docstrings.add(body[0].lineno)
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            continue
        if tok.type == tokenize.STRING and tok.start[0] in docstrings:
            continue
        out.append(tok.string)
    return " ".join(out).replace(" . ", ".").replace(". ", ".").replace(" .", ".").replace(
        "[ ", "[").replace(" ]", "]")


def test_no_module_outside_the_seam_names_a_comfyui_internal():
    files = product_files()
    assert len(files) > 60 and any(p.name == "wrappers.py" for p in files)
    found = []
    for path in files:
        rel = str(path.relative_to(ROOT))
        text = code_text(path)
        for label, pattern in TOKENS:
            if re.search(pattern, text) and label not in PENDING.get(rel, ()):
                found.append(f"{rel}: {label}")
    assert not found, "ComfyUI names outside comfy_seam/:\n" + "\n".join(found)


# ---------------------------------------------------------------------- the allow-list
# ComfyUI's top-level modules (and every comfy* one: comfy, comfy_extras, comfy_execution,
# comfy_api, comfy_kitchen, ...): a product module outside comfy_seam/ imports none of them
COMFYUI_MODULES = ("nodes", "folder_paths", "node_helpers", "execution", "server")
# the only exceptions, {where (a folder/ or a file): allowed module prefixes}
ALLOWED_IMPORTS: dict[str, tuple[str, ...]] = {
    "nodes/": ("comfy_api.latest",),  # ComfyUI's public node API: what a node pack is made of
    "__init__.py": ("comfy_api.latest",),  # the entry point asks whether ComfyUI serves V3 nodes
    # the pack's own use of the comfy-kitchen library: its int8 attention is one of the pack's
    # attention backends (kernels/backends.py `ck_int8`), called with tensors, not a ComfyUI
    # internal (ComfyUI's own use of comfy-kitchen is read in the seam: h3.weight_format)
    "kernels/": ("comfy_kitchen",),
}
# what model management and the patcher offer, from the modules `internals` lists them in, so
# the list cannot drift from what the seam calls: every attribute on the path of an entry
CALLED_MODULES = (internals.MM, "comfy.model_patcher", "comfy.utils", "comfy.quant_ops",
                  "comfy.model_base", "comfy.memory_management", "nodes", "folder_paths",
                  "node_helpers")
# the public patcher API every feature uses on the MODEL it is given (and torch's Tensor.clone):
# `clone()` before it installs, `get_model_object("diffusion_model")` to reach the DiT
PUBLIC_PATCHER_API = {"clone", "get_model_object"}
COMFYUI_CALLS = frozenset(
    part for entry in internals.INTERNALS if entry.kind != "source"
    and entry.target.partition(":")[0] in CALLED_MODULES
    for part in entry.target.partition(":")[2].split(".") if part) - PUBLIC_PATCHER_API
# calls that import or look a module up by a name given as text
_DYNAMIC_IMPORTS = {"import_module", "__import__", "find_spec", "find_module"}
# calls that reach an attribute by a name given as text
_BY_NAME = {"getattr", "hasattr", "setattr", "delattr"}
# calls allowed outside the seam while their owner moves them in, {file: names}: none left
PENDING_CALLS: dict[str, set[str]] = {}


def _is_comfyui(module: str) -> bool:
    top = module.split(".")[0]
    return top.startswith("comfy") or top in COMFYUI_MODULES


def _allowed(rel: str, module: str) -> bool:
    return any((rel.startswith(where) if where.endswith("/") else rel == where)
               and (module == prefix or module.startswith(prefix + "."))
               for where, prefixes in ALLOWED_IMPORTS.items() for prefix in prefixes)


def _leading_text(node: ast.AST) -> str | None:
    """The text a module name starts with: a constant, or an f-string's first constant part."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0],
                                                                      ast.Constant):
        return str(node.values[0].value)
    return None


def _is_sys_modules(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "modules" and isinstance(
        node.value, ast.Name) and node.value.id == "sys"


def _seam_names(tree: ast.Module) -> set[str]:
    """Names this module binds to the seam's modules and functions (`from ..comfy_seam import
    memory`, `from ..comfy_seam.memory import is_dynamic`): calling those is the point."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            seam = (node.level > 0 and module.split(".")[0] == "comfy_seam") or \
                module.startswith("h3_multigpu.comfy_seam")
            if seam:
                bound |= {a.asname or a.name for a in node.names}
    return bound


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def comfyui_uses(rel: str, source: str) -> list[str]:
    """What a product module outside the seam imports of ComfyUI, looks up by name, or calls
    of model management and the patcher, each as "line: what"."""
    tree = ast.parse(source)
    seam = _seam_names(tree)
    pending = PENDING_CALLS.get(rel, set())
    found = []

    def module_named(node: ast.AST, how: str) -> None:
        text = _leading_text(node)
        if text is not None and _is_comfyui(text) and not _allowed(rel, text):
            found.append(f"{node.lineno}: {how} {text!r}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names
                      if _is_comfyui(a.name) and not _allowed(rel, a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if _is_comfyui(node.module) and not _allowed(rel, node.module):
                found.append(f"{node.lineno}: from {node.module} import")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in _DYNAMIC_IMPORTS and node.args:
                module_named(node.args[0], f"{name}(")
            if isinstance(func, ast.Attribute) and _is_sys_modules(func.value) and node.args:
                module_named(node.args[0], f"sys.modules.{func.attr}(")
            if name in _BY_NAME and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                    and node.args[1].value in COMFYUI_CALLS - pending:
                found.append(f"{node.lineno}: {name}(..., {node.args[1].value!r})")
        elif isinstance(node, ast.Subscript) and _is_sys_modules(node.value):
            module_named(node.slice, "sys.modules[")
        elif isinstance(node, ast.Compare) and any(_is_sys_modules(c) for c in node.comparators):
            module_named(node.left, "in sys.modules:")
        if isinstance(node, ast.Attribute) and node.attr in COMFYUI_CALLS - pending \
                and _root_name(node) not in seam:
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in COMFYUI_CALLS - pending \
                and node.id not in seam:
            found.append(f"{node.lineno}: {node.id}")
    return found


def test_no_module_outside_the_seam_imports_or_calls_comfyui():
    """The allow-list: outside comfy_seam/, ComfyUI is reached through the seam's functions."""
    files = product_files()
    assert len(files) > 60 and any(p.name == "comfy_placement.py" for p in files)
    assert {"load_models_gpu", "free_memory", "soft_empty_cache", "get_torch_device",
            "deepclone_multigpu", "loaded_size", "register_load_device",
            "throw_exception_if_processing_interrupted", "InterruptProcessingException",
            "conditioning_set_values", "get_filename_list", "ProgressBar"} <= COMFYUI_CALLS
    found = [f"{path.relative_to(ROOT)}:{use}" for path in files
             for use in comfyui_uses(str(path.relative_to(ROOT)), path.read_text())]
    assert not found, "ComfyUI reached outside comfy_seam/:\n" + "\n".join(found)


@pytest.mark.parametrize(("rel", "line"), [
    ("decode/apply.py", "import comfy.model_management as mm"),
    ("decode/apply.py", "from comfy_extras import nodes_multigpu"),
    ("nodes/v3_upscale.py", "import folder_paths"),
    ("nodes/v3_utils.py", "import node_helpers"),
    ("nodes/v3_dropin.py", "import nodes"),
    ("guard/device.py", "import execution, server"),
    ("offload/apply.py", "from comfy_execution.graph import x"),
    ("kernels/backends.py", "from comfy_api.latest import io"),  # allowed in nodes/ only
    ("nodes/placement.py", "import comfy_kitchen"),  # allowed in kernels/ only
    ("chunking/apply.py", "m = importlib.import_module('comfy.utils')"),
    ("chunking/apply.py", "m = __import__('folder_paths')"),
    ("chunking/apply.py", "m = sys.modules.get('comfy.model_management')"),
    ("chunking/apply.py", "m = sys.modules[f'comfy.{name}']"),
    ("chunking/apply.py", "ok = 'nodes' in sys.modules"),
    ("decode/apply.py", "mm.load_models_gpu([patcher])"),
    ("nodes/comfy_placement.py", "clone = patcher.deepclone_multigpu(new_load_device=d)"),
    ("nodes/comfy_placement.py", "register = getattr(clone, 'register_load_device', None)"),
    ("decode/apply.py", "free_memory(1 << 30, device)"),
    ("decode/apply.py", "progress = utils.ProgressBar(4)"),
    ("sequence/threads.py", "caught = (mm.InterruptProcessingException,)"),
    ("guard/oom.py", "mm.free_memory(1, d)"),  # pending lets soft_empty_cache only
])
def test_the_allow_list_trips(rel, line):
    """Each way of reaching ComfyUI outside the seam is caught, in the module it would sit in."""
    path = ROOT / rel
    source = path.read_text() + "\n\n" + f"def _scratch():\n    {line}\n"
    assert comfyui_uses(rel, path.read_text()) == [], rel  # the module is clean as it is
    assert comfyui_uses(rel, source), f"{rel}: {line!r} not caught"


def test_the_allow_list_lets_the_seam_and_the_public_apis_through():
    fine = ('"""Calls load_models_gpu and imports comfy.utils (a docstring)."""\n'
            "from comfy_api.latest import io\n"
            "from ..comfy_seam import models\n"
            "from ..comfy_seam.memory import is_dynamic\n"
            "from .nodes import x\n"
            "from . import server\n"
            "def f(p, t):\n"
            "    models.load([p])\n"
            "    t = t.clone()\n"
            "    m = importlib.import_module('.sharded', __package__)\n"
            "    return is_dynamic(p), p.get_model_object('diffusion_model')\n")
    assert comfyui_uses("nodes/v3_upscale.py", fine) == []
    assert comfyui_uses("decode/apply.py", fine) == ["2: from comfy_api.latest import"]


def test_the_grep_finds_what_it_is_for(tmp_path):
    """A module that calls the patcher API itself is caught; its docstring is not."""
    bad = tmp_path / "bad.py"
    bad.write_text('"""Installs an add_object_patch."""\n\ndef f(p):\n'
                   '    p.add_object_patch("x", 1)  # object patch\n'
                   '    return p.model_options["transformer_options"]\n')
    text = code_text(bad)
    hits = {label for label, pattern in TOKENS if re.search(pattern, text)}
    assert hits == {"add_object_patch", "model_options", '"transformer_options"'}, hits
    assert "Installs" not in text and "# object" not in text
    fine = tmp_path / "fine.py"
    fine.write_text('"""Mentions add_object_patch and "optimized_attention_override"."""\n'
                    'import comfy_kitchen\nfrom comfy_api.latest import io\n')
    assert not any(re.search(pattern, code_text(fine)) for _, pattern in TOKENS)


def test_chunking_restates_no_block_math():
    """Chunking runs upstream's block: none of its modulation helpers are called in chunking/."""
    for path in (ROOT / "chunking").glob("*.py"):
        text = code_text(path)
        for name in ("_mod_scale_shift", "_mod_gate", "adaln_proj", "mod_scale_shift",
                     "rms_rope"):
            assert name not in text, f"{path.name}: {name}"


def test_product_code_never_imports_the_twin():
    for path in product_files():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = ("." * node.level) + (node.module or "")
                assert "twin" not in module.split("."), f"{path}: imports {module}"
            elif isinstance(node, ast.Import):
                assert not any("twin" in a.name.split(".") for a in node.names), path


def test_constants_are_spelled_once():
    """The pack's keys and ComfyUI's names are assigned in comfy_seam/names.py only."""
    for path in [*product_files(), *(ROOT / "comfy_seam").glob("*.py")]:
        if path.name == "names.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                value = node.value.value
                spelled = {v for k, v in vars(names).items() if k.isupper()}
                assert value not in spelled or not isinstance(value, str), \
                    f"{path.relative_to(ROOT)}:{node.lineno} assigns {value!r}"


# ---------------------------------------------------------------------- the protocol
@pytest.fixture
def twin():
    return make_twin(TwinConfig.tiny(), seed=0)


def _keys(patcher, kind):
    return list(protocol.wrapper_table(patcher).get(kind, {}))


def test_wrappers_run_in_the_stated_order_whatever_the_install_order(twin):
    base = TwinPatcher(twin)
    for order in (("chunking", "dual_sage", "guard"), ("guard", "chunking", "dual_sage")):
        patcher = base.clone()
        patcher.add_wrapper_with_key(names.DIFFUSION_MODEL, "other.pack", lambda e, *a, **k:
                                     e(*a, **k))
        for feature in order:
            protocol.install(patcher, feature,
                             protocol.wrapper(names.DIFFUSION_MODEL, lambda e, *a, **k: e(*a, **k)))
        assert _keys(patcher, names.DIFFUSION_MODEL) == [
            names.GUARD_KEY, names.DUAL_SAGE_KEY, names.CHUNKING_KEY, "other.pack"]
        rows = protocol.describe(patcher)
        assert [r.feature for r in rows] == ["guard", "dual_sage", "chunking"]
    with pytest.raises(ValueError, match="not one the seam orders"):
        protocol.install(base.clone(), "chunkin")


def test_remove_rebuilds_the_chains_without_the_feature(twin):
    patcher = TwinPatcher(twin).clone()
    foreign = object()
    patcher.model_options["transformer_options"][names.OVERRIDE_KEY] = foreign

    class Link:
        def __init__(self, tag, previous):
            self.tag, self.previous = tag, previous

    def chain(o):
        tags = []
        while isinstance(o, Link):
            tags.append(o.tag)
            o = o.previous
        return tags, o

    for feature in ("dual_sage", "chunking", "attention"):
        protocol.install(patcher, feature,
                         protocol.override(lambda prev, f=feature: Link(f, prev)),
                         protocol.block_patch(1, lambda prev, f=feature: Link(f, prev)))
    assert chain(protocol.override_of(patcher)) == (["attention", "chunking", "dual_sage"],
                                                    foreign)
    removed = protocol.remove(patcher, "chunking")
    assert chain(protocol.override_of(removed)) == (["attention", "dual_sage"], foreign)
    assert chain(protocol.block_patch_at(removed, 1)) == (["attention", "dual_sage"], None)
    assert chain(protocol.override_of(patcher)) == (["attention", "chunking", "dual_sage"],
                                                    foreign)  # the original is untouched
    assert [e.feature for e in protocol.installed(removed)] == ["dual_sage", "attention"]
    again = protocol.remove(protocol.remove(removed, "attention"), "dual_sage")
    assert protocol.override_of(again) is foreign and protocol.block_patch_at(again, 1) is None
    with pytest.raises(ValueError, match="not installed"):
        protocol.remove(again, "dual_sage")
    # a link of another pack on top of ours cannot be re-wired: refused, naming the slot
    patcher.model_options["transformer_options"][names.OVERRIDE_KEY] = Link(
        "other", protocol.override_of(patcher))
    with pytest.raises(ValueError, match="patched by another pack"):
        protocol.remove(patcher, "chunking")


def test_features_describe_what_they_installed_and_remove_cleanly(twin):
    from h3_multigpu.chunking import ChunkingConfig, apply_activation_chunking
    from h3_multigpu.dual_sage import DualSageConfig, apply_dual_sage
    from h3_multigpu.guard.device import guard_diffusion_model
    from h3_multigpu.offload import PrefetchConfig, apply_block_prefetch

    inputs = make_inputs(TwinConfig.tiny(), latent_t=3, latent_h=4, latent_w=6, audio_t=5,
                         seed=1)
    base = TwinPatcher(twin, load_device="cpu")
    reference = base.apply_model(*inputs)
    # composed as the nodes compose them: the device guard is the composer's
    patched = guard_diffusion_model(apply_activation_chunking(base, ChunkingConfig(
        ffn_chunk=13, qkv_chunk=17, head_group=3)))
    patched = apply_dual_sage(patched, DualSageConfig(helpers=("cpu",), split="5:3",
                                                      min_tokens=0))
    patched = apply_block_prefetch(patched, PrefetchConfig(resident_blocks=1, lookahead=1))
    line = protocol.describe_line(patched)
    assert line.startswith("hooks, outermost first: guard (")
    assert line.index("prefetch (") < line.index("dual_sage (") < line.index("chunking (")
    assert "chained in install order: chunking < dual_sage < prefetch" in line
    assert _keys(patched, names.DIFFUSION_MODEL) == [
        names.GUARD_KEY, names.PREFETCH_KEY, names.DUAL_SAGE_KEY, names.CHUNKING_KEY]
    for feature in ("prefetch", "dual_sage", "chunking"):
        stripped = protocol.remove(patched, feature)
        assert feature not in {r.feature for r in protocol.describe(stripped)}
        out = stripped.apply_model(*inputs)
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5)
                   for a, b in zip(out, reference, strict=True))
    bare = protocol.remove(protocol.remove(protocol.remove(patched, "prefetch"), "dual_sage"),
                           "chunking")
    assert protocol.override_of(bare) is None and not protocol.block_patches(bare)
    assert not bare.object_patches
    assert [e.feature for e in protocol.installed(bare)] == ["guard", "oom"]


# ---------------------------------------------------------------------- the seam's functions
def test_root_device_is_the_load_device_and_a_bare_cuda_the_current_one(monkeypatch):
    from types import SimpleNamespace

    from h3_multigpu.comfy_seam.devices import root_device

    assert root_device(SimpleNamespace(load_device="cpu")) == torch.device("cpu")
    assert root_device(SimpleNamespace(load_device=torch.device("cuda", 1))) == \
        torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert root_device(SimpleNamespace(load_device="cuda")) == torch.device("cuda", 3)


def test_one_model_management_accessor_never_imports_comfyui_unless_asked(monkeypatch):
    import sys
    import types

    from h3_multigpu.comfy_seam import interrupts, runtime

    monkeypatch.delitem(sys.modules, "comfy.model_management", raising=False)
    assert runtime.model_management() is None and "comfy.model_management" not in sys.modules
    assert not interrupts.processing_interrupted()
    interrupts.raise_if_interrupted()  # nothing to raise outside ComfyUI
    mm = types.ModuleType("comfy.model_management")
    mm.processing_interrupted = lambda: True
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    assert runtime.model_management() is mm and runtime.model_management(importing=True) is mm
    assert interrupts.processing_interrupted()


def test_the_clone_path_names_what_is_missing_and_falls_back_in_the_seam():
    from types import SimpleNamespace

    from h3_multigpu.comfy_seam import clones
    from h3_multigpu.decode.replica import CloneMissing, comfy_clone

    class Patcher(SimpleNamespace):
        def clone(self):
            return Patcher(**vars(self))

    class Clonable(Patcher):
        def deepclone_multigpu(self, new_load_device=None):
            if self.cached_patcher_init is None:
                raise RuntimeError("Cannot create multigpu deepclone")
            registered = []
            return Patcher(load_device=new_load_device, registered=registered,
                           register_load_device=registered.append)

    gpu1 = torch.device("cuda", 1)
    bare, no_factory = Patcher(load_device="cpu"), Clonable(load_device="cpu",
                                                             cached_patcher_init=None)
    assert clones.clone_gap(bare) == clones.NO_CLONES
    assert clones.clone_gap(no_factory) == clones.NO_FACTORY
    with pytest.raises(CloneMissing, match="no ModelPatcher.deepclone_multigpu"):
        comfy_clone(bare, gpu1)
    with pytest.raises(CloneMissing, match="registered no reload factory"):
        comfy_clone(no_factory, gpu1)
    made = comfy_clone(Clonable(load_device="cpu", cached_patcher_init=(print, ())), gpu1)
    assert made.load_device == gpu1 and made.registered == [gpu1]  # DynamicVRAM's pins
    placed, how = clones.retarget(no_factory, gpu1)
    assert placed.load_device == gpu1 and no_factory.load_device == "cpu"
    assert how == "load_device set on a clone (deepclone_multigpu refused (Cannot create " \
                  "multigpu deepclone))"
    assert clones.retarget(bare, gpu1)[1] == ("load_device set on a clone (this ComfyUI has no "
                                              "deepclone_multigpu)")
