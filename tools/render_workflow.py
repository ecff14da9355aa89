"""Draw a UI-format workflow as a PNG: groups, titled nodes and links, coloured by GPU.

    python tools/render_workflow.py workflows/h3_multigpu_two_pass_t2v.json \
        docs/images/two_pass_t2v.png

Reads only the workflow JSON (node positions, sizes, titles, colours, groups, links), so the
picture always shows the graph that ships. Needs Pillow (`pip install pillow`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

MARGIN = 40
SCALE = 0.6  # workflow units -> pixels
BACKGROUND = "#1e1e1e"
DEFAULT_NODE = ("#3a3a3a", "#2b2b2b")
LINK_COLORS = {"MODEL": "#b39ddb", "CLIP": "#ffd54f", "VAE": "#ef9a9a", "LATENT": "#f48fb1",
               "CONDITIONING": "#ffab40", "INT": "#80cbc4", "STRING": "#a5d6a7",
               "H3_PLAN": "#4fc3f7", "LATENT_UPSCALE_MODEL": "#ce93d8", "IMAGE": "#64b5f6",
               "AUDIO": "#81c784"}
FONT_DIRS = ("/usr/share/fonts/truetype/dejavu", "/usr/share/fonts/TTF", "/Library/Fonts")


def _font(size: int, bold: bool = False):
    name = "DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf"
    for folder in FONT_DIRS:
        path = Path(folder) / name
        if path.exists():
            return ImageFont.truetype(str(path), size)
    return ImageFont.load_default()


def render(workflow: dict, title: str | None = None) -> Image.Image:
    nodes = {n["id"]: n for n in workflow["nodes"]}
    boxes = [(n["pos"][0], n["pos"][1], n["pos"][0] + n["size"][0], n["pos"][1] + n["size"][1])
             for n in nodes.values()]
    boxes += [(g["bounding"][0], g["bounding"][1], g["bounding"][0] + g["bounding"][2],
               g["bounding"][1] + g["bounding"][3]) for g in workflow.get("groups", [])]
    x0, y0 = min(b[0] for b in boxes), min(b[1] for b in boxes)
    x1, y1 = max(b[2] for b in boxes), max(b[3] for b in boxes)
    top = 50 if title else 0

    def px(x: float, y: float) -> tuple[int, int]:
        return (int((x - x0) * SCALE) + MARGIN, int((y - y0) * SCALE) + MARGIN + top)

    width, height = px(x1, y1)
    image = Image.new("RGB", (width + MARGIN, height + MARGIN), BACKGROUND)
    draw = ImageDraw.Draw(image)
    small, bold, big = _font(12), _font(14, bold=True), _font(22, bold=True)
    if title:
        draw.text((MARGIN, 14), title, fill="#eeeeee", font=big)

    for group in workflow.get("groups", []):
        gx, gy, gw, gh = group["bounding"]
        a, b = px(gx, gy), px(gx + gw, gy + gh)
        draw.rectangle([a, b], outline=group.get("color", "#555555"), width=2)
        draw.text((a[0] + 6, a[1] + 6), group["title"], fill=group.get("color", "#aaaaaa"),
                  font=bold)

    def slot_y(node: dict, index: int) -> int:
        return px(0, node["pos"][1] + 46 + 24 * index)[1]

    for _, src, src_slot, dst, dst_slot, kind in workflow["links"]:
        a, b = nodes[src], nodes[dst]
        start = (px(a["pos"][0] + a["size"][0], 0)[0], slot_y(a, src_slot))
        end = (px(b["pos"][0], 0)[0], slot_y(b, _input_row(b, dst_slot)))
        mid = (start[0] + end[0]) // 2
        draw.line([start, (mid, start[1]), (mid, end[1]), end],
                  fill=LINK_COLORS.get(kind, "#9e9e9e"), width=2)

    for node in nodes.values():
        a = px(*node["pos"])
        b = px(node["pos"][0] + node["size"][0], node["pos"][1] + node["size"][1])
        color = node.get("color", DEFAULT_NODE[0])
        draw.rectangle([a, b], fill=node.get("bgcolor", DEFAULT_NODE[1]), outline=color, width=2)
        draw.rectangle([a, (b[0], a[1] + 22)], fill=color)
        draw.text((a[0] + 6, a[1] + 4), node.get("title", node["type"]), fill="#ffffff",
                  font=bold)
        draw.text((a[0] + 6, a[1] + 27), node["type"], fill="#bdbdbd", font=small)
        shown = _widget_summary(node)
        if shown:
            draw.text((a[0] + 6, a[1] + 42), shown, fill="#e0e0e0", font=small)
    return image


def _input_row(node: dict, slot: int) -> int:
    """Row of input `slot` on the drawn node (link targets land on their input's row)."""
    return min(slot, max(0, int(node["size"][1] - 46) // 24 - 1))


def _widget_summary(node: dict, limit: int = 34) -> str:
    values = [v for v in node.get("widgets_values", []) if v not in ("fixed", "image")]
    text = ", ".join(str(v) for v in values[:3])
    text = text.replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workflow", type=Path)
    parser.add_argument("png", type=Path)
    parser.add_argument("--title", default="H3 two-pass on two GPUs: blue = gpu:0 helper, "
                                           "orange = gpu:1 root")
    args = parser.parse_args()
    image = render(json.loads(args.workflow.read_text()), args.title)
    args.png.parent.mkdir(parents=True, exist_ok=True)
    image.save(args.png)
    print(f"wrote {args.png} ({image.width}x{image.height})")


if __name__ == "__main__":
    main()
