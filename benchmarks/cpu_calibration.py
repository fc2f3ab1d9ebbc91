"""Predict -> measure -> calibrate on the only hardware CI has: CPU ranks on gloo.

Runs a set of plans of a tiny model with ``autoplan run`` (real training across
processes), then:

1. compares the uncalibrated cost model with what was measured;
2. fits a calibration (``autoplan calibrate``) on the *fitting* plans and predicts the
   *held-out* plans with it (the two sets are listed in the report);
3. reports the leave-one-out error over all plans.

Writes ``<out>/cpu_calibration.md``, the run records and the calibration.

    python benchmarks/cpu_calibration.py                       # 8 plans, gpt-tiny, 2 ranks
    python benchmarks/cpu_calibration.py --plans 4 --steps 4   # quicker
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from autoplan import models  # noqa: E402
from autoplan.cluster import Cluster  # noqa: E402
from autoplan.plan import Plan  # noqa: E402

CPU_CLUSTER = ROOT / "examples" / "clusters" / "cpu-4ranks.json"

PLANS = [
    # name, ranks, plan keywords; alternating into the fitting and the held-out set
    ("dp2-mb2", dict(tp=1, pp=1, dp=2, micro_batch=2, global_batch=8)),
    ("tp2-mb4", dict(tp=2, pp=1, dp=1, micro_batch=4, global_batch=8)),
    ("pp2-1f1b-mb2", dict(tp=1, pp=2, dp=1, micro_batch=2, global_batch=8, schedule="1f1b")),
    ("dp2-mb4", dict(tp=1, pp=1, dp=2, micro_batch=4, global_batch=16)),
    ("pp2-gpipe-mb4", dict(tp=1, pp=2, dp=1, micro_batch=4, global_batch=16, schedule="gpipe")),
    ("tp2-mb2", dict(tp=2, pp=1, dp=1, micro_batch=2, global_batch=4)),
    ("dp2-zero3-mb2", dict(tp=1, pp=1, dp=2, micro_batch=2, global_batch=8, zero=3)),
    ("pp2-1f1b-mb4", dict(tp=1, pp=2, dp=1, micro_batch=4, global_batch=16, schedule="1f1b")),
]


def run_plans(model: str, seq_len: int, steps: int, names: list[str], out: Path) -> list[Path]:
    cluster = Cluster.load(CPU_CLUSTER)
    spec = models.get(model, dtype="fp32", seq_len=seq_len)
    records = []
    for name, kw in PLANS:
        if name not in names:
            continue
        plan = Plan.uniform(spec, cluster, dtype="fp32", **kw)
        plan_path, record = out / f"plan-{name}.json", out / f"run-{name}.json"
        plan.save(plan_path)
        cmd = [sys.executable, "-m", "autoplan", "run", str(plan_path), "--model", model, "--seq-len", str(seq_len),
               "--steps", str(steps), "--out", str(record), "--no-resume", "--log-every", "0"]
        t0 = time.monotonic()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if not record.exists():
            raise SystemExit(f"{name}: autoplan run failed ({done.returncode}):\n{done.stderr[-2000:]}")
        print(f"  ran {name:16s} {plan.describe()}  ({time.monotonic() - t0:.0f} s)", flush=True)
        records.append(record)
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--plans", type=int, default=len(PLANS), help="how many of the plans to run (in order)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_calibration"))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n, _ in PLANS[:args.plans]]
    t0 = time.monotonic()
    records = run_plans(args.model, args.seq_len, args.steps, names, out)
    report = evaluate(records, out)
    report += f"\n({len(records)} plans measured and calibrated in {time.monotonic() - t0:.0f} s; command: " \
              f"`python benchmarks/cpu_calibration.py {' '.join(sys.argv[1:] if argv is None else argv)}`)\n"
    path = out / "cpu_calibration.md"
    path.write_text(report)
    print(report)
    print(f"wrote {path}")
    return 0


def evaluate(records: list[Path], out: Path) -> str:
    """Held-out and leave-one-out errors of calibrations fitted on these run records."""
    from autoplan.calibrate import calibrate, runs_from_records
    from costmodel import estimate

    runs = runs_from_records(records)
    fitting, held_out = runs[0::2], runs[1::2]
    cal, _ = calibrate(fitting)
    cal.save(out / "calibration-fitting-half.json")
    full, loo_rows = calibrate(runs)
    full.save(out / "calibration.json")
    lines = ["# Cost model on CPU ranks: predicted, measured and calibrated", "",
             f"Plans of a tiny model trained with `autoplan run` (gloo, fp32) on this machine. The calibration "
             f"is fitted on the *fitting* plans only and predicts the *held-out* ones.", "",
             "| plan | set | measured s | uncalibrated s | ratio | calibrated s | error |", "|---|---|---:|---:|---:|---:|---:|"]
    errors = []
    for r in runs:
        base = estimate(r.model, r.cluster, r.plan, stack=r.stack).iteration_time_s
        pred = estimate(r.model, r.cluster, r.plan, stack=r.stack, calibration=cal).iteration_time_s
        err = r.step_time_s / pred - 1
        held = r in held_out
        if held:
            errors.append(err)
        lines.append(f"| {r.plan.describe()} | {'held-out' if held else 'fitting'} | {r.step_time_s:.4f} | "
                     f"{base:.4f} | {r.step_time_s / base:.1f}x | {pred:.4f} | {err:+.1%} |")
    (d, c), = cal.devices.items()
    lines += ["", f"Fitted on {len(fitting)} plans: {d}: compute x{c.compute_scale:.3g}, {c.launch_s * 1e6:.3g} us "
              f"per kernel, {c.step_overhead_s * 1e3:.3g} ms per step.",
              f"Held-out plans: mean |error| **{sum(abs(e) for e in errors) / len(errors):.1%}**, worst "
              f"**{max(abs(e) for e in errors):.1%}** over {len(errors)} plans.",
              f"Leave-one-out over all {len(runs)} plans (`autoplan calibrate --runs ...`): mean |error| "
              f"{full.loo_time_mape:.1%}, 80% within [{full.time_error[0]:+.1%}, {full.time_error[1]:+.1%}]."]
    (out / "summary.json").write_text(json.dumps({"held_out_errors": errors, "loo_mape": full.loo_time_mape,
                                                  "rows": loo_rows}, indent=1, default=str) + "\n")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
