"""Build the bundled two-pass workflows (UI format 0.4, flat) and their API-format twins.

    python workflows/build_workflows.py          # rewrite workflows/*.json and workflows/api/*.json

One description of each graph produces both files, so they cannot disagree; the tests check
the written files against this builder and against the pinned node schemas in tests/data/.
ComfyUI lists a custom node pack's `workflows/` folder (top level *.json only) as templates;
`workflows/api/` is for scripts and the submission client.

Colours and groups mark which GPU each node works on: blue = helper gpu:0 (text encoder,
upscaler, VAE decode), orange = root gpu:1 (DiT sampling), grey = plumbing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

try:  # inside the package (tests) or run as a script from the repository
    from h3_multigpu.geometry import FPS, snap_frames
except ImportError:  # pragma: no cover - plain checkout without the editable install
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from geometry import FPS, snap_frames

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "tests" / "data"

DIT_FILE = "minimax_h3_fl2va_pruned_int8_convrot.safetensors"
TEXT_ENCODER_FILE = "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors"
VIDEO_VAE_FILE = "minimax_h3_video_vae_int8_convrot.safetensors"
AUDIO_VAE_FILE = "minimax_h3_audio_vae_fp32.safetensors"
TURBO_LORA_FILE = "minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors"
UPSCALER_FILE = "minimax_h3_latent_upscaler_3d_conv_v1_fp16.safetensors"
HF = "https://huggingface.co/Comfy-Org/MiniMax-H3/resolve/main"
MODEL_LINKS = {
    DIT_FILE: (f"{HF}/diffusion_models/{DIT_FILE}", "diffusion_models"),
    TEXT_ENCODER_FILE: (f"{HF}/text_encoders/{TEXT_ENCODER_FILE}", "text_encoders"),
    VIDEO_VAE_FILE: (f"{HF}/vae/{VIDEO_VAE_FILE}", "vae"),
    AUDIO_VAE_FILE: (f"{HF}/vae/{AUDIO_VAE_FILE}", "vae"),
    TURBO_LORA_FILE: ("https://huggingface.co/lightx2v/Minimax-h3-Turbo/resolve/main/"
                      f"{TURBO_LORA_FILE}", "loras"),
}

PROMPT = (
    "Cinematic live-action shot at golden hour: a lighthouse keeper climbs the spiral stairs, "
    "opens the lamp room door and looks out over a stormy sea as the beam sweeps across the "
    "waves. Slow push-in, shallow depth of field, natural film grain.\n\n"
    "Audio: wind against the glass, footsteps on iron stairs, distant waves, a low cello "
    "note swelling as the beam turns."
)

# PASS2 is a short re-noise of the upscaled PASS1 result (H3_FACTS section 5): 4 steps of the
# "simple" schedule at denoise 0.3. Each PASS2 step costs ~3-5x a PASS1 step (2.3x the tokens,
# attention quadratic in them), so few steps; 0.3 lets the DiT add the detail the learned
# upscaler cannot invent while keeping PASS1's layout, motion and sound. Denoise is a fraction
# of the schedule: with H3's video shift of 12 the first PASS2 sigma is ~0.84.
PASS2_DENOISE = 0.3

HELPER, ROOT, PLAIN = "helper", "root", "plain"
COLORS = {HELPER: ("#223b5a", "#335a88"), ROOT: ("#5a3a1c", "#88582b"), PLAIN: (None, None)}
COLUMN = 470
ROW = 112
PACK_CNR = "comfyui-h3-multigpu"


def load_schemas() -> dict[str, dict]:
    core = json.loads((DATA / "core_node_schemas.json").read_text())["nodes"]
    pack = json.loads((DATA / "pack_node_schemas.json").read_text())["nodes"]
    return {**core, **pack}


@dataclass
class Node:
    id: int
    type: str
    title: str
    col: float
    row: float
    role: str
    values: dict  # input name -> literal widget value or (Node, output name)
    order: int = 0
    out_links: dict = field(default_factory=dict)  # output slot -> [link ids]


class Graph:
    def __init__(self, name: str, schemas: dict[str, dict]):
        self.name = name
        self.schemas = schemas
        self.nodes: list[Node] = []
        self.links: list[list] = []  # [id, from, from_slot, to, to_slot, type]
        self.groups: list[dict] = []

    def add(self, type_: str, title: str, col: float, row: float, role: str = PLAIN,
            **values) -> Node:
        schema = self.schemas[type_]
        names = {i["name"] for i in schema["inputs"]}
        unknown = set(values) - names
        assert not unknown, f"{type_} has no inputs {unknown}"
        node = Node(len(self.nodes) + 1, type_, title, col, row, role, values)
        self.nodes.append(node)
        return node

    def group(self, title: str, role: str, nodes: list[Node]) -> None:
        self.groups.append({"title": title, "role": role, "nodes": [n.id for n in nodes]})

    # ------------------------------------------------------------------ geometry
    def _size(self, node: Node) -> list[int]:
        schema = self.schemas[node.type]
        rows = max(len(schema["outputs"]), sum(1 for i in schema["inputs"] if not i.get("widget")))
        rows += sum(1 for i in schema["inputs"] if i.get("widget"))
        tall = 180 if node.type in ("PrimitiveStringMultiline",) else 0
        return [380, 46 + 24 * rows + tall]

    def _pos(self, node: Node) -> list[int]:
        return [int(node.col * COLUMN), int(node.row * ROW)]

    # ------------------------------------------------------------------ outputs
    def _resolve(self):
        """Assign link ids and execution order (a topological order of the nodes)."""
        self.links = []
        incoming: dict[int, list] = {}
        for node in self.nodes:
            node.out_links = {}
        for node in self.nodes:
            schema = self.schemas[node.type]
            for slot, spec in enumerate(schema["inputs"]):
                value = node.values.get(spec["name"])
                if isinstance(value, tuple):
                    src, out_name = value
                    outs = [o["name"] for o in self.schemas[src.type]["outputs"]]
                    out_slot = outs.index(out_name)
                    link_id = len(self.links) + 1
                    out_type = self.schemas[src.type]["outputs"][out_slot]["type"]
                    self.links.append([link_id, src.id, out_slot, node.id, slot, out_type])
                    src.out_links.setdefault(out_slot, []).append(link_id)
                    incoming.setdefault(node.id, []).append(src.id)
        done: list[int] = []
        while len(done) < len(self.nodes):
            for node in self.nodes:
                if node.id not in done and all(s in done for s in incoming.get(node.id, [])):
                    node.order = len(done)
                    done.append(node.id)

    def _widget_values(self, node: Node) -> list:
        values = []
        for spec in self.schemas[node.type]["inputs"]:
            if not spec.get("widget"):
                continue
            value = node.values.get(spec["name"], spec.get("default"))
            if isinstance(value, tuple):  # linked widget: the frontend still stores a value
                value = self._literal(*value, default=spec.get("default"))
            values.append(value)
            if "ui_extra" in spec:
                values.append(spec["ui_extra"])
        return values

    @staticmethod
    def _literal(src: Node, out_name: str, default=None):
        """The value a linked widget will receive, when its source is a constant."""
        if src.type.startswith("Primitive"):
            return src.values.get("value", default)
        if src.type == "H3MultiGPUSeconds":
            frames = snap_frames(src.values["seconds"])
            return frames if out_name == "frames" else frames / FPS
        return default

    def ui(self) -> dict:
        self._resolve()
        link_of = {(link[3], link[4]): link[0] for link in self.links}
        nodes = []
        for node in self.nodes:
            schema = self.schemas[node.type]
            sockets, widgets = [], []
            for slot, spec in enumerate(schema["inputs"]):
                link = link_of.get((node.id, slot))
                entry = {"name": spec["name"], "type": spec["type"], "link": link}
                if spec.get("optional"):
                    entry["shape"] = 7
                if spec.get("widget"):
                    if link is not None:
                        entry["widget"] = {"name": spec["name"]}
                        widgets.append(entry)
                else:
                    sockets.append(entry)
            outputs = [{"name": o["name"], "type": o["type"],
                        "links": node.out_links.get(i) or None, "slot_index": i}
                       for i, o in enumerate(schema["outputs"])]
            cnr = PACK_CNR if node.type.startswith("H3MultiGPU") else "comfy-core"
            properties = {"cnr_id": cnr, "Node name for S&R": node.type}
            models = [{"name": v, "url": MODEL_LINKS[v][0], "directory": MODEL_LINKS[v][1]}
                      for v in node.values.values() if isinstance(v, str) and v in MODEL_LINKS]
            if models:
                properties["models"] = models
            entry = {
                "id": node.id, "type": node.type, "pos": self._pos(node),
                "size": self._size(node), "flags": {}, "order": node.order, "mode": 0,
                "inputs": sockets + widgets, "outputs": outputs, "title": node.title,
                "properties": properties, "widgets_values": self._widget_values(node),
            }
            color, bgcolor = COLORS[node.role]
            if color:
                entry["color"], entry["bgcolor"] = color, bgcolor
            nodes.append(entry)
        return {
            "id": f"h3-multigpu-{self.name}",
            "revision": 0,
            "last_node_id": len(self.nodes),
            "last_link_id": len(self.links),
            "nodes": nodes,
            "links": self.links,
            "groups": self._ui_groups(),
            "config": {},
            "extra": {"ds": {"scale": 0.55, "offset": [80, 80]}},
            "version": 0.4,
        }

    def _ui_groups(self) -> list[dict]:
        out = []
        by_id = {n.id: n for n in self.nodes}
        for i, group in enumerate(self.groups, start=1):
            members = [by_id[n] for n in group["nodes"]]
            x0 = min(self._pos(n)[0] for n in members) - 20
            y0 = min(self._pos(n)[1] for n in members) - 60
            x1 = max(self._pos(n)[0] + self._size(n)[0] for n in members) + 20
            y1 = max(self._pos(n)[1] + self._size(n)[1] for n in members) + 20
            out.append({"id": i, "title": group["title"], "bounding": [x0, y0, x1 - x0, y1 - y0],
                        "color": COLORS[group["role"]][1] or "#444444", "flags": {}})
        return out

    def api(self) -> dict:
        out = {}
        for node in self.nodes:
            inputs = {}
            for spec in self.schemas[node.type]["inputs"]:
                name = spec["name"]
                if name not in node.values and not spec.get("widget"):
                    continue  # an optional socket left unconnected
                value = node.values.get(name, spec.get("default"))
                if isinstance(value, tuple):
                    src, out_name = value
                    outs = [o["name"] for o in self.schemas[src.type]["outputs"]]
                    value = [str(src.id), outs.index(out_name)]
                if value is None:
                    continue  # an optional widget without a value
                inputs[name] = value
            out[str(node.id)] = {"class_type": node.type, "inputs": inputs,
                                 "_meta": {"title": node.title}}
        return out


def two_pass(name: str, image_to_video: bool) -> Graph:
    g = Graph(name, load_schemas())
    # Column 0: model files.
    dit = g.add("UNETLoader", "Diffusion Model", 0, 0, unet_name=DIT_FILE, weight_dtype="default")
    lora = g.add("LoraLoaderModelOnly", "Turbo LoRA", 0, 2, model=(dit, "MODEL"),
                 lora_name=TURBO_LORA_FILE, strength_model=1.0)
    clip = g.add("CLIPLoader", "Text Encoder", 0, 4, clip_name=TEXT_ENCODER_FILE,
                 type="minimax", device="default")
    vae = g.add("VAELoader", "Video VAE", 0, 6, vae_name=VIDEO_VAE_FILE)
    avae = g.add("VAELoader", "Audio VAE", 0, 7.5, vae_name=AUDIO_VAE_FILE)
    up = g.add("LatentUpscaleModelLoader", "Latent Upscaler", 0, 9, model_name=UPSCALER_FILE)
    # Column 1: the job's parameters (titles are what the submission client patches).
    prompt = g.add("PrimitiveStringMultiline", "Prompt", 1, 0, value=PROMPT)
    seconds = g.add("H3MultiGPUSeconds", "Seconds", 1, 4.5, seconds=5.0)
    p1w = g.add("PrimitiveInt", "PASS1 Width", 1, 6, value=864)
    p1h = g.add("PrimitiveInt", "PASS1 Height", 1, 7, value=480)
    p2w = g.add("PrimitiveInt", "PASS2 Width", 1, 8, value=1312)
    p2h = g.add("PrimitiveInt", "PASS2 Height", 1, 9, value=736)
    s1 = g.add("PrimitiveInt", "PASS1 Steps", 1, 10, value=8)
    s2 = g.add("PrimitiveInt", "PASS2 Steps", 1, 11, value=4)
    seed = g.add("PrimitiveInt", "Seed", 1, 12, value=42)
    # Column 2: plan and placement.
    plan = g.add("H3MultiGPUPlan", "Multi-GPU Plan", 2, 0, pass2_width=(p2w, "INT"),
                 pass2_height=(p2h, "INT"), pass1_width=(p1w, "INT"),
                 pass1_height=(p1h, "INT"), seconds=(seconds, "seconds"), devices="auto",
                 lora_rank=128)
    place = g.add("H3MultiGPU", "Multi-GPU Placement", 2, 3.5, model=(lora, "MODEL"),
                  clip=(clip, "CLIP"), vae=(vae, "VAE"), audio_vae=(avae, "VAE"),
                  latent_upscale_model=(up, "LATENT_UPSCALE_MODEL"), plan=(plan, "plan"))
    show = g.add("H3MultiGPUShowText", "GPU Status", 2, 9.5, text=(place, "status"))
    # Column 3: text encoding on the helper, then released.
    first = None
    cond_inputs = dict(clip=(place, "clip"), vae=(place, "vae"), prompt=(prompt, "STRING"),
                       width=(p1w, "INT"), height=(p1h, "INT"), length=(seconds, "frames"))
    if image_to_video:
        first = g.add("LoadImage", "First Frame", 3, 7.5, HELPER, image="example.png")
        cond_inputs["first_frame"] = (first, "IMAGE")
    cond = g.add("MiniMaxH3ImageToVideo", "PASS1 Conditioning", 3, 0, HELPER, **cond_inputs)
    release = g.add("H3MultiGPUReleaseCLIP", "Release Text Encoder", 3, 4, HELPER,
                    conditioning=(cond, "positive"), clip=(place, "clip"), release="auto",
                    plan=(plan, "plan"))
    # Column 4: PASS1 on the root.
    sampler = g.add("KSamplerSelect", "Sampler", 4, 0, ROOT, sampler_name="res_multistep")
    guider = g.add("BasicGuider", "Guider", 4, 1.5, ROOT, model=(place, "model"),
                   conditioning=(release, "conditioning"))
    sched1 = g.add("BasicScheduler", "PASS1 Schedule", 4, 3, ROOT, model=(place, "model"),
                   scheduler="simple", steps=(s1, "INT"), denoise=1.0)
    noise1 = g.add("RandomNoise", "PASS1 Noise", 4, 5, ROOT, noise_seed=(seed, "INT"))
    pass1 = g.add("SamplerCustomAdvanced", "PASS1 Sampler", 4, 6.5, ROOT,
                  noise=(noise1, "NOISE"), guider=(guider, "GUIDER"),
                  sampler=(sampler, "SAMPLER"), sigmas=(sched1, "SIGMAS"),
                  latent_image=(cond, "LATENT"))
    # Column 5: learned latent upscale on the helper (pixels, not a 1.5x factor).
    upscale = g.add("MiniMaxH3LatentUpscaleWithModel", "Latent Upscale", 5, 0, HELPER,
                    model=(place, "latent_upscale_model"), samples=(pass1, "output"),
                    width=(p2w, "INT"), height=(p2h, "INT"))
    guider2 = guider
    helper_nodes = [upscale]
    if image_to_video:
        keys = g.add("H3MultiGPUKeyframesToSize", "PASS2 Keyframes", 5, 3, HELPER,
                     positive=(release, "conditioning"), vae=(place, "vae"),
                     latent=(upscale, "LATENT"), first_frame=(first, "IMAGE"))
        helper_nodes.append(keys)
        guider2 = g.add("BasicGuider", "PASS2 Guider", 6, 1.5, ROOT, model=(place, "model"),
                        conditioning=(keys, "positive"))
    # Column 6: PASS2 refinement on the root.
    sched2 = g.add("BasicScheduler", "PASS2 Schedule", 6, 3, ROOT, model=(place, "model"),
                   scheduler="simple", steps=(s2, "INT"), denoise=PASS2_DENOISE)
    noise2 = g.add("RandomNoise", "PASS2 Noise", 6, 5, ROOT, noise_seed=(seed, "INT"))
    pass2 = g.add("SamplerCustomAdvanced", "PASS2 Sampler", 6, 6.5, ROOT,
                  noise=(noise2, "NOISE"), guider=(guider2, "GUIDER"),
                  sampler=(sampler, "SAMPLER"), sigmas=(sched2, "SIGMAS"),
                  latent_image=(upscale, "LATENT"))
    # Column 7: decode on the helper, save.
    dec = g.add("VAEDecode", "Decode Video", 7, 0, HELPER, samples=(pass2, "output"),
                vae=(place, "vae"))
    adec = g.add("VAEDecodeAudio", "Decode Audio", 7, 1.5, HELPER, samples=(pass2, "output"),
                 vae=(place, "audio_vae"))
    video = g.add("CreateVideo", "Create Video", 7, 3, images=(dec, "IMAGE"),
                  audio=(adec, "AUDIO"), fps=24.0)
    g.add("SaveVideo", "Save Video", 7, 4.5, video=(video, "VIDEO"),
          filename_prefix=f"video/H3_MultiGPU_{name}", format="auto",
          **{"format.codec": "auto"})
    g.group("gpu:0 text encoder, then released", HELPER,
            [cond, release] + ([first] if first else []))
    g.group("gpu:1 PASS1 864x480", ROOT, [sampler, guider, sched1, noise1, pass1])
    g.group("gpu:0 latent upscale", HELPER, helper_nodes)
    g.group("gpu:1 PASS2 1312x736", ROOT,
            [sched2, noise2, pass2] + ([guider2] if image_to_video else []))
    g.group("gpu:0 decode", HELPER, [dec, adec])
    g.group("plan + placement", PLAIN, [plan, place, show])
    return g


WORKFLOWS = {
    "h3_multigpu_two_pass_t2v": lambda: two_pass("t2v", image_to_video=False),
    "h3_multigpu_two_pass_i2v": lambda: two_pass("i2v", image_to_video=True),
}


def build_all() -> dict[str, tuple[dict, dict]]:
    """{name: (ui, api)} for every bundled workflow."""
    out = {}
    for name, make in WORKFLOWS.items():
        graph = make()
        out[name] = (graph.ui(), graph.api())
    return out


def dump(data: dict) -> str:
    return json.dumps(data, indent=1, ensure_ascii=False) + "\n"


def main() -> None:
    (HERE / "api").mkdir(exist_ok=True)
    for name, (ui, api) in build_all().items():
        (HERE / f"{name}.json").write_text(dump(ui))
        (HERE / "api" / f"{name}.json").write_text(dump(api))
        print(f"wrote workflows/{name}.json and workflows/api/{name}.json")


if __name__ == "__main__":
    main()
