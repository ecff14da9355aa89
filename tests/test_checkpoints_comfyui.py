"""Issue 23 inside a real ComfyUI (CPU): corrupt and foreign checkpoints, and every node's
validate_inputs against nasty values.

Files are written by tests/h3_checkpoints.py from the ComfyUI class in this process (the
official INT8 ConvRot layout), then damaged. Each test shows what ComfyUI's own loader says of
the defect (its words, which do not name the file) and where the pack can say better:
- the planner's `--dit-file` and the pack's latent upscaler loader see the file name before
  anything reads the file: `checkpoint_check` refuses a truncated or mislabelled file there;
- the H3 Multi-GPU node sees a MODEL that UNETLoader already loaded: a truncated file or an
  unreadable comfy_quant never gets that far (UNETLoader fails first, in ComfyUI's words), but
  a foreign DiT, or metadata that mislabels the weights (ComfyUI loads that and computes
  garbage), is refused there naming the file, before any placement.

    COMFYUI_PATH=/path/to/ComfyUI python -m pytest -q -m comfyui -o addopts="--strict-markers" \
        tests/test_checkpoints_comfyui.py
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.comfyui

RAW = ("invalid literal", "could not convert", "cannot convert float", "Exceeds the limit",
       "has no attribute", "not subscriptable", "not iterable", "unpack")


@pytest.fixture(scope="module")
def comfyui():
    from comfyui_h3 import import_comfyui_or_skip

    return import_comfyui_or_skip()


@pytest.fixture(scope="module")
def int8_state_dict(comfyui):
    from h3_checkpoints import DiTShape, dit_state_dict

    return dit_state_dict(DiTShape.tiny(), "int8_convrot", seed=0)


def save(sd: dict, path: Path) -> Path:
    from h3_checkpoints import _save

    return _save(sd, path)


def comfyui_load(path: Path):
    """UNETLoader's path: (the patcher, None) or (None, the exception ComfyUI raised)."""
    from comfyui_h3 import load_dit

    try:
        return load_dit(path), None
    except Exception as exc:  # whatever ComfyUI raises is what the test records
        return None, exc


def test_a_truncated_dit_comfyui_says_incomplete_metadata_the_pack_says_which_file(
        int8_state_dict, tmp_path):
    from h3_multigpu.planner.checkpoint_check import CheckpointError, check_dit_file

    path = save(int8_state_dict, tmp_path / "minimax_h3_int8.safetensors")
    path.write_bytes(path.read_bytes()[:-4096])
    patcher, error = comfyui_load(path)
    assert patcher is None and "incomplete metadata, file not fully covered" in str(error)
    assert str(path) not in str(error)  # ComfyUI's words do not name the file
    with pytest.raises(CheckpointError, match="is truncated: its header lists") as info:
        check_dit_file(path)
    assert str(info.value).startswith(str(path))


def _quant(conf) -> torch.Tensor:
    raw = conf if isinstance(conf, bytes) else json.dumps(conf).encode()
    return torch.tensor(list(raw), dtype=torch.uint8)


