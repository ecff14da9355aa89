"""Issue 23, corrupt and foreign checkpoints: a clear refusal naming the file, from its header
(and its layers' few-byte comfy_quant JSON), before any weight is read or any GPU memory taken.

The files here are small safetensors files in the official INT8 ConvRot layout (names, dtypes,
comfy_quant), written with `safetensors` alone; tests/test_checkpoints_comfyui.py writes real
ones with ComfyUI's H3 class and shows what ComfyUI's own loader says of the same defects.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from twin import TwinPatcher

from h3_multigpu.nodes.model_check import check_h3_model, h3_model_problem, model_file
from h3_multigpu.planner import checkpoint_check as cc

INT8_CONF = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}


def quant(conf) -> torch.Tensor:
    raw = conf if isinstance(conf, bytes) else json.dumps(conf).encode()
    return torch.tensor(list(raw), dtype=torch.uint8)


def mini_dit(blocks: int = 2, conf=INT8_CONF) -> dict[str, torch.Tensor]:
    """An H3 DiT's tensor names and storage (2 heads of 8), INT8 ConvRot linears."""
    sd = {"video_patch_proj.weight": torch.zeros(16, 96), "audio_patch_proj.weight":
          torch.zeros(16, 32), "condition_proj.weight": torch.zeros(16, 8, dtype=torch.bfloat16)}
    for i in range(blocks):
        for linear, shape in (("attn.qkv_proj", (48, 16)), ("mlp.fc1", (64, 16))):
            sd[f"blocks.{i}.{linear}.weight"] = torch.zeros(shape, dtype=torch.int8)
            sd[f"blocks.{i}.{linear}.weight_scale"] = torch.ones(shape[0], 1)
            sd[f"blocks.{i}.{linear}.comfy_quant"] = quant(conf)
        sd[f"blocks.{i}.attn.q_norm.weight"] = torch.ones(8, dtype=torch.bfloat16)
    return sd


def write(path: Path, sd: dict[str, torch.Tensor]) -> Path:
    save_file(sd, str(path))
    return path


@pytest.fixture
def dit(tmp_path) -> Path:
    return write(tmp_path / "minimax_h3_fl2va_pruned_int8_convrot.safetensors", mini_dit())


def refused(path: Path, fragment: str) -> str:
    with pytest.raises(cc.CheckpointError) as info:
        cc.check_dit_file(path)
    message = str(info.value)
    assert message.startswith(str(path)), message
    assert fragment in message, message
    return message


def test_an_intact_int8_dit_passes_and_says_what_it_is(dit):
    checkpoint = cc.check_dit_file(dit)
    assert cc.h3_dit_layout(checkpoint) == {"blocks": 2, "hidden": 16, "heads": 2}
    assert cc.check_quantization(checkpoint) == {"int8_tensorwise": 4}


# -- truncated and damaged files -------------------------------------------------------------

@pytest.mark.parametrize("keep,fragment", [
    (lambda size, header: size - 100, "is truncated: its header lists"),
    (lambda size, header: size // 2, "the download or copy was cut short"),
    (lambda size, header: 8 + header // 2, "is truncated inside its header"),
    (lambda size, header: 5, "is 5 bytes, too short to be a safetensors file"),
    (lambda size, header: 0, "is empty"),
])
def test_a_truncated_download_is_named_with_its_size(dit, keep, fragment):
    raw = dit.read_bytes()
    header = struct.unpack("<Q", raw[:8])[0]
    dit.write_bytes(raw[: keep(len(raw), header)])
    message = refused(dit, fragment)
    assert "download it again" in message


def test_bytes_after_the_last_tensor_and_foreign_formats_are_named(dit, tmp_path):
    dit.write_bytes(dit.read_bytes() + b"junk")
    refused(dit, "has 4 bytes after its last tensor")
    pickle = tmp_path / "model.safetensors"
    pickle.write_bytes(b"PK\x03\x04" + bytes(64))  # a .pt (zip) file renamed
    refused(pickle, "is not a safetensors file (it does not start with a header length and a "
                    "JSON header); is it a .ckpt/.pt file renamed?")
    page = tmp_path / "page.safetensors"
    page.write_bytes(struct.pack("<Q", 20) + b"{html>not found</ht>")
    refused(page, "its header is not JSON); is it a .ckpt/.pt file renamed, or a web page")


def test_a_header_whose_offsets_do_not_tile_the_data_is_corrupt(tmp_path):
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    raw = json.dumps(header).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(12))
    with pytest.raises(cc.CheckpointError, match="tensor 'b' overlaps another"):
        cc.read_checkpoint(path)
    header["b"] = {"dtype": "F32", "shape": [3], "data_offsets": [8, 16]}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(16))
    with pytest.raises(cc.CheckpointError, match=r"tensor 'b' \(F32 \[3\]\) needs 12 bytes but "
                                                 r"is given 8"):
        cc.read_checkpoint(path)


