"""Write tests/data/object_info_pack.json: this pack's nodes as a running ComfyUI serves them.

    python dev/tools/capture_pack_schemas.py http://127.0.0.1:8188

The bundled workflows are generated against this file (and tests/data/object_info_h3.json for
core nodes); tests/test_nodes_comfyui.py checks it against a live server so it cannot drift.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "data" / "object_info_pack.json"
ABOUT = ("This pack's nodes as ComfyUI serves them in /object_info (captured by "
         "dev/tools/capture_pack_schemas.py; tests/test_nodes_comfyui.py compares it with a live "
         "server). Model-file lists are not part of it.")


def capture(server: str) -> dict:
    sys.path.insert(0, str(ROOT.parent))
    from h3_multigpu.nodes import NODE_IDS

    with urllib.request.urlopen(server.rstrip("/") + "/object_info", timeout=60) as response:
        info = json.load(response)
    missing = [n for n in NODE_IDS if n not in info]
    if missing:
        raise SystemExit(f"the server does not serve {missing}; is the pack installed?")
    return {"_about": ABOUT, "served": {n: info[n] for n in NODE_IDS}}


def main() -> None:
    data = capture(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8188")
    OUT.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)} ({len(data['served'])} nodes)")


if __name__ == "__main__":
    main()
