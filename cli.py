"""`h3-multigpu` command line: plan a job, list hardware profiles, submit workflows.

Exit codes of `plan`: 0 the job fits; 3 it does not fit (the report says the smallest change
that does); 2 the request was refused (a flag or a value is wrong; the message names it and the
fix). With --json every outcome, refusals included, is one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from . import __version__

EXIT_REFUSED = 2


class UsageError(Exception):
    """A flag argparse refused; raised instead of argparse's own exit so --json can answer.

    `prog` is the parser that refused it ("h3-multigpu" or "h3-multigpu submit"), `usage` its
    usage line; the message is argparse's alone, so the prefix is printed once."""

    def __init__(self, message: str, prog: str, usage: str):
        super().__init__(message)
        self.prog, self.usage = prog, usage


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's hook for every bad flag or value
        raise UsageError(message, self.prog, self.format_usage())


def _size(text: str) -> tuple[int, int]:
    try:
        w, h = text.lower().split("x")
        return int(w), int(h)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"size {text!r} must look like 1312x736") from exc


def _steps(text: str) -> tuple[int, int]:
    parts = text.split(",")
    try:
        if len(parts) != 2:
            raise ValueError
        return int(parts[0]), int(parts[1])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"steps {text!r} must be PASS1,PASS2 like 8,4 (0 skips a pass)") from exc


def _cfg(text: str) -> tuple[float, float]:
    parts = text.split(",")
    try:
        if len(parts) not in (1, 2):
            raise ValueError
        values = [float(x) for x in parts]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"cfg {text!r} must be one guidance scale like 4, or PASS1,PASS2 like 4,1") from exc
    return (values[0], values[-1])


