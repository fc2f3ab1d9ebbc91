"""Check the cost model on one accelerator: per layer, per training step, and a real run.

Three measurements of one model on this machine's device, each against what
``costmodel.estimate`` predicts:

1. **layers** - ``autoplan profile`` at the shard shapes plans ask for (tensor-parallel
   degrees, micro-batches, recompute on/off). Each measured layer is set against the
   roofline with the catalog's default efficiencies and with efficiencies fitted to
   this profile, which is what devices that were never profiled get.
2. **step** - the whole model's forward + backward for one micro-batch, timed as one
   piece, against the cost model's sum of the profiled layers (target: within 10%).
3. **run** - ``autoplan run`` of a one-device plan (AdamW, gradient clipping, mixed
   precision on GPU) for a few steps: step time, tokens/s, MFU and peak memory, measured
   against the estimate.

Writes ``<out>/gpu_check_<device>.md``, the profile under ``<out>/profiles/`` and the run
record under ``<out>/``.

    python benchmarks/gpu_check.py                                   # cuda, llama3.2-1b, bf16
    python benchmarks/gpu_check.py --device cpu --model llama-tiny --dtype fp32 \\
        --seq-len 32 --micro-batches 1,2 --tp 1,2 --steps 3 --out /tmp/check   # a quick CPU run
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


from autoplan import models  # noqa: E402
from autoplan.cluster import Cluster  # noqa: E402
from autoplan.models.presets import get_config  # noqa: E402
from autoplan.plan import Plan  # noqa: E402
from autoplan.profiler import ProfileStore, profile  # noqa: E402
from autoplan.profiler.environment import resolve_device  # noqa: E402
from autoplan.profiler.timing import RepeatPolicy  # noqa: E402
from autoplan.profiler.validate import check_model  # noqa: E402
from autoplan.runtime.record import load_record  # noqa: E402
from costmodel import estimate  # noqa: E402
from costmodel.compute import roofline_timing  # noqa: E402
from costmodel.efficiency import default_efficiency  # noqa: E402

STEP_TARGET = 0.10
"""The whole-step prediction from a profile should be within 10% of the measured step."""


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def layer_rows(spec, store, device, dtype, tps, mbs) -> list[dict]:
    """Measured per-layer seconds (from the profile) against the two rooflines, for every
    distinct unit shape of the model at every profiled (tp, micro-batch)."""
    fitted = store.efficiency(device)
    default = default_efficiency(device.name)
    seen, rows = set(), []
    for layer in spec.layers:
        key = store.key(layer)
        if key in seen:
            continue
        seen.add(key)
        for tp in tps:
            for mb in mbs:
                measured = store.layer_timing(device, layer, mb, tp, False, dtype)
                if measured is None:
                    continue
                row = {"layer": layer.name, "kind": layer.kind, "tp": tp, "mb": mb,
                       "measured_ms": (measured.forward + measured.backward) * 1e3}
                for label, eff in (("default", default), ("fitted", fitted or default)):
                    r = roofline_timing(device, eff, layer, mb, tp, False, dtype)
                    row[f"{label}_ms"] = (r.forward + r.backward) * 1e3
                rows.append(row)
    return rows


def run_training(args, spec, cluster, store, out: Path, mb: int, accumulation: int) -> dict:
    """``autoplan run`` of a one-device plan; returns the measured and predicted figures."""
    plan = Plan.uniform(spec, cluster, tp=1, pp=1, dp=1, micro_batch=mb, global_batch=mb * accumulation,
                        dtype=args.dtype)
    plan_path, record_path = out / "gpu_check_plan.json", out / f"gpu_check_run_{args.tag}.json"
    plan_path.write_text(json.dumps(plan.to_dict(), indent=1))
    cmd = [sys.executable, "-m", "autoplan", "run", str(plan_path), "--model", args.model, "--seq-len",
           str(args.seq_len), "--steps", str(args.steps), "--out", str(record_path), "--no-resume"]
    print("$ " + " ".join(cmd[1:]), flush=True)
    t0 = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"autoplan run failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    record = load_record(record_path)
    est = estimate(spec, cluster, plan, profiles=store)
    measured_s = record.step_time_s
    return {"plan": plan.describe(), "wall_s": time.monotonic() - t0, "steps": len(record.steps),
            "measured_s": measured_s, "predicted_s": est.iteration_time_s,
            "measured_tokens_per_s": record.tokens_per_s, "predicted_tokens_per_s": est.tokens_per_s,
            # MFU counts the model's FLOPs only (no recompute), as Narayanan et al. (2021) do.
            "measured_mfu": est.mfu * est.iteration_time_s / measured_s, "predicted_mfu": est.mfu,
            "measured_peak_bytes": record.peak_memory_bytes, "predicted_peak_bytes": est.peak_memory_bytes,
            "devices": sorted(set(record.environment.get("device_names", []))),
            "record": record_path.name}


def report(args, device, env_line: str, layers, steps, run, elapsed: float) -> str:
    lines = [f"# Cost model against {device.name} ({args.model}, {args.dtype})", "",
             f"- command: `{args.command}`", f"- machine: {env_line}", f"- run time: {elapsed / 60:.1f} min", ""]
    worst_step = max(abs(s.error) for s in steps)
    lines += ["## Whole training step (forward + backward of one micro-batch)", "",
              f"Profile-based prediction vs the whole model timed as one piece; worst error "
              f"**{worst_step:.1%}** (target {STEP_TARGET:.0%}: "
              f"{'met' if worst_step <= STEP_TARGET else 'missed'}).", "",
              "| micro-batch | seq | measured ms | predicted ms (profile) | error | catalog roofline ms | error |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for s in steps:
        lines.append(f"| {s.micro_batch} | {s.seq_len} | {s.measured.total_s * 1e3:.2f} | {s.predicted_s * 1e3:.2f} | "
                     f"{s.error:+.1%} | {s.roofline_s * 1e3:.2f} | {s.roofline_error:+.1%} |")
    if layers:
        def mape(key):
            return sum(abs(r[key] / r["measured_ms"] - 1) for r in layers) / len(layers)
        lines += ["", "## Layers", "",
                  "Forward + backward of each distinct unit as profiled, against the roofline with the catalog's "
                  f"default efficiencies (mean |error| {mape('default_ms'):.1%}) and with efficiencies fitted to "
                  f"this profile (mean |error| {mape('fitted_ms'):.1%}), which is what a device that was never "
                  "profiled gets.", "",
                  "| layer | kind | tp | micro-batch | measured ms | roofline, default | error | roofline, fitted | error |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in layers:
            lines.append(f"| {r['layer']} | {r['kind']} | {r['tp']} | {r['mb']} | {r['measured_ms']:.3f} | "
                         f"{r['default_ms']:.3f} | {r['default_ms'] / r['measured_ms'] - 1:+.1%} | "
                         f"{r['fitted_ms']:.3f} | {r['fitted_ms'] / r['measured_ms'] - 1:+.1%} |")
    if run:
        lines += ["", "## Training run (`autoplan run`)", "",
                  f"Plan `{run['plan']}` on {', '.join(run['devices']) or device.name}, {run['steps']} steps "
                  f"(median step time, the first step left out); record: `{run['record']}`.", "",
                  "| | predicted | measured | measured / predicted |", "|---|---:|---:|---:|",
                  f"| step time (s) | {run['predicted_s']:.4g} | {run['measured_s']:.4g} | "
                  f"{run['measured_s'] / run['predicted_s']:.3f} |",
                  f"| tokens/s | {run['predicted_tokens_per_s']:,.0f} | {run['measured_tokens_per_s']:,.0f} | "
                  f"{run['measured_tokens_per_s'] / run['predicted_tokens_per_s']:.3f} |",
                  f"| MFU | {run['predicted_mfu']:.1%} | {run['measured_mfu']:.1%} | |",
                  f"| peak memory (GiB) | {run['predicted_peak_bytes'] / 2**30:.2f} | "
                  f"{run['measured_peak_bytes'] / 2**30:.2f} | "
                  f"{run['measured_peak_bytes'] / run['predicted_peak_bytes']:.3f} |"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--dtype", default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batches", type=ints, default=(1, 2, 4))
    p.add_argument("--tp", type=ints, default=(1, 2, 4, 8), help="tensor-parallel shard shapes to profile")
    p.add_argument("--steps", type=int, default=20, help="training steps of the run (0: no run)")
    p.add_argument("--accumulation", type=int, default=4, help="micro-batches per training step")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu"))
    p.add_argument("--check", action="store_true",
                   help=f"exit with status 1 when a whole-step prediction misses the measured step by more "
                        f"than {STEP_TARGET:.0%}")
    args = p.parse_args(argv)
    args.command = " ".join(["python benchmarks/gpu_check.py", *(sys.argv[1:] if argv is None else argv)])
    t0 = time.monotonic()
    torch_device, device = resolve_device(args.device)
    args.dtype = args.dtype or ("bf16" if torch_device.startswith("cuda") else "fp32")
    args.tag = re.sub(r"[^a-z0-9]+", "-", device.name.lower()).strip("-")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = get_config(args.model, seq_len=args.seq_len)
    spec = models.from_config(cfg, args.dtype)
    print(f"{spec.describe()} on {device.name} ({torch_device}, {args.dtype})", flush=True)

    # Profiles are resumable: a rerun after an interruption measures only what is missing.
    result = profile(cfg, device=torch_device, dtype=args.dtype, out=out / "profiles",
            tp=args.tp, micro_batches=args.micro_batches, seq_lens=[args.seq_len], recompute=("none", "full"),
            links=False, threads=1 if torch_device == "cpu" else None, device_name=device.name,
            command=args.command)
    store = ProfileStore.load(out / "profiles")
    layers = layer_rows(spec, store, device, args.dtype, args.tp, args.micro_batches)

    policy = RepeatPolicy(warmup=3, repeats=10, min_time_s=0.3)
    steps = []
    for mb in args.micro_batches:
        check = check_model(cfg, mb, store, device=torch_device, dtype=args.dtype, policy=policy,
                            device_name=device.name)
        steps.append(check)
        print(f"  step mb {mb}: measured {check.measured.total_s * 1e3:.2f} ms, predicted "
              f"{check.predicted_s * 1e3:.2f} ms ({check.error:+.1%}), catalog roofline {check.roofline_error:+.1%}",
              flush=True)

    run = None
    if args.steps > 0:
        # The training run is another process on the same device: hand back what this
        # process's allocator still caches from the measurements above.
        import gc

        import torch
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        cluster = Cluster.homogeneous(device.name, 1, 1)
        run = run_training(args, spec, cluster, store, out, max(args.micro_batches), args.accumulation)
        print(f"  run: {run['measured_s']:.4f} s/step measured vs {run['predicted_s']:.4f} s predicted, "
              f"MFU {run['measured_mfu']:.1%} measured vs {run['predicted_mfu']:.1%}", flush=True)

    env = result.environment
    env_line = (f"{env.hardware} ({env.device_kind}), host {env.cpu_model or '?'}, torch {env.torch_version}"
                + (f", CUDA {env.cuda_version}" if env.cuda_version else "") + f", {env.platform}")
    path = out / f"gpu_check_{args.tag}.md"
    path.write_text(report(args, device, env_line, layers, steps, run, time.monotonic() - t0))
    print(f"wrote {path}")
    worst = max(abs(s.error) for s in steps)
    if args.check and worst > STEP_TARGET:
        print(f"whole-step error {worst:.1%} exceeds the {STEP_TARGET:.0%} target")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
