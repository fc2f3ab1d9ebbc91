"""`autoplan run plan.json --model M [--steps N]`: train a plan on this machine or on many.

One node:   autoplan run plan.json --model gpt-tiny --steps 20 --out run.json
            (the ranks meet through a private file store; nothing listens on the network)
Two nodes (run on each, with its own --node-rank; torchrun underneath):
            autoplan run plan.json --model llama3-8b --nnodes 2 --node-rank 0 \\
                --rdzv-endpoint host0:29500 --out run.json
One rank, built only (no training, no other process): what a rank of a big plan needs
            autoplan run plan.json --model llama3-8b --build-only --rank 3
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from autoplan.errors import ConfigError

TORCHRUN_FLAGS = ("nnodes", "node_rank", "rdzv_endpoint", "rdzv_backend", "rdzv_id", "rdzv_conf",
                  "master_addr", "master_port", "max_restarts", "monitor_interval", "log_dir", "redirects", "tee")
"""torchrun options passed through unchanged (spelled with dashes on the command line)."""


def register(sub) -> None:
    from autoplan.runtime.cli_args import add_training_args

    p = sub.add_parser("run", help="train a plan with torchrun and write a measured-run record",
                       description="Train PLAN on this machine (or, with --nnodes, on several; run the same "
                                   "command on every node) and write a run record with per-step loss, step "
                                   "time, tokens/s and per-rank memory.")
    p.add_argument("plan", help="plan.json (from `autoplan search --out`)")
    p.add_argument("--model", required=True, help="zoo preset (see `autoplan models`) or a config.json")
    p.add_argument("--out", default="run.json", help="run record to write (default run.json)")
    add_training_args(p)
    t = p.add_argument_group("torchrun", "passed to torch.distributed.run")
    t.add_argument("--nproc-per-node", type=int, default=None,
                   help="processes on this node (default: the plan's ranks / nnodes)")
    t.add_argument("--nnodes", default="1", help="number of nodes, or MIN:MAX (default 1)")
    t.add_argument("--node-rank", default=None)
    t.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous (multi-node)")
    t.add_argument("--rdzv-backend", default=None, help="rendezvous backend (torchrun's default: static; c10d)")
    t.add_argument("--rdzv-id", default=None)
    t.add_argument("--rdzv-conf", default=None)
    t.add_argument("--master-addr", default=None)
    t.add_argument("--master-port", default=None)
    t.add_argument("--max-restarts", default=None)
    t.add_argument("--monitor-interval", default=None)
    t.add_argument("--log-dir", default=None)
    t.add_argument("--redirects", default=None)
    t.add_argument("--tee", default=None)
    t.add_argument("--dry-run", action="store_true",
                   help="check everything a run checks, print how it would be launched, and exit")
    b = p.add_argument_group("build only")
    b.add_argument("--build-only", action="store_true",
                   help="build one rank's part of the plan in this process (no training, no other ranks) "
                        "and report its parameter and peak host memory")
    b.add_argument("--rank", type=int, default=0, help="the rank --build-only builds (default 0)")
    b.add_argument("--json", action="store_true", help="with --build-only: print the report as JSON")
    p.set_defaults(func=run)


def _max_nodes(nnodes: str) -> int:
    parts = str(nnodes).split(":")
    try:
        counts = [int(x) for x in parts]
    except ValueError:
        raise ConfigError("--nnodes", f"{nnodes!r} is not a number or MIN:MAX") from None
    if len(counts) > 2 or any(c < 1 for c in counts) or counts[0] > counts[-1]:
        raise ConfigError("--nnodes", f"{nnodes!r} must be N or MIN:MAX with 1 <= MIN <= MAX")
    return counts[-1]


def _multi_node(args) -> bool:
    return _max_nodes(args.nnodes) > 1 or any(getattr(args, f) for f in ("rdzv_endpoint", "master_addr",
                                                                          "node_rank"))


def preflight(args) -> "object":
    """Check here, before any process starts, everything the ranks would check: plan,
    model, training options, backend and output paths; mistakes are one clear line."""
    from autoplan.files import check_writable
    from autoplan.plan import Plan
    from autoplan.runtime.build import SEQUENCE_PARALLEL_UNITS, meta_model
    from autoplan.runtime.cli_args import training_options
    from autoplan.runtime.layout import check_plan_supported
    from autoplan.runtime.trainer import TrainOptions, _check_tp_shapes, check_backend, resolve_model_config
    from autoplan.runtime.worker import pick_backend

    plan = Plan.load(args.plan)
    TrainOptions(**training_options(args)).validate()
    cfg = resolve_model_config(args.model, args.seq_len or plan.seq_len)
    units = meta_model(cfg).layers
    check_plan_supported(plan, len(units), kv_heads=getattr(cfg, "kv_heads", None),
                         sequence_parallel_ok=all(isinstance(u, SEQUENCE_PARALLEL_UNITS) for u in units),
                         num_experts=cfg.num_experts if getattr(cfg, "arch", "") == "moe" else 0)
    _check_tp_shapes(cfg, plan.groups[0].tp)
    if args.build_only:
        return plan
    nodes = _max_nodes(args.nnodes)
    nproc = args.nproc_per_node if args.nproc_per_node is not None else plan.num_gpus // nodes
    check_backend(pick_backend(args.backend), nproc)
    if not args.out:
        raise ConfigError("--out", "must name the run record to write", "e.g. --out run.json")
    check_writable(args.out, "run record", "--out")
    if args.checkpoint_dir and os.path.exists(args.checkpoint_dir) and not os.path.isdir(args.checkpoint_dir):
        raise ConfigError("--checkpoint-dir", f"{args.checkpoint_dir!r} exists and is not a directory")
    if pick_backend(args.backend) == "gloo" and plan.dtype != "fp32":
        print(f"autoplan run: note: the plan computes in {plan.dtype} on GPUs; on CPUs (gloo) the run computes "
              "in fp32, so its step time and memory are not the plan's", file=sys.stderr)
    return plan


def _ranks_per_node(args, plan) -> tuple[int, int]:
    nodes = _max_nodes(args.nnodes)
    nproc = args.nproc_per_node
    if nproc is None:
        if plan.num_gpus % nodes:
            raise ConfigError("--nproc-per-node", f"the plan's {plan.num_gpus} ranks do not divide over "
                              f"{nodes} nodes", "give --nproc-per-node explicitly")
        nproc = plan.num_gpus // nodes
    if nproc < 1 or nproc * nodes != plan.num_gpus:
        raise ConfigError("--nproc-per-node", f"{nproc} x {nodes} nodes = {nproc * nodes} processes, but the "
                          f"plan has {plan.num_gpus} ranks", f"use {plan.num_gpus // max(nodes, 1)} per node")
    return nproc, nodes


def worker_args(args) -> list[str]:
    """The arguments every rank's ``autoplan.runtime.worker`` gets."""
    out = [args.plan, "--model", args.model, "--out", args.out,
           "--steps", str(args.steps), "--seq-len", str(args.seq_len), "--optimizer", args.optimizer,
           "--lr", repr(args.lr), "--weight-decay", repr(args.weight_decay),
           "--max-grad-norm", repr(args.max_grad_norm), "--seed", str(args.seed),
           "--checkpoint-every", str(args.checkpoint_every), "--log-every", str(args.log_every),
           "--backend", args.backend, "--clock", args.clock, "--load-balancing", args.load_balancing]
    if args.checkpoint_dir:
        out += ["--checkpoint-dir", args.checkpoint_dir]
    if args.no_resume:
        out.append("--no-resume")
    return out


