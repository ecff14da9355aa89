"""Write docs/images/speed-memory.svg: measured speed and memory, read from docs/results/*.json.

    python dev/tools/plot_benchmarks.py           # rewrite the picture
    python dev/tools/plot_benchmarks.py --check   # exit 1 when the file differs from the results

Pure Python (no plotting library): every bar is a number read from a raw result file, labelled
with its value, the machine it ran on and the date. A result file that holds no date takes it
from `DATES` below, each entry naming the docs/BENCHMARKS.md section that dates the run.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
OUT = ROOT / "docs" / "images" / "speed-memory.svg"

# Result files without a "date" field, dated by the BENCHMARKS.md section that reports them.
DATES = {
    # "Video decode on two GPUs": 2026-11-30, nvidia-h200-x2
    "decode.json": "2026-11-30",
    # "A real release on one H200: stock ComfyUI against the pack": 2026-12-02, nvidia-h200
    "release_step243_033_int8_dynamic.json": "2026-12-02",
    # "Upstream's block per share and chunking by wrapping upstream's modules" ("Chunking, one
    # block"): 2026-12-02, nvidia-h200
    "chunk_block_newest_h200.json": "2026-12-02",
    # "FFN/QKV chunking": 2026-11-30, one H200 of nvidia-h200-x2
    "chunking_uncapped.json": "2026-11-30",
    "chunking_capped32.json": "2026-11-30",
}

GiB = 2**30
WEIGHTS = {"int8_convrot": "INT8 ConvRot", "bf16": "bf16"}


@dataclass(frozen=True)
class Bar:
    what: str  # the job, left of the bar
    value: float
    label: str  # the value as printed beside the bar
    machine: str  # the GPUs and what ran on them
    date: str
    source: str  # the result file
    baseline: bool = False  # a stock / unpatched bar (drawn grey)


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _date(name: str, data: dict) -> str:
    date = data.get("date")
    return str(date)[:10] if date else DATES[name]


def _gpus(names: list[str]) -> str:
    assert len(set(names)) == 1, names  # every run here used equal GPUs
    return f"{len(names)}x {names[0]}"


def _speedup(label: str, speedup: float, where: str, name: str, data: dict) -> Bar:
    """A measured bit-identical speed-up as a bar (value, words, machine, date, source)."""
    return Bar(label, speedup, f"{speedup:.2f}x, bit-identical", where, _date(name, data), name)


def speed_bars() -> list[Bar]:
    bars = []
    name = "sequence_parallel_7heads.json"
    data = _load(name)
    row = next(r for r in data["rows"] if r["row"] == "pass2_69k")
    assert row["bit_identical"]
    bars.append(_speedup("sequence parallel: PASS2 step, 1312x736 243 f", row["speedup"],
                         f"{_gpus(data['devices'])}, bf16 twin", name, data))
    name = "dual_sage_comfyui_transport_chunks.json"
    data = _load(name)
    step = data["step"]
    assert step["bit_identical"]
    bars.append(_speedup("Dual-Sage: PASS2 step, 1312x736 243 f", step["speedup"],
                         f"{_gpus(data['devices'])}, bf16 twin", name, data))
    call = next(a for a in data["attention"] if a["S"] == 68706 and a["transport"] == "peer")
    assert call["bit_identical"]
    bars.append(_speedup("Dual-Sage: one attention call, 68,706 tokens", call["speedup"],
                         f"{_gpus(data['devices'])}, bf16", name, data))
    name = "decode.json"
    data = _load(name)
    row = next(r for r in data["rows"] if r["frames"] == 243)
    assert row["exact"]
    bars.append(_speedup("video decode (earlier design): 1312x736 243 f", row["speedup"],
                         f"{_gpus(data['gpus'])}, bf16 VAE", name, data))
    name = "release_step243_033_int8_dynamic.json"
    data = _load(name)
    pack = data["variants"]["pack"]
    assert pack["bit_identical_to_first"]
    cost = pack["vs_stock"] - 1.0
    bars.append(Bar("the pack on one GPU vs stock: PASS2 243 f", 1.0 / pack["vs_stock"],
                    f"{1.0 / pack['vs_stock']:.3f}x ({cost:+.1%} time), bit-identical",
                    f"1x {data['gpu']}, ComfyUI {data['comfyui']}, {WEIGHTS[data['weights']]}",
                    _date(name, data), name))
    return bars


def memory_bars() -> list[Bar]:
    bars = []
    name = "chunking_uncapped.json"
    data = _load(name)
    capped = _load("chunking_capped32.json")
    rows = {r["mode"]: r for r in data["rows"] if r["frames"] == 362}
    oom = next(r for r in capped["rows"] if r["frames"] == 362 and r["mode"] == "unchunked")
    assert oom["status"] == "oom" and rows["chunked"]["bit_identical"]
    machine, date = f"1x {data['meta']['device']}, bf16", _date(name, data)
    bars.append(Bar("stock block: PASS2 362 f, rank-128 LoRA", rows["unchunked"]
                    ["measured_peak_gib"], f"{rows['unchunked']['measured_peak_gib']:.2f} GiB "
                    f"(out of memory under a {capped['meta']['cap_gib']:.0f} GiB cap)",
                    machine, date, name, baseline=True))
    bars.append(Bar("chunked block: PASS2 362 f, rank-128 LoRA",
                    rows["chunked"]["measured_peak_gib"],
                    f"{rows['chunked']['measured_peak_gib']:.2f} GiB (fits the cap), "
                    "bit-identical", machine, date, name))
    name = "chunk_block_newest_h200.json"
    data = _load(name)
    cases = {c["variant"]: c for c in data["cases"]
             if c["weights"] == "int8_convrot" and c["tokens"] == 68706}
    assert cases["chunked"]["equal_to_stock"]
    machine, date = f"1x {data['device']}, ComfyUI's loader", _date(name, data)
    bars.append(Bar("stock block: INT8 ConvRot, 68,706 tokens",
                    cases["stock"]["peak_bytes"] / GiB,
                    f"{cases['stock']['peak_bytes'] / GiB:.2f} GiB", machine, date, name,
                    baseline=True))
    bars.append(Bar("chunked block: INT8 ConvRot, 68,706 tokens",
                    cases["chunked"]["peak_bytes"] / GiB,
                    f"{cases['chunked']['peak_bytes'] / GiB:.2f} GiB, bit-identical",
                    machine, date, name))
    return bars


# --- drawing ---------------------------------------------------------------------------------
WIDTH = 1040
LEFT = 360  # where bars start
BAR_MAX = 330  # pixels of the longest axis value
ROW = 40
FONT = "font-family='DejaVu Sans, Arial, sans-serif'"
COLOURS = {"pack": "#e07b24", "baseline": "#9aa3ad"}


def _text(x: float, y: float, text: str, size: int = 12, anchor: str = "start",
          colour: str = "#222", weight: str = "normal") -> str:
    return (f"<text x='{x:.1f}' y='{y:.1f}' {FONT} font-size='{size}' fill='{colour}' "
            f"text-anchor='{anchor}' font-weight='{weight}'>{escape(text)}</text>")


def _panel(title: str, bars: list[Bar], top: float, axis_max: float, ticks: list[float],
           unit: str, marker: float | None) -> tuple[list[str], float]:
    out = [_text(20, top + 18, title, 14, weight="bold")]
    y0 = top + 34
    scale = BAR_MAX / axis_max
    height = ROW * len(bars)
    for tick in ticks:
        x = LEFT + tick * scale
        out.append(f"<line x1='{x:.1f}' y1='{y0:.1f}' x2='{x:.1f}' y2='{y0 + height:.1f}' "
                   "stroke='#e3e6ea' stroke-width='1'/>")
        out.append(_text(x, y0 + height + 14, f"{tick:g}{unit}", 10, "middle", "#666"))
    if marker is not None:
        x = LEFT + marker * scale
        out.append(f"<line x1='{x:.1f}' y1='{y0 - 4:.1f}' x2='{x:.1f}' y2='{y0 + height:.1f}' "
                   "stroke='#444' stroke-width='1' stroke-dasharray='4,3'/>")
    for i, bar in enumerate(bars):
        y = y0 + i * ROW
        colour = COLOURS["baseline" if bar.baseline else "pack"]
        out.append(_text(LEFT - 8, y + 13, bar.what, 12, "end"))
        out.append(_text(LEFT - 8, y + 27, f"{bar.machine}, {bar.date}", 10, "end", "#666"))
        out.append(f"<rect x='{LEFT}' y='{y + 3:.1f}' width='{bar.value * scale:.1f}' "
                   f"height='16' fill='{colour}'/>")
        out.append(_text(LEFT + bar.value * scale + 6, y + 15, bar.label, 12))
        out.append(_text(LEFT + bar.value * scale + 6, y + 28, f"docs/results/{bar.source}",
                         9, colour="#888"))
    return out, y0 + height + 24


def render() -> str:
    parts, y = _panel("Speed: x the same job on one GPU (the pack on one GPU: x stock ComfyUI)",
                      speed_bars(), 44, 2.0, [0, 0.5, 1.0, 1.5, 2.0], "x", 1.0)
    memory, y = _panel("Peak memory of one DiT block, GiB (lower is better; grey = stock)",
                       memory_bars(), y + 6, 14.0, [0, 4, 8, 12], " GiB", None)
    body = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{y + 8:.0f}' "
        f"viewBox='0 0 {WIDTH} {y + 8:.0f}'>",
        f"<rect width='{WIDTH}' height='{y + 8:.0f}' fill='white'/>",
        _text(20, 24, "comfyui-h3-multigpu: measured speed and memory "
                      "(generated by dev/tools/plot_benchmarks.py)", 15, weight="bold"),
        *parts, *memory, "</svg>",
    ]
    return "\n".join(body) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="regenerate in memory; exit 1 when the file differs")
    args = parser.parse_args(argv)
    svg = render()
    if args.check:
        current = OUT.read_text() if OUT.is_file() else None
        if current != svg:
            print(f"{OUT.relative_to(ROOT)} is out of date: "
                  "run python dev/tools/plot_benchmarks.py",
                  file=sys.stderr)
            return 1
        print(f"{OUT.relative_to(ROOT)} matches docs/results")
        return 0
    OUT.write_text(svg)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
