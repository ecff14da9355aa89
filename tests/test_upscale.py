"""The learned latent upscaler (upscale/): built as the checkpoint describes, bit-identical to a
functional reference written from the network's description, NestedTensor-aware."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from h3_multigpu.upscale import (
    LATENT_MEAN,
    LATENT_STD,
    H3LatentUpscaler,
    UpscalerShape,
    build_from_state_dict,
    target_latent_size,
    upscale_latent,
    upscale_video,
)

SMALL = UpscalerShape(latent_channels=24, channels=32, in_blocks=3, out_blocks=2,
                      temporal_every=2, temporal_kernel=5)


def small_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under the checkpoint's names (with its optional `upscaler.` prefix)."""
    gen = torch.Generator().manual_seed(seed)
    net = H3LatentUpscaler(SMALL)
    return {f"upscaler.{k}": torch.randn(v.shape, generator=gen) * 0.05
            for k, v in net.state_dict().items()}


def reference_forward(sd: dict, x: torch.Tensor, scale: float, size: tuple) -> torch.Tensor:
    """The network from its description, with functional ops and the state dict only."""
    sd = {k.removeprefix("upscaler."): v for k, v in sd.items()}

    def conv(z, name, **kw):
        return F.conv3d(z, sd[f"{name}.weight"], sd[f"{name}.bias"], **kw)

    def norm(z, name):
        return F.group_norm(z, 32, sd[f"{name}.weight"], sd[f"{name}.bias"])

    emb = F.linear(torch.tensor([[scale - 1.0]]), sd["embed.0.weight"], sd["embed.0.bias"])
    emb = F.linear(F.silu(emb), sd["embed.2.weight"], sd["embed.2.bias"])

    def stage(z, prefix):
        index = 0
        while f"{prefix}.{index}.in_layers.0.weight" in sd or f"{prefix}.{index}.norm.weight" in sd:
            p = f"{prefix}.{index}"
            if f"{p}.in_layers.0.weight" in sd:  # residual block with the scale embedding
                h = conv(F.silu(norm(z, f"{p}.in_layers.0")), f"{p}.in_layers.2", padding=1)
                mod = F.linear(F.silu(emb), sd[f"{p}.emb_layers.1.weight"],
                               sd[f"{p}.emb_layers.1.bias"])
                gain, shift = mod.chunk(2, dim=1)
                h = norm(h, f"{p}.out_norm") * (1 + gain[:, :, None, None, None]) \
                    + shift[:, :, None, None, None]
                z = z + conv(F.silu(h), f"{p}.out_layers.2", padding=1)
            else:  # temporal block: depthwise over time, then pointwise
                k = sd[f"{p}.dwconv.weight"].shape[2]
                h = conv(F.silu(norm(z, f"{p}.norm")), f"{p}.dwconv", padding=(k // 2, 0, 0),
                         groups=z.shape[1])
                z = z + conv(h, f"{p}.pwconv")
            index += 1
        return z

    z = stage(conv(x, "conv_in", padding=1), "in_blocks")
    z = F.interpolate(z, size=size, mode="trilinear", align_corners=False)
    z = stage(z, "out_blocks")
    return conv(F.silu(norm(z, "norm_out")), "conv_out", padding=1)


def test_full_size_network_is_the_published_checkpoint_size():
    with torch.device("meta"):
        net = H3LatentUpscaler()
    params = sum(p.numel() for p in net.parameters())
    assert params == 345_280_216  # ~0.69 GB in fp16, as the checkpoint
    keys = list(net.state_dict())
    assert keys[:2] == ["conv_in.weight", "conv_in.bias"]
    assert "in_blocks.1.dwconv.weight" in keys and "in_blocks.2.in_layers.2.weight" in keys
    assert "out_blocks.17.emb_layers.1.weight" in keys and keys[-1] == "conv_out.bias"


def test_shape_is_read_from_the_tensors_and_the_prefix_is_dropped():
    sd = small_state_dict()
    net = build_from_state_dict(sd)
    assert net.shape == SMALL
    assert not net.training and not any(p.requires_grad for p in net.parameters())
    with pytest.raises(ValueError, match="not an H3 latent upscaler"):
        build_from_state_dict({"conv_in.weight": torch.zeros(8, 4, 3, 3)})
    broken = dict(sd)
    del broken["upscaler.out_blocks.0.out_norm.weight"]
    with pytest.raises(ValueError, match="missing.*out_blocks.0.out_norm.weight"):
        build_from_state_dict(broken)


@pytest.mark.parametrize("size", [(3, 6, 9), (3, 4, 6), (4, 7, 5)])
def test_forward_is_bit_identical_to_the_reference(size):
    torch.manual_seed(1)
    sd = small_state_dict()
    net = build_from_state_dict(sd)
    x = torch.randn(1, 24, 3, 4, 6)
    scale = (size[1] / 4 + size[2] / 6) / 2
    with torch.inference_mode():
        got = net(x, scale, size)
    assert got.shape == (1, 24, *size)
    assert torch.equal(got, reference_forward(sd, x, scale, size))


def test_video_is_normalised_by_the_vae_statistics_and_back():
    sd = small_state_dict(2)
    net = build_from_state_dict(sd)
    video = torch.randn(1, 24, 3, 4, 6) * 2 + 0.5
    out = upscale_video(net, video, 6, 9)
    mean = torch.tensor(LATENT_MEAN).view(1, -1, 1, 1, 1)
    std = torch.tensor(LATENT_STD).view(1, -1, 1, 1, 1)
    expected = reference_forward(sd, (video - mean) / std, (6 / 4 + 9 / 6) / 2, (3, 6, 9))
    assert torch.equal(out, expected * std + mean)


class Nested:
    """ComfyUI's NestedTensor as the H3 latent uses it: (video, audio)."""

    is_nested = True

    def __init__(self, tensors):
        self.tensors = tuple(tensors)


def test_latent_keeps_audio_drops_the_mask_and_floors_pixels_to_the_grid():
    net = build_from_state_dict(small_state_dict(3))
    video, audio = torch.randn(1, 24, 3, 4, 6), torch.randn(1, 32, 2, 10)
    latent = {"samples": Nested((video, audio)), "noise_mask": torch.ones(1), "type": "av"}
    out = upscale_latent(net, latent, width=9 * 16 + 15, height=6 * 16 + 15)
    assert isinstance(out["samples"], Nested) and "noise_mask" not in out
    assert out["type"] == "av"
    assert out["samples"].tensors[0].shape == (1, 24, 3, 6, 9)
    assert out["samples"].tensors[1] is audio
    assert torch.equal(out["samples"].tensors[0], upscale_video(net, video, 6, 9))
    same = upscale_latent(net, latent, width=6 * 16, height=4 * 16)
    assert same is latent  # already that size: nothing runs
    plain = upscale_latent(net, {"samples": video}, width=1312 // 8, height=736 // 8)
    assert plain["samples"].shape == (1, 24, 3, 5, 10)


def test_bad_latents_and_sizes_are_refused_with_the_fix():
    net = build_from_state_dict(small_state_dict())
    with pytest.raises(ValueError, match="expected an H3 video latent.*LATENT output"):
        upscale_latent(net, {"samples": torch.zeros(1, 16, 4, 4)}, 64, 64)
    with pytest.raises(ValueError, match="smaller than one latent cell"):
        target_latent_size(8, 736)
    assert target_latent_size(1312, 736) == (46, 82)  # 864x480 -> 54x30 becomes 82x46
