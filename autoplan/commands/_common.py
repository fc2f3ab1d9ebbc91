"""Argument helpers shared by the subcommands."""
from __future__ import annotations

import argparse

from autoplan.units import GiB


def int_in(low: int, high: int):
    """An argparse type: an integer in [low, high], else a one-line usage error."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in {low}..{high:,}, got {value}")
        return value
    parse.__name__ = "integer"
    return parse


def add_model_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    from autoplan.limits import MAX_SEQ_LEN
    p.add_argument("--model", required=required,
                   help="zoo preset (see `autoplan models`) or a HuggingFace-style config.json")
    p.add_argument("--seq-len", type=int_in(1, MAX_SEQ_LEN), default=None,
                   help="sequence length (default: the model's)")


def load_model(args, dtype: str = "bf16"):
    """The model spec as the command's training stack (``--stack``) runs it."""
    from autoplan import models
    overrides = {"seq_len": args.seq_len} if getattr(args, "seq_len", None) else {}
    return models.for_stack(args.model, getattr(args, "stack", None), dtype=dtype, **overrides)


def add_cost_model_args(p: argparse.ArgumentParser) -> None:
    """--stack, --calibration, --profiles and --no-overlap: what the cost model assumes."""
    from autoplan.stacks import stack_names
    c = p.add_argument_group("cost model")
    c.add_argument("--stack", default=None, metavar="STACK",
                   help=f"training stack the plan runs on: {', '.join(stack_names())} or a stack .json "
                        "(default: autoplan)")
    c.add_argument("--calibration", default=None, metavar="CALIB_JSON",
                   help="parameters fitted from measured runs (from `autoplan calibrate`)")
    c.add_argument("--profiles", default=None,
                   help="folder of measured profiles (from `autoplan profile`); default: the shipped ones")
    c.add_argument("--no-overlap", action="store_true",
                   help="data-parallel gradient reduction does not overlap the backward (default: as the stack does)")
    c.add_argument("--memory-margin", type=float, default=None, metavar="SHARE",
                   help="share of device memory a plan must leave free not to be 'tight' (default 0.03)")
    c.add_argument("--expert-load", type=float, default=None, metavar="FACTOR",
                   help="mixture of experts: busiest expert rank's tokens over the balanced share, as measured "
                        "(1.0 = balanced; default: the capacity factor, or the expected imbalance of dropless "
                        "routing)")


def cost_model_options(args):
    """The EstimateOptions the cost-model arguments ask for (files are read here, before
    any long work, so a bad path fails at once)."""
    from autoplan.stacks import get_stack
    from costmodel import EstimateOptions
    from costmodel.calibration import Calibration
    options = {"stack": get_stack(getattr(args, "stack", None)), "profiles": load_profiles(args.profiles)}
    if getattr(args, "calibration", None):
        options["calibration"] = Calibration.load(args.calibration)
    if args.no_overlap:
        options["overlap_grad_reduce"] = False
    if getattr(args, "memory_margin", None) is not None:
        options["memory_margin"] = args.memory_margin
    if getattr(args, "expert_load", None) is not None:
        options["expert_load"] = args.expert_load
    return EstimateOptions(**options)


def load_profiles(folder: str | None):
    """The profiles `estimate` and `search` hand the cost model: a folder given with
    --profiles, else the shipped ones (one default, so the two commands agree on every
    plan); None when the profiler cannot be imported."""
    try:
        from autoplan.profiler import ProfileStore
    except ImportError:
        return None
    return ProfileStore.load(folder) if folder else ProfileStore.shipped()


def gib(x: float) -> str:
    return f"{x / GiB:.1f}"


def table(rows: list[list[str]], header: list[str]) -> str:
    """A plain-text table with aligned columns."""
    cells = [header] + rows
    widths = [max(len(str(r[i])) for r in cells) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
