"""The seam owns every ComfyUI name: no other module spells one; install / remove / describe.

The grep test reads the package's own source (not tests/, dev/bench/, dev/tools/ or the twin, which
stands in for ComfyUI) and fails on a ComfyUI hook call, key, wrapper type or import outside
`comfy_seam/`. Docstrings and comments may name them (they say what is used where).
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

from h3_multigpu.comfy_seam import names, protocol

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
    ("comfy import", r"\b(?:import|from) comfy(?:\.|\b(?!_))"),
    *((f'"{v}"', re.escape(f'"{v}"')) for v in (
        names.OVERRIDE_KEY, names.PATCHES_REPLACE, names.DOUBLE_BLOCK,
        names.PREFETCH_DYNAMIC_VBARS, names.TRANSFORMER_OPTIONS, names.SEAM_KEY,
        names.PARALLEL_KEY, names.GUARD_KEY, names.PREFETCH_KEY, names.DUAL_SAGE_KEY,
        names.SEQUENCE_KEY, names.CHUNKING_KEY, names.VAE_DECODE_LOOP, names.OUTER_SAMPLE,
        names.PREPARE_SAMPLING, names.ON_LOAD, names.ON_DETACH, names.ON_CLEANUP,
        names.ON_APPLY_HOOKS)),
    (f'["{names.STATUS_KEY}"]', re.escape(f'["{names.STATUS_KEY}"]')),
    # a ComfyUI module looked up without importing it (comfy_seam.runtime's loaded_* do that)
    ("sys.modules lookup of comfy", r"""sys\s*\.\s*modules\s*(?:\.\s*get\s*\(|\[)\s*f?["']comfy"""),
)
# (ComfyUI's public node API, comfy_api.latest, is what a node pack is made of: allowed. The
# "dit" patch group is not searched for: the planner names its DiT component "dit".)


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
    assert re.search(dict(TOKENS)["comfy import"], "import comfy.utils")
    assert re.search(dict(TOKENS)["comfy import"], "from comfy.ops import x")


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
