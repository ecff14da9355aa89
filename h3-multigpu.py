#!/usr/bin/env python3
"""The pack's command line, run from its folder with the Python that runs ComfyUI:

    python custom_nodes/comfyui-h3-multigpu/h3-multigpu.py plan --profile 2xR9700
    python_embeded\\python.exe ComfyUI\\custom_nodes\\comfyui-h3-multigpu\\h3-multigpu.py profiles

The same commands as `h3-multigpu` and `python -m h3_multigpu` of a pip install; nothing to
install beyond requirements.txt. The folder's name (hyphens) cannot be imported, so this script
registers the folder as the package `h3_multigpu` itself.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType


def _same_folder(a: str, b: str) -> bool:
    return os.path.normcase(os.path.realpath(a)) == os.path.normcase(os.path.realpath(b))


def load_pack() -> ModuleType:
    """Import this folder as `h3_multigpu` and return the package."""
    # abspath, not realpath: a folder linked into custom_nodes is imported where it is linked
    here = os.path.dirname(os.path.abspath(__file__))
    # Python put this script's folder first on sys.path (unless -P, -I or a ._pth file kept it
    # off): its subfolders `nodes`, `planner` ... would shadow top-level modules of those names,
    # ComfyUI's `nodes` among them, for anything imported later
    if sys.path and _same_folder(sys.path[0] or os.curdir, here):
        del sys.path[0]
    # This folder even when another h3_multigpu is importable (a pip install of another
    # release, a checkout elsewhere): the command must plan with the code of the nodes that
    # ComfyUI loads from this folder. Registered before anything imports the name, and any
    # module of it imported already is dropped, so no part comes from elsewhere.
    for name in [n for n in sys.modules if n.partition(".")[0] == "h3_multigpu"]:
        del sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        "h3_multigpu", os.path.join(here, "__init__.py"), submodule_search_locations=[here])
    package = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = package
    spec.loader.exec_module(package)
    return package


if __name__ == "__main__":
    load_pack()
    from h3_multigpu.cli import main

    sys.exit(main())
