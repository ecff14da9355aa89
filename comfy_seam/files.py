"""ComfyUI's model folders (`folder_paths`) and its checkpoint reader, for the pack's loaders.

Inside ComfyUI only (a node's schema and execute): `folder_paths` is imported when first
asked for, as ComfyUI itself imported it before any custom node. Each function names the
ComfyUI function it calls (0.33.0 and the newest files; each in `internals.INTERNALS`).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

FOLDER_PATHS = "folder_paths"  # ComfyUI's top-level module of model folders


def _folder_paths() -> Any:
    return importlib.import_module(FOLDER_PATHS)


def model_files(folder: str) -> list[str]:
    """The files ComfyUI lists in the model folder `folder` (`get_filename_list`); a folder this
    ComfyUI does not know (older ones have no `latent_upscale_models`) is added first as
    models/<folder>, as newer ones name it (`add_model_folder_path`, `models_dir`)."""
    paths = _folder_paths()
    if folder not in paths.folder_names_and_paths:
        paths.add_model_folder_path(folder, os.path.join(paths.models_dir, folder))
    return paths.get_filename_list(folder)


def model_path(folder: str, name: str) -> str:
    """The full path of `name` in the model folder `folder` (`get_full_path_or_raise`: raises
    naming the file when it is not there)."""
    return _folder_paths().get_full_path_or_raise(folder, name)


def load_torch_file(path: str) -> dict:
    """A checkpoint's state dict, read the way ComfyUI reads one (`comfy.utils.load_torch_file`,
    safe_load: no pickled code runs)."""
    from . import runtime

    return runtime.utils().load_torch_file(path, safe_load=True)
