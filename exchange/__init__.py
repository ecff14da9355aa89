"""Shared plumbing for moving tensors between GPUs of one process, without NCCL.

Used by both multi-GPU modes: Dual-Sage (`dual_sage/`, heads sharded per attention call) and the
sequence-parallel mode (`sequence/`, rows split over the whole block loop). What lives here:
streams and events that degrade to no-ops on CPU stand-in devices, with `launch` for issuing work
and a lazily run CPU stream simulator for tests (`streams`), the two transports, peer copies and
the chunked pinned host relay (`transport`), the reusable buffers of one Dual-Sage helper lane,
sized for the largest call (`workspace`). `mode` and `links` serve the sequence-parallel mode.
The proportional split of heads and rows over the devices is `common.split`.
"""
