"""Measure step time and peak memory of real training steps on one GPU, over a sweep of
plans, until they run out of memory.

Each plan of the sweep (micro-batch x recompute x sequence length of one model, one
device, autoplan's own runtime: fp32 master weights, bf16 autocast, AdamW) trains a few
steps in this process (an NCCL process group of one rank). Recorded per plan: median
step time (first step left out), the caching allocator's peak allocated and reserved
bytes, and the device memory in use at the end as the driver sees it (context
included), or ``oom`` when a step ran out of memory.

The CSV it writes (``memory_runs.csv``) has the columns of a measured-runs CSV that
``autoplan calibrate --csv`` reads (plan fields, ``status``, ``step_time_s``,
``peak_memory_GiB``), so the sweep can calibrate or check the cost model directly.

    python benchmarks/gpu_memory.py --model llama3.2-1b --out benchmarks/results/gpu/h100
"""
from __future__ import annotations

import argparse
import csv
import gc
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from autoplan.models.presets import get_config  # noqa: E402
from autoplan import models  # noqa: E402
from autoplan.plan import Plan  # noqa: E402

GiB = 2 ** 30


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def run_one(cfg, plan: Plan, steps: int) -> dict:
    from autoplan.runtime.trainer import Trainer, TrainOptions
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    trainer = None
    try:
        trainer = Trainer(plan, cfg, TrainOptions(steps=steps, log_every=0), log=None)
        times = []
        for _ in range(steps):
            rec = trainer.train_step()
            times.append(rec.step_time_s)
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return {"status": "ok", "step_time_s": statistics.median(times[1:] or times),
                "peak_memory_GiB": torch.cuda.max_memory_allocated() / GiB,
                "peak_reserved_GiB": torch.cuda.max_memory_reserved() / GiB,
                "device_used_GiB": (total - free) / GiB}
    except torch.OutOfMemoryError:
        return {"status": "oom", "step_time_s": "", "peak_memory_GiB": "",
                "peak_reserved_GiB": torch.cuda.max_memory_reserved() / GiB, "device_used_GiB": ""}
    finally:
        del trainer
        gc.collect()
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--seq-lens", type=ints, default=[2048, 8192])
    p.add_argument("--micro-batches", type=ints, default=[1, 2, 4, 8, 12, 16])
    p.add_argument("--recompute", default="none,selective,full")
    p.add_argument("--accumulation", type=int, default=2, help="micro-batches per step")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from one_gpu import init_one_gpu
    started = init_one_gpu("gpu_memory", 29561, args.out)
    if started is None:
        return 2
    device, cluster, out = started
    path = out / "memory_runs.csv"
    fields = ["device", "model", "seq_len", "tp", "pp", "dp", "micro_batch", "global_batch", "schedule",
              "recompute", "zero", "dtype", "stack", "status", "step_time_s", "peak_memory_GiB",
              "peak_reserved_GiB", "device_used_GiB"]
    t0 = time.time()
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for seq in args.seq_lens:
            cfg = get_config(args.model, seq_len=seq)
            spec = models.from_config(cfg, "bf16")
            for recompute in args.recompute.split(","):
                for mb in args.micro_batches:
                    plan = Plan.uniform(spec, cluster, tp=1, pp=1, dp=1, micro_batch=mb,
                                        global_batch=mb * args.accumulation, recompute=recompute)
                    res = run_one(cfg, plan, args.steps)
                    row = {"device": device, "model": args.model, "seq_len": seq, "tp": 1, "pp": 1, "dp": 1,
                           "micro_batch": mb, "global_batch": plan.global_batch, "schedule": plan.schedule,
                           "recompute": recompute, "zero": 0, "dtype": "bf16", "stack": "autoplan", **res}
                    w.writerow(row)
                    f.flush()
                    print(f"seq {seq} {recompute:9s} mb {mb:2d}: {res['status']} "
                          f"{res['step_time_s'] if res['step_time_s'] == '' else round(res['step_time_s'], 4)} s "
                          f"peak {res['peak_memory_GiB']} GiB ({time.time() - t0:.0f} s)", flush=True)
                    if res["status"] == "oom":
                        break   # larger micro-batches only need more
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
