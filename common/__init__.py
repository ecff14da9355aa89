"""The lower layer every feature shares: H3's geometry, devices and the device split, host
memory (the pinned arena, its slots and the copy engine) and the measured exactness floors.

It imports only torch and `comfy_seam` (the one door into ComfyUI); features import it and the
seam, never each other's internals (docs/architecture.md draws the layers).
"""
