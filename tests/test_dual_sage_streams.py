"""Dual-Sage's stream ordering on the CPU stream simulator (`exchange.streams.simulate`).

Every stream is a queue run lazily: only up to an event something waits on, or when the host
takes the output back, where the simulator first drains the streams of one role in full. For
each role drained first the sharded call must still be exact: then no stream reads a buffer
before the work that fills it, nor overwrites one still to be read, unless a `wait` orders it.
The second test deletes each `wait(...)` line of the sharded call and its transports in turn
and checks that some drain order then gives wrong numbers: no wait is untested.
"""

import inspect
import re
import sys

import pytest
import torch
import torch.nn.functional as F

from h3_multigpu.dual_sage import ShardedAttention, ShardPlan, TransportMode
from h3_multigpu.dual_sage import sharded as sharded_module
from h3_multigpu.exchange import streams
from h3_multigpu.exchange import transport as transport_module

CPU = torch.device("cpu")
ROLES = ("current", "root_send", "root_recv", "helper_in", "helper_compute", "helper_out")
ORDERS = [(), *[(role,) for role in ROLES]]
TRANSPORTS = [TransportMode.PEER, TransportMode.HOST]


def qkv(seed, seq_len=24, heads=8, head_dim=8):
    gen = torch.Generator().manual_seed(seed)
    buffer = torch.randn(seq_len, 3 * heads * head_dim, generator=gen)
    return tuple(t.view(seq_len, heads, head_dim).transpose(0, 1).unsqueeze(0)
                 for t in buffer.split(heads * head_dim, dim=-1))


def attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def reference(q, k, v):
    b, h, s, d = q.shape
    return attend(q, k, v).transpose(1, 2).reshape(b, s, h * d)


def wrong_outputs(transport: TransportMode, first: tuple[str, ...]) -> int:
    """Sharded calls that differ from one-device attention, over three calls of new values
    (the ring and the pinned relay slots wrap within and across calls)."""
    wrong = 0
    with streams.simulate(first=first):
        shard = ShardedAttention(ShardPlan(devices=(CPU, CPU, CPU), head_counts=(2, 3, 3)),
                                 transport=transport, chunk_heads=1, ring_slots=2)
        for seed in range(3):
            q, k, v = qkv(seed)
            out = shard(q, k, v, attend)
            assert shard.last_route == "split"
            wrong += not torch.equal(out, reference(q, k, v))
    return wrong


@pytest.mark.parametrize("transport", TRANSPORTS, ids=lambda t: t.value)
@pytest.mark.parametrize("first", ORDERS, ids=lambda o: "+".join(o) or "lazy")
def test_every_order_the_waits_allow_is_exact(transport, first):
    assert wrong_outputs(transport, first) == 0


def test_the_simulator_runs_work_lazily_and_poisons_new_buffers():
    with streams.simulate() as sim:
        side = streams.new_stream(CPU, "helper_in")
        target = streams.fresh(torch.empty(3))
        streams.launch((side,), lambda: target.fill_(1.0))
        assert torch.isnan(target).all()  # queued, not run
        streams.wait(sim.current, streams.record(side))
        streams.launch((sim.current,), lambda: target.add_(1.0))
        streams.host_continues(sim.current)
        assert torch.equal(target, torch.full((3,), 2.0))


def _wait_sites() -> list[tuple[object, int]]:
    sites = []
    for module in (sharded_module, transport_module):
        lines, _ = inspect.getsourcelines(module)
        sites += [(module, number) for number, line in enumerate(lines, start=1)
                  if re.match(r"\s*wait\(", line)]
    return sites


WAIT_SITES = _wait_sites()


def test_the_sharded_call_has_the_waits_this_file_removes():
    assert len(WAIT_SITES) >= 9, WAIT_SITES


@pytest.mark.parametrize("site", WAIT_SITES,
                         ids=lambda s: f"{s[0].__name__.rsplit('.', 1)[-1]}:{s[1]}")
def test_removing_any_wait_gives_wrong_numbers(site, monkeypatch):
    module, line = site
    real_wait = streams.wait

    def wait_except_there(stream, event):
        if sys._getframe(1).f_lineno != line:
            real_wait(stream, event)

    monkeypatch.setattr(module, "wait", wait_except_there)
    wrong = sum(wrong_outputs(transport, first) for transport in TRANSPORTS for first in ORDERS)
    assert wrong > 0, f"no drain order notices the missing wait at {module.__name__}:{line}"
