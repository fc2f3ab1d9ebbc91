"""`autoplan bench`: searched plans against the Megatron-LM and DeepSpeed rules on the
benchmark scenarios, written as report.md with figures (see benchmarks/bench.py and
docs/bench.md)."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

from autoplan.errors import ConfigError


def _bench_module():
    """benchmarks/bench.py lives beside the package in a checkout, not inside it; make it
    importable when autoplan runs from elsewhere in that checkout."""
    try:
        return importlib.import_module("benchmarks.bench")
    except ModuleNotFoundError as e:
        if e.name not in ("benchmarks", "benchmarks.bench"):
            raise
    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks" / "bench.py").is_file():
        raise ConfigError("bench", "benchmarks/bench.py is not next to this autoplan installation",
                          "run `autoplan bench` from a checkout of the repository")
    sys.path.insert(0, str(root))
    return importlib.import_module("benchmarks.bench")


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmark searched plans against Megatron-LM/DeepSpeed rules",
                       description="Run the benchmark scenarios (search, baselines, estimates), a measured "
                                   "track on this machine, and write report.md with figures.")
    try:
        bench = _bench_module()
    except ConfigError as e:
        # Outside a checkout the other commands must keep working; bench says why it cannot.
        p.set_defaults(func=lambda args, e=e: (_ for _ in ()).throw(e))
        return
    # The options are defined once, next to the code that uses them.
    bench.add_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    bench = _bench_module()
    bench.run(args.scenarios, args.out, quick=args.quick, only=args.only, measured=not args.no_measured,
              steps=args.steps, command="autoplan bench" + (" --quick" if args.quick else ""), targets=args.targets)
    return 0
