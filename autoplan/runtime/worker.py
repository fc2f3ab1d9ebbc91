"""What each torchrun process of ``autoplan run`` executes:

    python -m torch.distributed.run --nproc-per-node N ... -m autoplan.runtime.worker plan.json --model M ...

Initialises the process group from torchrun's environment (NCCL when CUDA is available,
else gloo), trains, and has rank 0 write the run record.
"""
from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from autoplan.errors import AutoplanError
from autoplan.runtime.cli_args import add_training_args, training_options

PROCESS_GROUP_TIMEOUT_S = 1800
"""Collective timeout; generous because checkpoint writes and first-step set-up (pipeline
shape inference) can take minutes for large models."""


def pick_backend(requested: str = "auto") -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="autoplan.runtime.worker")
    p.add_argument("plan")
    p.add_argument("--model", required=True)
    p.add_argument("--out", default=None, help="run record path (written by rank 0)")
    add_training_args(p)
    args = p.parse_args(argv)
    backend = pick_backend(args.backend)
    if args.clock == "thread":
        # Thread CPU time covers a step only when every kernel runs on the training thread.
        torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))
    from autoplan.runtime.trainer import train
    try:
        train(args.plan, args.model, out=args.out, **training_options(args))
    except AutoplanError as e:
        if dist.get_rank() == 0:
            print(f"autoplan run: error: {e}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
