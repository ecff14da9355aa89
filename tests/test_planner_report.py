"""The plan a user reads: the verdict and the whole job's time first, 100 columns, one line of
advice always, and the JSON saying what the text says (rounded)."""

from __future__ import annotations

import json

import pytest

from h3_multigpu.cli import build_parser, main
from h3_multigpu.planner import PROFILES, PlanRequest, plan_job
from h3_multigpu.planner.layout import MODE_WORDS
from h3_multigpu.planner.timing import duration

JOBS = [dict(profile=p, seconds=s) for p in PROFILES for s in (5, 10, 15)] + [
    dict(profile="2xR9700", seconds=15, chunking="off", resident_blocks=50, parallel="heads"),
    dict(profile="2x3060", seconds=15, attention="sage"),
    dict(profile="1x5090", seconds=15, width=1344, height=768, lora_rank=0, pass1_steps=0,
         pass2_steps=20),
    dict(profile="2xH200", seconds=15, width=1920, height=1088, dit_dtype="bf16"),
]


def _id(job: dict) -> str:
    return "-".join(f"{v}" for v in job.values())


@pytest.fixture(scope="module", params=JOBS, ids=_id)
def plan(request):
    return plan_job(PlanRequest(**request.param))


def test_the_first_three_lines_give_the_verdict_and_the_job_time(plan):
    lines = plan.report().splitlines()
    word = "FITS" if plan.fits else "DOES NOT FIT"
    assert lines[0].startswith(word) and f"~{duration(plan.job_time.total_s)}" in lines[0]
    assert lines[1].startswith("time: ") and lines[2].startswith("job: ")
    for name, steps in (("PASS1", plan.request.pass1_steps), ("PASS2", plan.request.pass2_steps)):
        if steps:
            step = plan.step_time_s[name.lower()]
            assert f"{name} {steps} x {round(step, 1):.1f} s" in lines[1]
    # then one line per GPU
    for g, line in zip(plan.gpus, lines[3:3 + len(plan.gpus)], strict=True):
        assert line.startswith(f"gpu:{g.index} {g.role}") and g.name in line
    assert lines[3 + len(plan.gpus)] == "decisions:"


def test_every_line_fits_100_columns_and_advice_is_always_given(plan):
    lines = plan.report().splitlines()
    assert max(len(line) for line in lines) <= 100
    advice = [line for line in lines if line.startswith(("to go faster: ", "to fit: "))]
    assert len(advice) == 1
    assert plan.verdict.advice.startswith(advice[0].rstrip())


def test_json_and_text_say_the_same(plan):
    data = plan.to_dict()
    text = plan.report()
    first = text.splitlines()[0]
    assert first.startswith(data["verdict"]) and data["fits"] == plan.fits
    assert f"~{duration(data['job_time_s']['total'])}" in first
    assert f"Dual-Sage: {data['dual_sage']['state']}" in text
    assert data["dual_sage"]["installed"] == (data["dual_sage"]["state"] != "off")
    for name, p in data["parallel"]["passes"].items():
        line = next(x for x in text.splitlines() if x.startswith(f"  {name.upper()} ("))
        assert MODE_WORDS[p["mode"]] in line and f"{p['step_time_s']:.1f} s/it" in line
    pf = data["prefetch"]
    assert f"DiT blocks: {pf['resident_blocks']} resident, {pf['streamed_blocks']} streamed" \
        in text
    assert f"attention: {data['attention']['kernel']} (" in text
    assert data["advice"] == plan.verdict.advice
    for tight in data["tight"]:
        assert tight in text.replace("\n    ", " ")


def test_json_floats_are_rounded(plan):
    def floats(node):
        if isinstance(node, float):
            yield node
        elif isinstance(node, dict):
            for v in node.values():
                yield from floats(v)
        elif isinstance(node, list):
            for v in node:
                yield from floats(v)

    found = list(floats(plan.to_dict()))
    assert found and all(round(x, 3) == x for x in found)


def test_every_plan_flag_has_help():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    plan_parser = sub.choices["plan"]
    for action in plan_parser._actions:
        assert action.help, action.option_strings


def test_readme_command_and_exit_codes(capsys):
    readme = ["plan", "--profile", "2xR9700", "--width", "1312", "--height", "736",
              "--seconds", "15"]
    assert main(readme) == 0
    assert capsys.readouterr().out.startswith("FITS: the whole job ~")
    assert main([*readme, "--chunking", "off", "--resident-blocks", "50", "--parallel",
                 "heads"]) == 3
    assert capsys.readouterr().out.startswith("DOES NOT FIT on 2xR9700: gpu:1 PASS2 needs")
    assert main([*readme, "--attention", "sage", "--steps", "8,4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["attention"]["kernel"] == "sage" and out["steps"] == {"pass1": 8, "pass2": 4}
    assert main([*readme, "--steps", "8"]) == 2
    assert "steps '8' must be PASS1,PASS2 like 8,4" in capsys.readouterr().err
    assert main([*readme, "--attention", "xformers", "--json"]) == 2
    refused = json.loads(capsys.readouterr().out)
    assert refused["exit_code"] == 2 and "xformers" in refused["message"]
    assert main([*readme, "--quantized-attention", "--attention", "sdpa"]) == 2
    assert "drop --quantized-attention" in capsys.readouterr().err