def test_a_missing_file_or_a_folder_is_named(tmp_path):
    with pytest.raises(cc.CheckpointError, match="does not exist"):
        cc.check_dit_file(tmp_path / "nope.safetensors")
    with pytest.raises(cc.CheckpointError, match="is a folder"):
        cc.check_dit_file(tmp_path)


# -- wrong comfy_quant metadata --------------------------------------------------------------

@pytest.mark.parametrize("conf,fragment", [
    (b"{not json", "its comfy_quant is not JSON (b'{not json')"),
    (b"\xff\xfe\x00", "its comfy_quant is not JSON"),
    ([1, 2], "its comfy_quant is [1, 2], not an object"),
    ({"convrot": True}, "its comfy_quant format is None, which this ComfyUI does not know"),
    ({"format": "int9_magic"}, "format is 'int9_magic', which this ComfyUI does not know (it "
                               "knows asym_w4a8_int8, convrot_w4a4, float8_e4m3fn"),
    ({"format": "float8_e4m3fn"}, "its comfy_quant says float8_e4m3fn, but its weight is stored "
                                  "as I8 (expected F8_E4M3 or U8); ComfyUI would load it and "
                                  "compute garbage"),
    ({"format": "int8_tensorwise", "convrot_groupsize": "abc"},
     "its comfy_quant convrot_groupsize is 'abc', not a positive whole number"),
    ({"format": "int8_tensorwise", "params": {"convrot_groupsize": 0}},
     "convrot_groupsize is 0, not a positive whole number"),
])
def test_wrong_comfy_quant_metadata_names_the_layer_and_the_file(tmp_path, conf, fragment):
    sd = mini_dit()
    sd["blocks.1.mlp.fc1.comfy_quant"] = quant(conf)
    path = write(tmp_path / "dit.safetensors", sd)
    message = refused(path, fragment)
    assert f"{path}: layer 'blocks.1.mlp.fc1': " in message


def test_a_quantized_layer_without_its_scale_is_named(tmp_path):
    sd = mini_dit()
    del sd["blocks.0.attn.qkv_proj.weight_scale"]
    refused(write(tmp_path / "dit.safetensors", sd),
            "layer 'blocks.0.attn.qkv_proj': its int8_tensorwise weight has no weight_scale")


def test_the_running_comfyuis_formats_decide_what_is_known(dit):
    only_fp8 = {"float8_e4m3fn": cc.FORMATS["float8_e4m3fn"]}
    with pytest.raises(cc.CheckpointError, match="'int8_tensorwise', which this ComfyUI does not "
                                                 "know \\(it knows float8_e4m3fn\\); update"):
        cc.check_dit_file(dit, only_fp8)


# -- foreign files ---------------------------------------------------------------------------

