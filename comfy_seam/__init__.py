"""The seam between the pack and ComfyUI: every ComfyUI name, hook and internal the pack uses.

A regular package (not a namespace one) so the build's package discovery, which looks for
`__init__.py`, ships it like every other product folder.
"""
