"""`h3-multigpu` command line: plan a job, list hardware profiles, submit workflows."""

from __future__ import annotations

import argparse
import json
import sys

from . import __version__


def _size(text: str) -> tuple[int, int]:
    try:
        w, h = text.lower().split("x")
        return int(w), int(h)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"size {text!r} must look like 1312x736") from exc


def _add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="plan device placement, memory and time for a two-pass job",
                       description="Predict each GPU's memory peak and time per step for a "
                                   "two-pass H3 job and choose placement, Dual-Sage, chunking "
                                   "and streamed blocks. Needs no GPU with --profile.")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--profile", default=None,
                       help="built-in hardware profile (see `h3-multigpu profiles`)")
    where.add_argument("--gpus", choices=["auto"], default=None,
                       help="use the GPUs of this machine")
    p.add_argument("--measure-link", action="store_true",
                   help="with --gpus auto: measure host and peer bandwidth (a few seconds)")
    p.add_argument("--width", type=int, default=1312, help="PASS2 width in pixels (default 1312)")
    p.add_argument("--height", type=int, default=736, help="PASS2 height in pixels (default 736)")
    p.add_argument("--pass1", type=_size, default=(864, 480), metavar="WxH",
                   help="PASS1 canvas (default 864x480)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--seconds", type=float, default=None, help="clip length (default 5)")
    length.add_argument("--frames", type=int, default=None, help="frames on the 17k+5 grid")
    p.add_argument("--text-tokens", type=int, default=256, help="prompt tokens (default 256)")
    p.add_argument("--lora-rank", type=int, default=128,
                   help="rank of the on-activation turbo LoRA, 0 for none (default 128)")
    p.add_argument("--dit-dtype", choices=["int8", "bf16"], default="int8")
    p.add_argument("--dit-file", default=None,
                   help="read the DiT's real sizes from this .safetensors header")
    p.add_argument("--dual-sage", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--chunking", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--parallel", choices=["auto", "sequence", "heads", "off"], default="auto",
                   help="how the GPUs share a step, per pass: auto picks the fastest of "
                        "sequence parallel, heads (Dual-Sage) and one GPU")
    p.add_argument("--resident-blocks", type=int, default=None)
    p.add_argument("--quantized-attention", action="store_true",
                   help="time attention with an INT8-QK kernel (ck_int8 / triton_sage)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _run_plan(args) -> int:
    from .planner import PlanRequest, detect_hardware, plan_job

    if args.gpus == "auto" or args.profile in (None, "auto"):
        # no profile named: plan for the GPUs of this machine (a clear error when it has none)
        profile = detect_hardware(measure_link=args.measure_link)
    else:
        profile = args.profile
    seconds = args.seconds if args.seconds is not None else (None if args.frames else 5.0)
    request = PlanRequest(width=args.width, height=args.height, seconds=seconds,
                          frames=args.frames, pass1_width=args.pass1[0],
                          pass1_height=args.pass1[1], profile=profile,
                          text_tokens=args.text_tokens, lora_rank=args.lora_rank,
                          dit_dtype=args.dit_dtype, dit_file=args.dit_file,
                          dual_sage=args.dual_sage, chunking=args.chunking,
                          parallel=args.parallel, resident_blocks=args.resident_blocks,
                          quantized_attention=args.quantized_attention)
    plan = plan_job(request)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1))
    else:
        print(plan.report())
    return 0 if plan.fits else 3


def _run_profiles(args) -> int:
    from .planner import PROFILES

    for name, profile in PROFILES.items():
        print(f"{name:<10} {profile.description}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="h3-multigpu",
                                     description="MiniMax H3 on two or more GPUs: planner and "
                                                 "workflow client.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_plan_parser(sub)
    sub.add_parser("profiles", help="list the built-in hardware profiles")
    try:
        from .client.cli import add_submit_parser
    except ImportError:  # the client is optional for planning
        add_submit_parser = None
    if add_submit_parser is not None:
        add_submit_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "plan":
            return _run_plan(args)
        if args.command == "profiles":
            return _run_profiles(args)
        if args.command == "submit":
            from .client.cli import run_submit

            return run_submit(args)
    except ValueError as exc:
        print(f"h3-multigpu: error: {exc}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