def _add_plan_parser(sub) -> None:
    from .planner.hardware import ATTENTION_KERNELS
    from .planner.request import PARALLEL_MODES

    p = sub.add_parser("plan", help="plan device placement, memory and time for a two-pass job",
                       description="Predict whether a two-pass H3 job fits, how long it takes, "
                                   "each GPU's memory peak, and choose placement, the multi-GPU "
                                   "mode per pass, chunking and streamed blocks. Needs no GPU "
                                   "with --profile. Exit code 0: fits, 3: does not fit, 2: "
                                   "refused (a wrong flag or value).")
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
    p.add_argument("--steps", type=_steps, default=(8, 4), metavar="P1,P2",
                   help="sampling steps of PASS1 and PASS2, for the job's time (default 8,4: "
                        "the bundled workflows with the turbo LoRA; 0,20 = one pass of 20 steps "
                        "at the final canvas)")
    p.add_argument("--cfg", type=_cfg, default=(1.0, 1.0), metavar="P1[,P2]",
                   help="guidance scale of each pass (default 1,1: the turbo LoRA's, one model "
                        "call a step); above 1 a step makes two calls, and the planner weighs "
                        "ComfyUI's MultiGPU CFG Split against the pack's modes")
    p.add_argument("--lora-rank", type=int, default=128,
                   help="rank of the on-activation turbo LoRA, 0 for none (default 128)")
    p.add_argument("--dit-dtype", choices=["int8", "bf16"], default="int8",
                   help="the DiT checkpoint's weights: int8 (the official pruned INT8 ConvRot "
                        "file, INT8 GEMMs where the GPU has them) or bf16 (default int8)")
    p.add_argument("--dit-file", default=None,
                   help="read the DiT's real sizes (and its preferred attention) from this "
                        ".safetensors header")
    p.add_argument("--attention", choices=["auto", *ATTENTION_KERNELS], default="auto",
                   help="the attention ComfyUI runs: sdpa (its default), flash "
                        "(--use-flash-attention), sage (--use-sage-attention), ck "
                        "(--use-ck-attention); auto = sdpa, or what --dit-file prefers "
                        "(inside ComfyUI the nodes read what it runs)")
    p.add_argument("--quantized-attention", action="store_true",
                   help="old name of --attention sage (an INT8-QK kernel)")
    p.add_argument("--dual-sage", choices=["auto", "on", "off"], default="auto",
                   help="Dual-Sage (attention heads sharded over the GPUs): auto = where it "
                        "speeds up attention; on; off (default auto)")
    p.add_argument("--chunking", choices=["auto", "on", "off"], default="auto",
                   help="FFN/QKV row chunking of the DiT's activations: auto = when the peak "
                        "of the mode that runs needs it; on (smallest chunks); off")
    p.add_argument("--parallel", choices=list(PARALLEL_MODES), default="auto",
                   help="how the GPUs share a step, per pass: auto picks the fastest mode that "
                        "fits of sequence parallel, heads (Dual-Sage), CFG split (above CFG 1), "
                        "CFG split x sequence (cfg_sequence, 2x2 on four GPUs) and one GPU")
    p.add_argument("--resident-blocks", type=int, default=None,
                   help="DiT blocks (0-50) the pack's streamer keeps on the root GPU, the rest "
                        "streamed (legacy loader only; under DynamicVRAM ComfyUI decides; "
                        "default: as many as fit)")
    p.add_argument("--dynamic-vram", choices=["auto", "on", "off"], default="auto",
                   help="the loader ComfyUI runs with: auto = DynamicVRAM on NVIDIA and ROCm "
                        "7.14+ (ComfyUI's default), off = the legacy loader (ROCm below 7.14, "
                        "--disable-dynamic-vram, --highvram, --gpu-only, --novram)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _run_plan(args) -> int:
    from .planner import PlanRequest, detect_hardware, plan_job

    if args.measure_link and args.profile not in (None, "auto"):
        raise ValueError(f"--measure-link measures this machine's GPUs, but --profile "
                         f"{args.profile} plans for built-in numbers; drop one of the two")
    detect = args.gpus == "auto" or args.profile in (None, "auto")
    seconds = args.seconds if args.seconds is not None else (None if args.frames else 5.0)
    # the job's values are checked first: a bad value is named at once, before detecting the
    # GPUs imports torch (seconds on a loaded machine)
    request = PlanRequest(width=args.width, height=args.height, seconds=seconds,
                          frames=args.frames, pass1_width=args.pass1[0],
                          pass1_height=args.pass1[1], profile="auto" if detect else args.profile,
                          text_tokens=args.text_tokens, lora_rank=args.lora_rank,
                          dit_dtype=args.dit_dtype, dit_file=args.dit_file,
                          dual_sage=args.dual_sage, chunking=args.chunking,
                          parallel=args.parallel, resident_blocks=args.resident_blocks,
                          attention=args.attention,
                          quantized_attention=args.quantized_attention,
                          dynamic_vram=args.dynamic_vram, pass1_steps=args.steps[0],
                          pass2_steps=args.steps[1], pass1_cfg=args.cfg[0],
                          pass2_cfg=args.cfg[1])
    if detect:
        # no profile named: plan for the GPUs of this machine (a clear error when it has none)
        request = replace(request, profile=detect_hardware(measure_link=args.measure_link))
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
    parser = _Parser(prog="h3-multigpu",
                     description="MiniMax H3 on two or more GPUs: planner and workflow client.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_plan_parser(sub)
    sub.add_parser("profiles", help="list the built-in hardware profiles")
    # always listed: without websocket-client, `submit` itself says how to install it
    from .client.cli import add_submit_parser

    add_submit_parser(sub)
    return parser


def _refuse(message: str, as_json: bool, usage: str | None = None, kind: str = "ValueError",
            prog: str = "h3-multigpu") -> int:
    if as_json:
        print(json.dumps({"event": "error", "error": kind, "message": message,
                          "exit_code": EXIT_REFUSED}))
    else:
        if usage:
            print(usage, file=sys.stderr, end="")
        print(f"{prog}: error: {message}", file=sys.stderr)
    return EXIT_REFUSED


def _stdout_closed_ok(run, args) -> int:
    """A reader that stops early (`| head`) is not an error of the plan."""
    try:
        return run(args)
    except BrokenPipeError:
        import os

        # Python flushes stdout again at exit: point it at devnull so that flush is quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    as_json = "--json" in argv
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        return _refuse(str(exc), as_json, exc.usage, "UsageError", exc.prog)
    try:
        if args.command == "plan":
            return _stdout_closed_ok(_run_plan, args)
        if args.command == "profiles":
            return _run_profiles(args)
        if args.command == "submit":
            from .client.cli import run_submit

            return run_submit(args)
    except ValueError as exc:
        return _refuse(str(exc), as_json)
    return _refuse(f"unknown command {args.command!r}", as_json)


if __name__ == "__main__":
    sys.exit(main())
