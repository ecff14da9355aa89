"""The split plan (`sequence.plan`): declared once, spelled with the seam's names, every key
checked per release, and the shares it cuts put back together give the whole arguments."""

from __future__ import annotations

import pytest
import torch

from h3_multigpu.comfy_seam import internals, names
from h3_multigpu.sequence import plan, policy
from h3_multigpu.sequence.config import SequenceParallelConfig

CPU = torch.device("cpu")


def test_every_argument_the_plan_names_is_a_checked_internal():
    checked = {e.expect for e in internals.INTERNALS if e.kind == "source"}
    for key in (*plan.SPLIT_PLAN, plan.OPTIONS):
        assert any(text.startswith(f'"{key}": ') for text in checked if isinstance(text, str)), key
    assert any(f'["{plan.OUTPUT}"]' in str(text) and names.ORIGINAL_BLOCK in str(text)
               for text in checked)
    params = {e.expect for e in internals.INTERNALS
              if e.kind == "param" and e.target.endswith("DiTBlock.forward")}
    # a helper calls upstream's block positionally in BLOCK_ARGS order
    assert {(i + 1, name) for i, name in enumerate(("x", *plan.BLOCK_ARGS[1:]))} <= params
    assert set(plan.BLOCK_ARGS) == set(plan.SPLIT_PLAN)


def test_the_shares_cut_by_the_plan_give_back_the_whole_arguments():
    seq_len = 11
    h = torch.randn(seq_len, 4)
    rope = torch.randn(1, seq_len, 1, 3, 2, 2)
    t_emb = torch.randn(2, 5)
    rows = torch.arange(6)
    segments = [(0, 5, 1), (5, 11, rows)]
    args = plan.block_args(h, t_emb, segments, rope)
    cuts = ((0, 4), (4, 11))

    def helper(spec, value, a, b):
        out, copies = plan.helper_share(spec, value, a, b, CPU)  # buffers, then the link copies
        for dst, src in copies:
            dst.copy_(src)
        return out

    shares = [{key: (plan.root_share if k == 0 else helper)(spec, args[key], a, b)
               for key, spec in plan.SPLIT_PLAN.items()} for k, (a, b) in enumerate(cuts)]
    assert torch.equal(torch.cat([s[names.BLOCK_IMG] for s in shares]), h)
    assert torch.equal(torch.cat([s[names.BLOCK_ROPE] for s in shares], dim=1), rope)
    assert all(torch.equal(s[names.BLOCK_T_EMB], t_emb) for s in shares)
    assert shares[0][names.BLOCK_SEGMENTS] == [(0, 4, 1)]
    first, second = shares[1][names.BLOCK_SEGMENTS]
    assert first == (0, 1, 1) and second[:2] == (1, 7) and torch.equal(second[2], rows)
    with pytest.raises(ValueError, match="expects 6 dims"):
        plan.root_share(plan.SPLIT_PLAN[names.BLOCK_ROPE], rope[0], 0, 4)
    assert plan.splittable(args) and not plan.splittable({**args, names.BLOCK_ROPE: None})
    assert not plan.splittable({**args, names.BLOCK_ATTENTION: object()})


def test_device_resolution_and_split_are_pure():
    root = torch.device("cuda", 0)
    with pytest.raises(ValueError, match="needs a helper GPU"):
        policy.resolve_devices(root, None, 1)  # the visible count is given, not queried
    split = policy.build_split([CPU, CPU], 8, SequenceParallelConfig(split="3:1"))
    assert split.head_counts == (6, 2) and split.row_weights == (3.0, 1.0)
    with pytest.raises(ValueError, match="3 entries for 2 devices"):
        policy.build_split([CPU, CPU], 8, SequenceParallelConfig(split="1:1:1"))
