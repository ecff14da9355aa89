"""comfyui-h3-multigpu: MiniMax H3 on two or more GPUs of one machine.

ComfyUI imports this file as the node pack. The library, the CLI and the tests import the same
package as `h3_multigpu` without ComfyUI, so nothing here may import ComfyUI unconditionally.
"""

__version__ = "0.1.0"


def _comfyui_present() -> bool:
    try:
        import comfy_api.latest  # noqa: F401
    except ImportError:
        return False
    return True


if _comfyui_present():

    async def comfy_entrypoint():
        """ComfyUI's V3 entry point: the pack's extension with every node."""
        from .nodes import H3MultiGPUExtension

        return H3MultiGPUExtension()