@pytest.mark.parametrize("conf,comfyui_raises,pack_says", [
    (b"{not json", "JSONDecodeError", "its comfy_quant is not JSON"),
    ({"format": "int9_magic"}, "KeyError", "format is 'int9_magic', which this ComfyUI does not "
                                           "know"),
    ([1, 2], "AttributeError", "its comfy_quant is [1, 2], not an object"),
    ({"convrot": True}, "ValueError", "its comfy_quant format is None"),
    ({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": "abc"}, "ValueError",
     "convrot_groupsize is 'abc', not a positive whole number"),
])
def test_unreadable_comfy_quant_fails_in_comfyuis_words_and_the_pack_names_layer_and_file(
        int8_state_dict, tmp_path, conf, comfyui_raises, pack_says):
    from h3_multigpu.nodes.model_check import comfy_formats
    from h3_multigpu.planner.checkpoint_check import CheckpointError, check_dit_file

    sd = dict(int8_state_dict)
    sd["blocks.0.mlp.fc1.comfy_quant"] = _quant(conf)
    path = save(sd, tmp_path / "dit.safetensors")
    patcher, error = comfyui_load(path)
    assert patcher is None and type(error).__name__ == comfyui_raises, repr(error)
    with pytest.raises(CheckpointError) as info:
        check_dit_file(path, comfy_formats())
    assert f"{path}: layer 'blocks.0.mlp.fc1': " in str(info.value) and pack_says in str(
        info.value)


def test_metadata_that_mislabels_int8_as_fp8_loads_in_comfyui_and_the_h3_node_refuses_it(
        int8_state_dict, tmp_path):
    from h3_multigpu.nodes.model_check import check_h3_model, model_file
    from h3_multigpu.planner.checkpoint_check import CheckpointError

    sd = dict(int8_state_dict)
    sd["blocks.1.attn.qkv_proj.comfy_quant"] = _quant({"format": "float8_e4m3fn"})
    path = save(sd, tmp_path / "minimax_h3_mislabelled.safetensors")
    patcher, error = comfyui_load(path)
    assert error is None, error  # ComfyUI loads it: INT8 bytes read as fp8 values
    assert model_file(patcher) == str(path)  # cached_patcher_init (0.33.0, newest)
    with pytest.raises(CheckpointError, match="layer 'blocks.1.attn.qkv_proj': its comfy_quant "
                                              "says float8_e4m3fn, but its weight is stored as "
                                              "I8"):
        check_h3_model(patcher)


def test_the_h3_node_takes_a_real_h3_and_refuses_anything_else_before_placing_it(
        comfyui, monkeypatch):
    import comfy.model_patcher
    from comfyui_h3 import TinyH3Config, make_tiny_h3

    from h3_multigpu.nodes import comfy_placement
    from h3_multigpu.nodes.model_check import check_h3_model
    from h3_multigpu.nodes.v3_dropin import run_dropin

    h3 = make_tiny_h3(TinyH3Config(weights="int8_convrot"), seed=0)
    check_h3_model(h3)  # the class, its blocks and its file's header all pass
    placed = []
    monkeypatch.setattr(comfy_placement, "place_model", lambda *a: placed.append(a))
    cpu = torch.device("cpu")
    other = comfy.model_patcher.ModelPatcher(torch.nn.Linear(4, 4), load_device=cpu,
                                             offload_device=cpu)
    sizes = dict(pass2_width=1312, pass2_height=736, pass1_width=864, pass1_height=480,
                 seconds=5.0, devices="2xH200", lora_rank=0)
    with pytest.raises(ValueError, match=r"the model input is Linear \(torch\.nn\.modules\."
                                         r"linear\.Linear\), not MiniMax H3; connect the H3 DiT"):
        run_dropin(other, None, None, None, None, None, sizes, root_gpu="gpu:0",
                   helper_gpu="gpu:1")
    assert placed == []


def test_the_upscaler_loader_names_a_truncated_file_before_comfyui_reads_it(comfyui, tmp_path):
    import comfy.utils
    from safetensors.torch import save_file
    from test_upscale import small_state_dict

    from h3_multigpu.nodes.v3_upscale import load_upscaler_patcher
    from h3_multigpu.planner.checkpoint_check import CheckpointError

    path = tmp_path / "up.safetensors"
    save_file({k: v.contiguous() for k, v in small_state_dict().items()}, str(path))
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(Exception, match="incomplete metadata"):
        comfy.utils.load_torch_file(str(path), safe_load=True)  # what ComfyUI alone says
    with pytest.raises(CheckpointError, match=f"^{path}: is truncated"):
        load_upscaler_patcher(str(path))
    foreign = tmp_path / "lora.safetensors"
    save_file({"lora_unet_x.lora_up.weight": torch.zeros(2, 2)}, str(foreign))
    with pytest.raises(ValueError, match=f"^{foreign}: not an H3 latent upscaler checkpoint"):
        load_upscaler_patcher(str(foreign))


def test_comfyuis_own_quantization_formats_are_the_ones_checked(comfyui):
    from h3_multigpu.nodes.model_check import comfy_formats
    from h3_multigpu.planner.checkpoint_check import FORMATS

    formats = comfy_formats()
    assert formats["int8_tensorwise"] == (frozenset({"I8"}), frozenset({"weight_scale"}))
    assert formats["float8_e4m3fn"][0] == frozenset({"F8_E4M3", "U8"})
    assert set(formats) <= set(FORMATS)  # the pack's table knows every format this release has


NASTY = ["²", "١", "gpu:²", "abc", "", " ", "inf", "nan", "-1", "1e999", "9" * 5000, "28;28",
         "nan:1", "\x00", "auto,auto"]


def test_every_node_validate_inputs_answers_nasty_text_with_a_message(comfyui):
    """What a workflow file can put in any String input a pack node validates itself (the
    server converts String inputs with str() first): True or a message, never an exception or
    Python's own words."""
    from comfy_api.internal import first_real_override  # ComfyUI internal (0.33.0, newest)
    from comfy_api.latest import io

    from h3_multigpu.nodes import extension

    checked = 0
    for cls in extension.all_nodes():
        method = first_real_override(cls, "validate_inputs")
        if method is None:
            continue
        schema = cls.GET_SCHEMA()
        strings = {i.id for i in schema.inputs if isinstance(i, io.String.Input)}
        for name in inspect.getfullargspec(method).args[1:]:
            if name not in strings:
                continue
            for value in NASTY:
                answer = cls.validate_inputs(**{name: value})
                assert answer is True or (isinstance(answer, str) and not any(
                    raw in answer for raw in RAW)), (schema.node_id, name, value, answer)
                checked += 1
    assert checked > 100


def test_the_official_full_size_int8_layout_passes_whole_in_a_moment(comfyui, tmp_path):
    """No false refusal at full size: the header of the official INT8 ConvRot DiT (932
    tensors, 50 blocks, 200 INT8 linears; names, dtypes and shapes from ComfyUI's class on
    the meta device), written over a sparse 19.5 GB file so that nothing but the header and
    the comfy_quant bytes takes disk space."""
    import struct
    import time

    from h3_checkpoints import (
        INT8_CONVROT_CONF,
        OFFICIAL_INT8_DIT_TENSORS,
        QUANTIZED_BLOCK_LINEARS,
        DiTShape,
        dit_layout,
    )

    from h3_multigpu.nodes.model_check import comfy_formats
    from h3_multigpu.planner.checkpoint_check import check_dit_file, h3_dit_layout

    shape = DiTShape.full()
    quantized = {f"blocks.{i}.{lin}" for i in range(shape.blocks) for lin in
                 QUANTIZED_BLOCK_LINEARS}
    conf = json.dumps(INT8_CONVROT_CONF).encode()
    entries: list[tuple[str, str, list[int], bytes | None]] = []
    for name, meta in sorted(dit_layout(shape).items()):
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module in quantized:
            entries += [(name, "I8", list(meta.shape), None),
                        (f"{module}.weight_scale", "F32", [meta.shape[0], 1], None),
                        (f"{module}.comfy_quant", "U8", [len(conf)], conf)]
        else:
            entries.append((name, "F32" if meta.dtype == torch.float32 else "BF16",
                            list(meta.shape), None))
    sizes = {"I8": 1, "U8": 1, "BF16": 2, "F32": 4}
    header, position, payload = {}, 0, []
    for name, dtype, dims, data in entries:
        count = 1
        for d in dims:
            count *= d
        header[name] = {"dtype": dtype, "shape": dims,
                        "data_offsets": [position, position + count * sizes[dtype]]}
        if data is not None:
            payload.append((position, data))
        position += count * sizes[dtype]
    raw = json.dumps(header).encode()
    path = tmp_path / "minimax_h3_fl2va_pruned_int8_convrot.safetensors"
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        start = 8 + len(raw)
        for offset, data in payload:
            f.seek(start + offset)
            f.write(data)
        f.truncate(start + position)  # sparse: the weights take no disk space
    assert len(header) == OFFICIAL_INT8_DIT_TENSORS and position > 19e9
    began = time.monotonic()
    checkpoint = check_dit_file(path, comfy_formats())
    assert time.monotonic() - began < 5  # header and 200 small reads, never the weights
    assert h3_dit_layout(checkpoint) == {"blocks": 50, "hidden": 5376, "heads": 56}
