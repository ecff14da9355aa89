"""Keeps each model's GPU current while it runs (`device`): ComfyUI leaves cuda:0 current while
the DiT runs on cuda:1. Used by the nodes and by every feature that patches a forward."""
