"""Write tests/data/object_info_<release>.json: the core node schemas a running ComfyUI serves.

    python dev/tools/capture_core_schemas.py http://127.0.0.1:8188 033

The classes are those the file already holds (or, for a new release, those of
tests/data/object_info_033.json); model-file and input-image lists are emptied, since they
depend on the server's folders. tests/test_workflows_comfyui.py checks that a live server serves
one saved release; the default suite checks the bundled workflows against every saved release.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "tests" / "data"
FILE_INPUTS = {"unet_name", "clip_name", "vae_name", "lora_name", "model_name",
               "upscaler_name", "image"}


def without_files(entry: dict) -> dict:
    entry = json.loads(json.dumps(entry))
    for section in ("required", "optional"):
        for name, spec in ((entry.get("input") or {}).get(section) or {}).items():
            if name in FILE_INPUTS:
                if isinstance(spec[0], list):
                    spec[0] = []
                elif len(spec) > 1 and isinstance(spec[1], dict) and "options" in spec[1]:
                    spec[1]["options"] = []
    entry.pop("python_module", None)
    return entry


def capture(server: str, release: str) -> dict:
    out = DATA / f"object_info_{release}.json"
    template = out if out.is_file() else DATA / "object_info_033.json"
    names = sorted(json.loads(template.read_text())["served"])
    with urllib.request.urlopen(server.rstrip("/") + "/object_info", timeout=60) as response:
        info = json.load(response)
    missing = [n for n in names if n not in info]
    if missing:
        raise SystemExit(f"the server does not serve {missing}")
    return {"_provenance": f"node schemas served in /object_info by {server} (ComfyUI "
                           f"{release}), captured by dev/tools/capture_core_schemas.py; model-file "
                           f"and input-image lists emptied",
            "served": {n: without_files(info[n]) for n in names}}


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__.split("\n\n")[1])
    server, release = sys.argv[1], sys.argv[2]
    data = capture(server, release)
    out = DATA / f"object_info_{release}.json"
    out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out.relative_to(DATA.parents[1])} ({len(data['served'])} nodes)")


if __name__ == "__main__":
    main()
