"""Argument helpers shared by the subcommands."""
from __future__ import annotations

import argparse

from autoplan.units import GiB


def add_model_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--model", required=required,
                   help="zoo preset (see `autoplan models`) or a HuggingFace-style config.json")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the model's)")


def load_model(args, dtype: str = "bf16"):
    from autoplan import models
    overrides = {"seq_len": args.seq_len} if getattr(args, "seq_len", None) else {}
    return models.get(args.model, dtype=dtype, **overrides)


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
