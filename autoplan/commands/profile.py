"""`autoplan profile`: measure per-layer time and memory and link bandwidth on this machine.

    autoplan profile --model llama3-8b --device cuda --out profiles/
    autoplan profile --model gpt-tiny,llama-tiny --device cpu --tp 1,2 --micro-batch 1,2,4
    autoplan profile --show profiles/
"""
from __future__ import annotations

import re
import shlex
import sys

from autoplan.errors import ConfigError

_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}


def parse_bytes(text: str, field: str = "max-layer-bytes") -> float:
    """'8GiB', '500MB', '1e9' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else None
    if not m or unit not in _UNITS:
        raise ConfigError(field, f"{text!r} is not a size", "write e.g. 8GiB, 500MB or 1e9")
    try:
        return float(m.group(1)) * _UNITS[unit]
    except ValueError:
        raise ConfigError(field, f"{text!r} is not a size", "write e.g. 8GiB, 500MB or 1e9") from None


def parse_ints(text: str, field: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]."""
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(field, f"{text!r} is not a comma-separated list of integers", "e.g. 1,2,4") from None
    if not values or any(v < 1 for v in values):
        raise ConfigError(field, f"{text!r} must list positive integers", "e.g. 1,2,4")
    return values


def register(sub) -> None:
    p = sub.add_parser("profile", help="measure layer time/memory and link bandwidth on this machine",
                       description="Measure forward/backward time and memory of every distinct layer of a "
                                   "model at the shard shapes plans use (one layer at a time), benchmark the "
                                   "collectives among the local ranks, and write a profile file the cost "
                                   "model reads. See docs/profiler.md.")
    p.add_argument("--model", action="append", default=[],
                   help="zoo preset or config.json (repeat, or comma-separate, for several)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--device-name", default=None,
                   help="catalog device the measurements stand for (default: detected; CPU on cpu)")
    p.add_argument("--dtype", default=None, help="fp32, bf16 or fp16 (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--out", default="profiles", help="directory of profile files (default: profiles)")
    p.add_argument("--tp", default="1,2,4,8", help="tensor-parallel degrees to measure (default: 1,2,4,8)")
    p.add_argument("--micro-batch", default="1,2,4", help="micro-batch sizes (default: 1,2,4)")
    p.add_argument("--seq-len", default=None, help="sequence lengths (default: the model's)")
    p.add_argument("--recompute", default="none,full",
                   help="recompute modes to measure: none, selective, full (default: none,full)")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs per quantity (default: 3)")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per quantity, at least (default: 10)")
    p.add_argument("--min-time", type=float, default=0.05,
                   help="keep repeating until this many seconds were timed (default: 0.05)")
    p.add_argument("--max-repeats", type=int, default=200, help="cap on timed runs (default: 200)")
    p.add_argument("--clock", default="wall", choices=("wall", "thread"),
                   help="CPU timer: wall (perf_counter) or thread (CPU time of the thread; needs --threads 1; "
                        "use it on a machine shared with other jobs)")
    p.add_argument("--statistic", default="median", choices=("median", "p10", "min"),
                   help="headline summary of the repeats (all are recorded; default: median)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--no-ops", action="store_true", help="skip the per-operator breakdown (torch.profiler)")
    p.add_argument("--no-links", action="store_true", help="skip the collective benchmark")
    p.add_argument("--link-world-size", type=int, default=None,
                   help="local ranks for the link benchmark (default: 2 on cpu, all GPUs on cuda)")
    p.add_argument("--link-sizes", default=None,
                   help="message sizes for the link benchmark, e.g. 4KiB,1MiB,16MiB (default: 1KiB..16MiB)")
    p.add_argument("--link-repeats", type=int, default=7, help="timed runs per collective and size (default: 7)")
    p.add_argument("--max-layer-bytes", default=None,
                   help="refuse entries needing more memory than this, e.g. 8GiB (default: half the "
                        "available RAM on cpu, 90%% of free GPU memory on cuda)")
    p.add_argument("--restart", action="store_true", help="discard the existing file's entries and start over")
    p.add_argument("--dry-run", action="store_true", help="plan the sweep and check memory; measure nothing")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--show", metavar="DIR", default=None,
                   help="summarize the profiles in DIR (and the efficiencies fitted from them) and exit")
    p.set_defaults(func=run)


def _show(path: str) -> int:
    from autoplan.profiler import ProfileStore
    store = ProfileStore.load(path)
    print(store.summary())
    for d in store.profiled_devices():
        fit = store.efficiency_fit(d)
        if fit is not None:
            print(f"efficiency fit: {fit.describe()}")
            for w in fit.warnings:
                print(f"  note: {w}")
    return 0


def run(args) -> int:
    if args.show:
        return _show(args.show)
    models = [m.strip() for text in args.model for m in text.split(",") if m.strip()]
    if not models:
        raise ConfigError("--model", "is required", "e.g. --model gpt-tiny (or --show DIR)")
    from autoplan.profiler import profile
    from autoplan.profiler.links import DEFAULT_SIZES
    device = args.device
    if device is None:
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = (tuple(int(parse_bytes(s, "link-sizes")) for s in args.link_sizes.split(",") if s.strip())
             if args.link_sizes else DEFAULT_SIZES)
    command = "autoplan profile " + shlex.join(sys.argv[2:] if len(sys.argv) > 2 and sys.argv[1] == "profile"
                                               else _argv_of(args))
    result = profile(
        models, device=device, dtype=args.dtype, out=args.out, tp=parse_ints(args.tp, "--tp"),
        micro_batches=parse_ints(args.micro_batch, "--micro-batch"),
        seq_lens=parse_ints(args.seq_len, "--seq-len") if args.seq_len else None,
        recompute=tuple(m.strip() for m in args.recompute.split(",") if m.strip()),
        warmup=args.warmup, repeats=args.repeats, min_time_s=args.min_time, max_repeats=args.max_repeats,
        clock=args.clock, statistic=args.statistic, ops=not args.no_ops, links=not args.no_links,
        link_world_size=args.link_world_size, link_sizes=sizes, link_repeats=args.link_repeats,
        max_layer_bytes=parse_bytes(args.max_layer_bytes) if args.max_layer_bytes else None,
        threads=args.threads, device_name=args.device_name, restart=args.restart, dry_run=args.dry_run,
        progress=not args.quiet, command=command)
    print(result.summary())
    return 0


def _argv_of(args) -> list[str]:
    """The options of ``args`` as a command line (when not run from a shell)."""
    out = []
    for m in args.model:
        out += ["--model", m]
    for name in ("device", "device_name", "dtype", "out", "tp", "micro_batch", "seq_len", "recompute", "threads",
                 "clock", "statistic"):
        v = getattr(args, name)
        if v is not None:
            out += [f"--{name.replace('_', '-')}", str(v)]
    for flag in ("no_ops", "no_links", "restart"):
        if getattr(args, flag):
            out.append(f"--{flag.replace('_', '-')}")
    return out
