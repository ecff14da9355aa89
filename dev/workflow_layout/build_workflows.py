"""Build the bundled two-pass workflows (t2v, i2v, r2v) and their API-format twins.

    python dev/workflow_layout/build_workflows.py  # rewrites workflows/ (UI and api/)

Each workflow is shaped like the official MiniMax H3 templates: at the top a note, the inputs a
user changes (the prompt, the clip length in seconds, the seed, the image or references), one
subgraph node holding the pipeline, and Save Video. Inside the subgraph, groups show which GPU
runs each stage (blue = helper gpu:0: text encoder, latent upscale, decode; orange = root gpu:1:
the DiT's PASS1 and PASS2), and four "PASSn Width/Height" nodes are the one source of the
sizes (plan and placement, both passes, the upscale). `ui_graph.py` writes the files; the
tests check them against the real node schemas (tests/data/), the real frontend
(tests/browser/) and a real server.

One set of files serves ComfyUI 0.33.0 and the newest files. They are written against the
newest schemas (tests/data/object_info_h3.json) with values 0.33.0 accepts too
(tests/data/object_info_033.json): where 0.33.0 has fewer widgets (CreateVideo: fps, bit_depth;
SaveVideo: filename_prefix, format, codec) its editor fills them from the first saved values
and its server ignores the API inputs it does not declare, so every value the two releases
share is chosen valid on both (CreateVideo bit_depth 8: an INT 8..10 there, an option here;
SaveVideo "auto" for format, format.codec and codec). MiniMaxH3ReferenceToVideo's vae and
audio_vae, required on 0.33.0, are always connected.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # ui_graph.py beside this file; h3_multigpu must be importable

from graph_layout import Layout, columns_of  # noqa: E402
from ui_graph import HELPER, NOTE_TYPE, PLAIN, ROOT, Workflow  # noqa: E402

try:
    from subgraph_columns import COLUMNS  # written by order_search.py
except ImportError:  # order_search.py builds the graphs before subgraph_columns.py exists
    COLUMNS = None

DATA = HERE.parents[1] / "tests" / "data"
OUTPUT = HERE.parents[1] / "workflows"  # the shipped workflows (UI and API format)

DIT_FILE = "minimax_h3_fl2va_pruned_int8_convrot.safetensors"
REF_DIT_FILE = "minimax_h3_ref2va_pruned_int8_convrot.safetensors"
TEXT_ENCODER_FILE = "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors"
VIDEO_VAE_FILE = "minimax_h3_video_vae_int8_convrot.safetensors"
AUDIO_VAE_FILE = "minimax_h3_audio_vae_fp32.safetensors"
TURBO_LORA_FILE = "minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors"
REF_TURBO_LORA_FILE = "minimax_h3_ref2v_turbo_4step_v0.1_comfyui_bf16.safetensors"
UPSCALER_FILE = "minimax_h3_latent_upscaler_3d_conv_v1_fp16.safetensors"
HF = "https://huggingface.co/Comfy-Org/MiniMax-H3/resolve/main"
MODEL_LINKS = {
    DIT_FILE: (f"{HF}/diffusion_models/{DIT_FILE}", "diffusion_models", "19.53 GB"),
    REF_DIT_FILE: (f"{HF}/diffusion_models/{REF_DIT_FILE}", "diffusion_models", "19.53 GB"),
    TEXT_ENCODER_FILE: (f"{HF}/text_encoders/{TEXT_ENCODER_FILE}", "text_encoders", "14.61 GB"),
    VIDEO_VAE_FILE: (f"{HF}/vae/{VIDEO_VAE_FILE}", "vae", "2.62 GB"),
    AUDIO_VAE_FILE: (f"{HF}/vae/{AUDIO_VAE_FILE}", "vae", "0.58 GB"),
    TURBO_LORA_FILE: ("https://huggingface.co/lightx2v/Minimax-h3-Turbo/resolve/main/"
                      f"{TURBO_LORA_FILE}", "loras", "1.82 GB"),
    REF_TURBO_LORA_FILE: (f"{HF}/loras/{REF_TURBO_LORA_FILE}", "loras", "1.82 GB"),
    UPSCALER_FILE: ("https://huggingface.co/LBH-123-AI/Minimax_h3_latent_Upscaler/resolve/main/"
                    f"{UPSCALER_FILE}", "latent_upscale_models", "0.69 GB"),
}

PROMPTS = {
    "t2v": (
        "Cinematic live-action shot at golden hour: a lighthouse keeper climbs the spiral "
        "stairs, opens the lamp room door and looks out over a stormy sea as the beam sweeps "
        "across the waves. Slow push-in, shallow depth of field, natural film grain.\n\n"
        "Audio: wind against the glass, footsteps on iron stairs, distant waves, a low cello "
        "note swelling as the beam turns."),
    "i2v": (
        "The scene opens exactly on the first frame. The camera slowly pushes in while the "
        "light shifts from morning to noon; leaves move in a light breeze and a bird crosses "
        "the frame.\n\nAudio: soft wind, birdsong, a distant church bell."),
    "r2v": (
        "<Picture 1> walks through the night market of <Picture 2>, stops at a noodle stall "
        "and smiles at the cook. Handheld tracking shot, neon reflections on wet stones.\n\n"
        "Audio: market chatter, sizzling woks, light rain on awnings."),
}

# PASS2 is a short re-noise of the upscaled PASS1 result (H3_FACTS section 5): a few steps of
# the "simple" schedule at denoise 0.3. Each PASS2 step costs ~3-5x a PASS1 step (2.3x the
# tokens, attention quadratic in them), so few steps; 0.3 lets the DiT add the detail the
# learned upscaler cannot invent while keeping PASS1's layout, motion and sound.
PASS2_DENOISE = 0.3
PASS1_SIZE = (864, 480)
PASS2_SIZE = (1312, 736)
SECONDS = 5.0
SEED = 42
LOADER_WIDTH = 320  # room for the model files' names
STAGE_WIDTH = 280
VALUE_WIDTH = 240  # the editor widens a node with widgets to 210 at least
# The subgraph's input node as wide as the editor draws it (its slots' labels set it).
IN_WIDTH = {"t2v": 128, "i2v": 128, "r2v": 192}
OUT_WIDTH = 140
STEPS = {"t2v": (8, 4), "i2v": (8, 4), "r2v": (4, 2)}  # 8-step / 4-step turbo LoRAs


def load_schemas() -> dict[str, dict]:
    core = json.loads((DATA / "object_info_h3.json").read_text())["served"]
    pack = json.loads((DATA / "object_info_pack.json").read_text())["served"]
    return {**core, **pack}


def note_text(kind: str, dit: str, lora: str, steps: tuple[int, int]) -> str:
    task = {"t2v": "text to video", "i2v": "image to video (first frame)",
            "r2v": "reference to video (`<Picture 1>`, `<Picture 2>` in the prompt)"}[kind]
    files = [
        ("diffusion_models", dit), ("text_encoders", TEXT_ENCODER_FILE),
        ("vae", VIDEO_VAE_FILE), ("vae", AUDIO_VAE_FILE), ("loras", lora),
        ("latent_upscale_models", UPSCALER_FILE),
    ]
    rows = "\n".join(f"- `models/{folder}/` [{name}]({MODEL_LINKS[name][0]}) "
                     f"({MODEL_LINKS[name][2]})" for folder, name in files)
    return (
        f"## MiniMax H3 two-pass {task} on two GPUs\n\n"
        "Write the **prompt**, set **seconds** (5 / 10 / 12 / 15 s = 124 / 243 / 294 / 362 "
        "frames) and the **seed**, press Run. The video is saved by Save Video.\n\n"
        "**What runs where.** The *H3 Multi-GPU* node inside the subgraph plans the job for "
        "your GPUs and places the parts: the DiT and the sampler on gpu:1 (PASS1 at "
        f"{PASS1_SIZE[0]}x{PASS1_SIZE[1]}, then PASS2 at {PASS2_SIZE[0]}x{PASS2_SIZE[1]}), the "
        "text encoder, the latent upscaler and both VAEs on gpu:0. It shares each attention "
        "call's heads between the GPUs (Dual-Sage, exact), streams DiT blocks from pinned RAM "
        "and chunks PASS2's activations when the plan says so. *GPU Status* shows what it did. "
        "With one GPU everything runs there.\n\n"
        f"**Steps.** PASS1 {steps[0]} steps with the turbo LoRA, PASS2 {steps[1]} steps at "
        f"denoise {PASS2_DENOISE} (open the subgraph to change sizes and steps: the PASS1/PASS2 "
        "Width, Height and Steps nodes feed every node that needs them).\n\n"
        "**Needs** a ComfyUI with the MiniMax H3 nodes (ComfyUI#15224 or newer) and this pack. "
        "The latent upscale is the pack's own *H3 Latent Upscale*, so core's "
        "MiniMaxH3LatentUpscaleWithModel is not needed.\n\n"
        f"**Model files**\n\n{rows}\n"
    )


class H3Workflow(Workflow):
    def model_links(self, node) -> list[dict]:
        return [{"name": v, "url": MODEL_LINKS[v][0], "directory": MODEL_LINKS[v][1]}
                for v in node.values.values() if isinstance(v, str) and v in MODEL_LINKS]


def two_pass(kind: str) -> Workflow:
    """kind: t2v (text), i2v (first frame) or r2v (two reference pictures)."""
    wf = H3Workflow(f"h3_multigpu_two_pass_{kind}", load_schemas())
    dit_file, lora_file = (REF_DIT_FILE, REF_TURBO_LORA_FILE) if kind == "r2v" else (
        DIT_FILE, TURBO_LORA_FILE)
    steps1, steps2 = STEPS[kind]
    top = wf.root
    title = {"t2v": "H3 two-pass text to video (multi-GPU)",
             "i2v": "H3 two-pass image to video (multi-GPU)",
             "r2v": "H3 two-pass reference to video (multi-GPU)"}[kind]
    sub = wf.subgraph(title, input_pos=(0, 0), output_pos=(0, 0))

    # Promoted inputs (widgets on the subgraph node) and sockets from the top level.
    prompt_in = sub.promote("prompt", "STRING", PROMPTS[kind])
    seconds_in = sub.promote("seconds", "FLOAT", SECONDS)
    seed_in = sub.promote("seed", "INT", SEED)
    images_in = []
    if kind == "i2v":
        images_in.append(sub.socket("first_frame", "IMAGE"))
    if kind == "r2v":
        images_in += [sub.socket("reference_1", "IMAGE", "reference 1 (<Picture 1>)"),
                      sub.socket("reference_2", "IMAGE", "reference 2 (<Picture 2>)")]

    # Top level: note, images, the pipeline, the outputs (ids 1..5).
    top.add(NOTE_TYPE, "Read me: two-pass H3 on two GPUs", (0, 0), box=(460, 640),
            text=note_text(kind, dit_file, lora_file, (steps1, steps2)))
    x = 500
    sockets = {}
    if kind == "i2v":
        first = top.add("LoadImage", "First Frame", (x, 0), box=(320, 360),
                        image="example.png")
        sockets["first_frame"] = first.ref("IMAGE")
        x += 360
    if kind == "r2v":
        for index, name in enumerate(("reference_1", "reference_2")):
            ref = top.add("LoadImage", f"Reference {index + 1}", (x, index * 380),
                          box=(320, 350), image="example.png")
            sockets[name] = ref.ref("IMAGE")
        x += 360
    pipeline = top.add(sub, title, (x, 0), box=(440, 560),
                       **{i.name: i.value for i in sub.inputs if i.widget}, **sockets)
    top.add("SaveVideo", "Save Video", (x + 560, 0), box=(420, 560),
            video=pipeline.ref("VIDEO"), filename_prefix=f"video/H3_MultiGPU_{kind}",
            format="auto", **{"format.codec": "auto"}, codec="auto")  # valid on both releases
    top.add("H3MultiGPUShowText", "GPU Status", (x + 560, 620), box=(420, 300),
            text=pipeline.ref("status"))

    # The pipeline, in the order the ids are handed out (the API twin names nodes by id).
    # Positions come from the layout below.
    def add(type_: str, title: str, box_width: float, role: str = PLAIN,
            box_height: float | None = None, **values):
        return sub.add(type_, title, (0, 0), role, box=(box_width, box_height), **values)

    dit = add("UNETLoader", "Diffusion Model", LOADER_WIDTH, unet_name=dit_file,
              weight_dtype="default")
    lora = add("LoraLoaderModelOnly", "Turbo LoRA", LOADER_WIDTH, model=dit.ref("MODEL"),
               lora_name=lora_file, strength_model=1.0)
    clip = add("CLIPLoader", "Text Encoder", LOADER_WIDTH, clip_name=TEXT_ENCODER_FILE,
               type="minimax", device="default")
    vae = add("VAELoader", "Video VAE", LOADER_WIDTH, vae_name=VIDEO_VAE_FILE)
    avae = add("VAELoader", "Audio VAE", LOADER_WIDTH, vae_name=AUDIO_VAE_FILE)
    up = add("H3MultiGPULatentUpscalerLoader", "Latent Upscaler", LOADER_WIDTH,
             upscaler_name=UPSCALER_FILE)
    # One source for the sizes and the length, each beside the stage that uses it; the
    # placement node reads them too (plan and placement), over wires that run back under the
    # pipeline.
    p2w = add("PrimitiveInt", "PASS2 Width", VALUE_WIDTH, value=PASS2_SIZE[0])
    p2h = add("PrimitiveInt", "PASS2 Height", VALUE_WIDTH, value=PASS2_SIZE[1])
    p1w = add("PrimitiveInt", "PASS1 Width", VALUE_WIDTH, value=PASS1_SIZE[0])
    p1h = add("PrimitiveInt", "PASS1 Height", VALUE_WIDTH, value=PASS1_SIZE[1])
    seconds = add("H3MultiGPUSeconds", "Seconds", VALUE_WIDTH, seconds=seconds_in)
    # Plan and placement (the drop-in plans by itself from the sizes it is given).
    place = add("H3MultiGPU", "Multi-GPU Placement", 400,
                model=lora.ref("MODEL"), clip=clip.ref("CLIP"), vae=vae.ref("VAE"),
                audio_vae=avae.ref("VAE"), latent_upscale_model=up.ref("latent_upscale_model"),
                pass2_width=p2w.ref("INT"), pass2_height=p2h.ref("INT"),
                pass1_width=p1w.ref("INT"), pass1_height=p1h.ref("INT"),
                seconds=seconds.ref("seconds"), devices="auto", lora_rank=128)
    prompt = add("PrimitiveStringMultiline", "Prompt", VALUE_WIDTH, box_height=200,
                 value=prompt_in)
    common = dict(clip=place.ref("clip"), vae=place.ref("vae"), prompt=prompt.ref("STRING"),
                  width=p1w.ref("INT"), height=p1h.ref("INT"), length=seconds.ref("frames"))
    if kind == "r2v":
        cond = add("MiniMaxH3ReferenceToVideo", "PASS1 Conditioning", STAGE_WIDTH, HELPER,
                   audio_vae=place.ref("audio_vae"), ref_image_size="match",
                   **{"ref_images.ref_image_0": images_in[0],
                      "ref_images.ref_image_1": images_in[1]}, **common)
    else:
        extra = {"first_frame": images_in[0]} if kind == "i2v" else {}
        cond = add("MiniMaxH3ImageToVideo", "PASS1 Conditioning", STAGE_WIDTH, HELPER,
                   **extra, **common)
    seed = add("PrimitiveInt", "Seed", VALUE_WIDTH, value=seed_in)
    s1 = add("PrimitiveInt", "PASS1 Steps", VALUE_WIDTH, value=steps1)
    release = add("H3MultiGPUReleaseCLIP", "Release Text Encoder", STAGE_WIDTH, HELPER,
                  conditioning=cond.ref("positive"), clip=place.ref("clip"),
                  release="auto", plan=place.ref("plan"))
    # PASS1 on the root: noise, guider, sampler and schedule feed the sampler on their right.
    noise1 = add("RandomNoise", "PASS1 Noise", STAGE_WIDTH, ROOT, noise_seed=seed.ref("INT"))
    guider = add("BasicGuider", "Guider", STAGE_WIDTH, ROOT, model=place.ref("model"),
                 conditioning=release.ref("conditioning"))
    sampler = add("KSamplerSelect", "Sampler", STAGE_WIDTH, ROOT, sampler_name="res_multistep")
    sched1 = add("BasicScheduler", "PASS1 Schedule", STAGE_WIDTH, ROOT,
                 model=place.ref("model"), scheduler="simple", steps=s1.ref("INT"), denoise=1.0)
    pass1 = add("SamplerCustomAdvanced", "PASS1 Sampler", STAGE_WIDTH, ROOT,
                noise=noise1.ref("NOISE"), guider=guider.ref("GUIDER"),
                sampler=sampler.ref("SAMPLER"), sigmas=sched1.ref("SIGMAS"),
                latent_image=cond.ref("LATENT"))
    # The learned latent upscale on the helper (pixels, not a 1.5x factor).
    upscale = add("H3MultiGPULatentUpscale", "Latent Upscale", STAGE_WIDTH, HELPER,
                  model=place.ref("latent_upscale_model"), samples=pass1.ref("output"),
                  width=p2w.ref("INT"), height=p2h.ref("INT"))
    upscale_group = [upscale]
    s2 = add("PrimitiveInt", "PASS2 Steps", VALUE_WIDTH, value=steps2)
    guider2 = guider
    if kind == "i2v":
        keys = add("H3MultiGPUKeyframesToSize", "PASS2 Keyframes", STAGE_WIDTH, HELPER,
                   positive=release.ref("conditioning"), vae=place.ref("vae"),
                   latent=upscale.ref("LATENT"), first_frame=images_in[0])
        upscale_group.append(keys)
    # PASS2 refinement on the root.
    noise2 = add("RandomNoise", "PASS2 Noise", STAGE_WIDTH, ROOT, noise_seed=seed.ref("INT"))
    if kind == "i2v":
        guider2 = add("BasicGuider", "PASS2 Guider", STAGE_WIDTH, ROOT,
                      model=place.ref("model"), conditioning=keys.ref("positive"))
    sched2 = add("BasicScheduler", "PASS2 Schedule", STAGE_WIDTH, ROOT,
                 model=place.ref("model"), scheduler="simple", steps=s2.ref("INT"),
                 denoise=PASS2_DENOISE)
    pass2 = add("SamplerCustomAdvanced", "PASS2 Sampler", STAGE_WIDTH, ROOT,
                noise=noise2.ref("NOISE"), guider=guider2.ref("GUIDER"),
                sampler=sampler.ref("SAMPLER"), sigmas=sched2.ref("SIGMAS"),
                latent_image=upscale.ref("LATENT"))
    # Decode on the helper, then the video.
    dec = add("VAEDecode", "Decode Video", STAGE_WIDTH, HELPER, samples=pass2.ref("output"),
              vae=place.ref("vae"))
    adec = add("VAEDecodeAudio", "Decode Audio", STAGE_WIDTH, HELPER,
               samples=pass2.ref("output"), vae=place.ref("audio_vae"))
    # Values valid on both releases (see the module docstring): 0.33.0's CreateVideo takes
    # bit_depth as an INT 8..10 and has no color_space/codec (its server ignores them, its
    # editor keeps the first two widget values), the newest offers 8 beside "auto" (= 8 for
    # sRGB). The official templates write [24, 8].
    video = add("CreateVideo", "Create Video", STAGE_WIDTH, images=dec.ref("IMAGE"),
                audio=adec.ref("AUDIO"), fps=24.0, bit_depth=8, color_space="sRGB",
                codec="none")
    sub.output("VIDEO", "VIDEO", video.ref("VIDEO"))
    sub.output("status", "STRING", place.ref("status"))

    # Groups: which GPU runs each stage (blue: the helper, orange: the root), and the values
    # beside the stage that uses them.
    sub.group("model files", PLAIN, [dit, lora, clip, vae, avae, up])
    sub.group("plan + placement on the GPUs", PLAIN, [place])
    sub.group("prompt, PASS1 size and length", PLAIN, [prompt, p1w, p1h, seconds])
    sub.group("gpu:0 text encoder, then released", HELPER, [cond, release])
    sub.group("seed and PASS1 steps", PLAIN, [seed, s1])
    sub.group(f"gpu:1 PASS1 {PASS1_SIZE[0]}x{PASS1_SIZE[1]}", ROOT,
              [noise1, guider, sampler, sched1, pass1])
    sub.group("PASS2 size", PLAIN, [p2w, p2h])
    sub.group(f"gpu:0 latent upscale to {PASS2_SIZE[0]}x{PASS2_SIZE[1]}", HELPER, upscale_group)
    sub.group("PASS2 steps", PLAIN, [s2])
    sub.group(f"gpu:1 PASS2 {PASS2_SIZE[0]}x{PASS2_SIZE[1]}", ROOT,
              [noise2, sched2, pass2] + ([guider2] if kind == "i2v" else []))
    sub.group("gpu:0 decode", HELPER, [dec, adec])
    sub.group("the video", PLAIN, [video])
    if COLUMNS is not None:
        Layout(wf, sub, columns_of(sub, COLUMNS[kind]),
               io_widths=(IN_WIDTH[kind], OUT_WIDTH)).apply()

    wf.extra = {"ds": {"scale": 0.8, "offset": [40, 60]}, "frontendVersion": "1.58.1"}
    return wf


WORKFLOWS = {f"h3_multigpu_two_pass_{kind}": kind for kind in ("t2v", "i2v", "r2v")}


def build_all() -> dict[str, tuple[dict, dict]]:
    """{name: (ui, api)} for every bundled workflow."""
    out = {}
    for name, kind in WORKFLOWS.items():
        wf = two_pass(kind)
        out[name] = (wf.ui(), wf.api())
    return out


def dump_ui(data: dict) -> str:
    return json.dumps(data, indent=1, ensure_ascii=False) + "\n"


def dump_api(data: dict) -> str:
    """The API twin as `h3-multigpu submit --check` prints it."""
    return json.dumps(data, indent=2) + "\n"


def main() -> None:
    (OUTPUT / "api").mkdir(exist_ok=True)
    for name, (ui, api) in build_all().items():
        (OUTPUT / f"{name}.json").write_text(dump_ui(ui))
        (OUTPUT / "api" / f"{name}.json").write_text(dump_api(api))
        print(f"wrote workflows/{name}.json and workflows/api/{name}.json")


if __name__ == "__main__":
    main()