def torchrun_command(args, plan) -> list[str]:
    """The torchrun command of a multi-node run (an argument list: no shell is involved)."""
    nproc, _nodes = _ranks_per_node(args, plan)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if args.rdzv_endpoint and not args.rdzv_backend:
        args.rdzv_backend = "c10d"   # torchrun's default (static) ignores the endpoint
    for flag in TORCHRUN_FLAGS:
        value = getattr(args, flag)
        if value is not None:
            cmd.append(f"--{flag.replace('_', '-')}={value}")
    return cmd + ["-m", "autoplan.runtime.worker"] + worker_args(args)


def _build_only(args, plan) -> int:
    from autoplan.runtime.trainer import build_only
    from autoplan.units import MiB
    rep = build_only(plan, args.model, rank=args.rank, seq_len=args.seq_len, seed=args.seed)
    if args.json:
        print(json.dumps(rep, indent=2))
        return 0
    units = rep["units"]
    print(f"rank {rep['rank']} of {rep['world_size']} ({rep['model']}): units {units[0]}..{units[-1]}; "
          f"local parameters {rep['local_parameter_bytes'] / MiB:,.1f} MiB of the model's "
          f"{rep['model_parameter_bytes'] / MiB:,.1f} MiB (fp32); peak host memory (max RSS) "
          f"{rep['max_rss_bytes'] / MiB:,.1f} MiB; {rep['data_parallel']}")
    return 0


def run(args) -> int:
    plan = preflight(args)
    if args.build_only:
        return _build_only(args, plan)
    env = dict(os.environ)
    # The ranks import autoplan from the same place this process did, installed or not.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if args.clock == "thread":
        # One OpenMP thread from the start: a thread's CPU time is the step's work only
        # when no other thread shares it.
        env["OMP_NUM_THREADS"] = "1"
    multi = _multi_node(args)
    if multi:
        cmd = torchrun_command(args, plan)
    else:
        nproc, _ = _ranks_per_node(args, plan)
        cmd = [sys.executable, "-m", "autoplan.runtime.worker"] + worker_args(args)
    if args.dry_run:
        if not multi:
            print(f"# {nproc} ranks on this machine, meeting through a private file store (no network listener):")
        print(shlex.join(cmd))
        return 0
    if args.out and os.path.exists(args.out):
        os.remove(args.out)   # so a failed run cannot leave a stale record looking fresh
    if multi:
        rc = subprocess.call(cmd, env=env)
    else:
        from autoplan.runtime.launch import launch_local
        rc = launch_local(worker_args(args), nproc, env)
    if rc != 0:
        print(f"autoplan run: the run failed (exit status {rc})", file=sys.stderr)
        return rc
    if not (args.out and os.path.exists(args.out)):
        print("autoplan run: the ranks exited without writing the run record", file=sys.stderr)
        return 1
    from autoplan.runtime.record import load_record
    rec = load_record(args.out)
    s = rec.summary()
    if not rec.steps:
        print(f"nothing to do: the checkpoint is already at step {args.steps}; record: {args.out}")
        return 0
    print(f"{len(rec.steps)} steps, final loss {s['final_loss']:.4f}, {s['step_time_s'] * 1e3:.1f} ms/step, "
          f"{s['tokens_per_s']:,.0f} tokens/s; record: {args.out}")
    return 0
