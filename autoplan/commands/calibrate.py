"""`autoplan calibrate`: fit cost-model parameters from measured runs, with their
leave-one-out error."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="fit cost-model parameters from measured runs (run records or a CSV)")
    p.add_argument("--runs", nargs="+", default=[], metavar="RUN_JSON", help="run records from `autoplan run --out`")
    p.add_argument("--csv", default=None, metavar="CSV",
                   help="measured runs, one per row (columns: see `autoplan.calibrate`)")
    p.add_argument("--stack", default=None, help="training stack the runs used (default: autoplan; a CSV's "
                                                 "'stack' column wins)")
    p.add_argument("--out", required=True, metavar="CALIB_JSON", help="where to write the calibration")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out")
    p.add_argument("--json", action="store_true", help="print the fit and the per-run table as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from autoplan.calibrate import calibrate, runs_from_csv, runs_from_records
    from autoplan.commands._common import table
    from autoplan.errors import ConfigError
    from autoplan.catalog import is_accelerator

    out = Path(args.out)
    if out.exists() and not args.force:
        raise ConfigError(str(out), "exists", "pass --force to overwrite it, or choose another --out")
    if not out.resolve().parent.is_dir():
        raise ConfigError(str(out), f"cannot be written: {out.resolve().parent} is not a directory")
    if not args.runs and not args.csv:
        raise ConfigError("--runs", "no measured runs given", "pass --runs run.json ... and/or --csv measured.csv")
    runs = runs_from_records(args.runs, args.stack) if args.runs else []
    if args.csv:
        runs += runs_from_csv(args.csv, args.stack)
    command = "autoplan calibrate " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["calibrate"] else ""

    def progress(i, n):
        if sys.stderr.isatty() and not args.json:
            print(f"\restimating measured runs: {i}/{n}", end="" if i < n else "\n", file=sys.stderr, flush=True)
    cal, rows = calibrate(runs, command=command, progress=progress)
    cal.save(out)
    if args.json:
        print(json.dumps({"calibration": cal.to_dict(), "runs": rows}, indent=2, default=str))
        return 0

    def s(x):
        return "-" if x is None else f"{x:.4g}"
    body = [[r["run"], r["plan"], "ran" if r["ran"] else "OOM", s(r["measured_s"]), s(r["default_s"]),
             s(r.get("loo_s")), s(r.get("measured_GiB")), s(r.get("loo_GiB"))] for r in rows]
    print(table(body, ["run", "plan", "", "measured s", "default s", "held-out s", "measured GiB", "held-out GiB"]))
    print()
    for name, d in cal.devices.items():
        where = ("the host's, beside the device" if is_accelerator(name)
                 else "per kernel added to compute, per step to the optimizer step")
        print(f"{name}: compute x{d.compute_scale:.3g}, {d.launch_s * 1e6:.3g} us per kernel and "
              f"{(d.step_overhead_s or 0.0) * 1e3:.3g} ms per step ({where})")
    if cal.loo_memory_mape is not None:
        print(f"memory: activations x{cal.activation_scale:.3g}, {cal.memory_overhead_bytes / 2**30:+.2f} GiB per rank")
    print(f"leave-one-out step-time error: mean {cal.loo_time_mape:.1%}, 80% of runs within "
          f"[{cal.time_error[0]:+.1%}, {cal.time_error[1]:+.1%}]"
          + (f"; peak memory: mean {cal.loo_memory_mape:.1%}" if cal.loo_memory_mape is not None else ""))
    print(f"wrote {out} (stack {cal.stack}, {cal.runs} timed runs)")
    return 0
