"""What each rank of ``autoplan run`` executes:

    python -m autoplan.runtime.worker plan.json --model M ...

started by :mod:`autoplan.runtime.launch` on one machine, or by torchrun across nodes.
Initialises the process group (a private file store from the launcher, else torchrun's
environment; NCCL when CUDA is available, else gloo), trains, and has rank 0 write the
run record. The exit status is honest: 0 for a finished run, 2 for a mistake in the
input (one line on rank 0), 1 for anything else (with its traceback).

After the run the process group is destroyed and the process leaves with ``os._exit``:
the run record is written and every stream flushed by then, and skipping the
interpreter's teardown avoids an abort some torch.distributed builds show while their
background threads are destroyed at exit ("terminate called without an active
exception"), which used to turn a finished run into a failed one.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from autoplan.errors import AutoplanError
from autoplan.runtime.cli_args import add_training_args, training_options
from autoplan.runtime.launch import INIT_METHOD_ENV

PROCESS_GROUP_TIMEOUT_S = 1800
"""Collective timeout; generous because checkpoint writes and first-step set-up (pipeline
shape inference) can take minutes for large models."""


def pick_backend(requested: str = "auto") -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def _run(args) -> int:
    rank = int(os.environ.get("RANK", "0"))
    backend = pick_backend(args.backend)
    if args.clock == "thread":
        # Thread CPU time covers a step only when every kernel runs on the training thread.
        torch.set_num_threads(1)
    try:
        if backend == "nccl":
            from autoplan.runtime.trainer import check_backend
            check_backend("nccl", int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        init = os.environ.get(INIT_METHOD_ENV)
        kw = dict(init_method=init, rank=rank, world_size=int(os.environ["WORLD_SIZE"])) if init else {}
        dist.init_process_group(backend, timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S), **kw)
    except AutoplanError as e:
        if rank == 0:
            print(f"autoplan run: error: {e}", file=sys.stderr)
        return 2
    from autoplan.runtime.trainer import train
    try:
        train(args.plan, args.model, out=args.out, **training_options(args))
        dist.barrier()
        return 0
    except AutoplanError as e:
        if rank == 0:
            print(f"autoplan run: error: {e}", file=sys.stderr)
        return 2
    except Exception:
        print(f"autoplan run: rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr)
        return 1
    finally:
        try:
            dist.destroy_process_group()
        except Exception:   # a failed rank's group may be broken already
            pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="autoplan.runtime.worker")
    p.add_argument("plan")
    p.add_argument("--model", required=True)
    p.add_argument("--out", default=None, help="run record path (written by rank 0)")
    add_training_args(p)
    return _run(p.parse_args(argv))


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