@pytest.mark.parametrize("sd,looks", [
    ({"diffusion_model.blocks.0.attn.lora_A.weight": torch.zeros(4, 16),
      "diffusion_model.blocks.0.attn.lora_B.weight": torch.zeros(16, 4)}, "a LoRA"),
    ({"double_blocks.0.img_attn.qkv.weight": torch.zeros(4, 4), "img_in.weight":
      torch.zeros(4, 4)}, "a Flux or HunyuanVideo DiT"),
    ({"blocks.0.self_attn.q.weight": torch.zeros(4, 4), "blocks.0.cross_attn.q.weight":
      torch.zeros(4, 4)}, "a Wan DiT"),
    ({"encoder.conv_in.weight": torch.zeros(4), "decoder.conv_out.weight": torch.zeros(4)},
     "a VAE"),
    ({"foo": torch.zeros(1)}, "no model this pack knows (its first tensors: 'foo')"),
])
def test_a_file_that_is_not_an_h3_dit_says_what_it_looks_like(tmp_path, sd, looks):
    path = write(tmp_path / "model.safetensors", sd)
    message = refused(path, f"is not a MiniMax H3 DiT: it looks like {looks}")
    assert "Load minimax_h3_fl2va_pruned_int8_convrot.safetensors" in message


def test_a_dit_saved_with_comfyuis_prefix_is_still_h3(tmp_path):
    sd = {f"model.diffusion_model.{k}": v for k, v in mini_dit(blocks=3).items()}
    checkpoint = cc.check_dit_file(write(tmp_path / "full.safetensors", sd))
    assert cc.h3_dit_layout(checkpoint)["blocks"] == 3


# -- the MODEL the H3 Multi-GPU node receives (the twin: no ComfyUI here) --------------------

class Loaded:
    """What UNETLoader hands on: a patcher whose cached_patcher_init names its file."""

    def __init__(self, base, path: str | None = None):
        self.model = base
        self.cached_patcher_init = (None, (path, {})) if path else None


def test_the_node_refuses_a_model_without_h3_blocks_naming_its_file(tmp_path, tiny_twin):
    assert h3_model_problem(TwinPatcher(tiny_twin)) is None
    other = Loaded(torch.nn.Module(), str(tmp_path / "flux1-dev.safetensors"))
    other.model.diffusion_model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError) as info:
        check_h3_model(other)
    assert str(info.value) == (
        "the model input's diffusion model (Linear) (loaded from flux1-dev.safetensors) has no "
        "H3 DiT blocks (blocks[i].attn), which this pack places and patches; connect the H3 "
        "DiT: UNETLoader with minimax_h3_fl2va_pruned_int8_convrot.safetensors")
    with pytest.raises(ValueError, match="the model input is a str, not a ComfyUI MODEL"):
        check_h3_model("minimax_h3.safetensors")


def test_the_node_checks_the_file_its_model_came_from(tmp_path, tiny_twin):
    sd = mini_dit()
    sd["blocks.0.attn.qkv_proj.comfy_quant"] = quant({"format": "float8_e4m3fn"})
    path = write(tmp_path / "h3_mislabelled.safetensors", sd)
    model = Loaded(TwinPatcher(tiny_twin).model, str(path))
    assert model_file(model) == str(path)
    with pytest.raises(cc.CheckpointError, match="its comfy_quant says float8_e4m3fn, but its "
                                                 "weight is stored as I8"):
        check_h3_model(model)
    check_h3_model(Loaded(model.model, str(write(tmp_path / "good.safetensors", mini_dit()))))
    check_h3_model(Loaded(model.model, str(tmp_path / "moved_since.safetensors")))  # gone: skip


def test_plan_refuses_a_truncated_dit_file_before_planning(dit, capsys):
    """`h3-multigpu plan --dit-file` reads the header first: a cut-off download is exit 2 with
    the file named, not a plan made from the sizes of a broken file."""
    from h3_multigpu.cli import main

    raw = dit.read_bytes()
    dit.write_bytes(raw[: len(raw) - 100])
    code = main(["plan", "--profile", "2xR9700", "--dit-file", str(dit)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert str(dit) in err and "download it again" in err
