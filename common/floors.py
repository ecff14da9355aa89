"""Exactness floors every feature that splits a GEMM or an attention call keeps (pure Python).

A chunked GEMM equals the unchunked one bit for bit only while cuBLAS keeps the same kernel
(same K-reduction order): on an H200, bf16 chunks of ~3,400 rows and more did, chunks of
~800-2,300 rows did not (max |diff| 0.016-0.031 in bf16 through the model). Chunking realises a
requested chunk at or above EXACT_MIN_ROWS never below it, and the sequence split gives no GPU
fewer rows; `common.exact_rows` holds the floors measured per GPU and shape beyond this one
(on-activation adapters' few-column GEMMs, whose kernel moves with the row count up to 8,192
rows or never settles). `dev/bench/sweep_chunk_exactness.py` measures them on the GPU at hand.

A call with few heads x few query tiles makes flash attention split the keys across blocks
(split-KV), which changes the summation order: head groups and head shares are exact only while
every call keeps enough (head, 64-row query tile) work items; 1024 covers twice the SMs of any
GPU here.
"""

from __future__ import annotations

EXACT_MIN_ROWS = 4096
MIN_AUTO_CHUNK_ROWS = EXACT_MIN_ROWS  # "auto" and the planner never chunk rows below the floor
# a requested head group of at least EXACT_MIN_HEADS heads is realised with fewer, larger
# groups where the sequence is too short to keep MIN_QUERY_TILES_PER_CALL per call
EXACT_MIN_HEADS = 4
MIN_QUERY_TILES_PER_CALL = 1024
QUERY_TILE_ROWS = 64
