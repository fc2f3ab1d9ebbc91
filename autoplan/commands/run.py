"""`autoplan run plan.json --model M [--steps N] [torchrun flags]`: train a plan on this
machine or on many, with torchrun underneath (NCCL on GPUs, gloo on CPUs).

One node:   autoplan run plan.json --model gpt-tiny --steps 20 --out run.json
Two nodes (run on each, with its own --node-rank):
            autoplan run plan.json --model llama3-8b --nnodes 2 --node-rank 0 \\
                --rdzv-endpoint host0:29500 --out run.json
"""
from __future__ import annotations

import os
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
    t.add_argument("--dry-run", action="store_true", help="print the torchrun command and exit")
    p.set_defaults(func=run)


def _max_nodes(nnodes: str) -> int:
    try:
        return int(str(nnodes).split(":")[-1])
    except ValueError:
        raise ConfigError("--nnodes", f"{nnodes!r} is not a number or MIN:MAX") from None


def preflight(args) -> "object":
    """Check plan and model here, before starting processes, so mistakes are one clear line."""
    from autoplan.plan import Plan
    from autoplan.runtime.build import SEQUENCE_PARALLEL_UNITS, meta_model
    from autoplan.runtime.layout import check_plan_supported
    from autoplan.runtime.trainer import _check_tp_shapes, resolve_model_config

    plan = Plan.load(args.plan)
    cfg = resolve_model_config(args.model, args.seq_len or plan.seq_len)
    units = meta_model(cfg).layers
    check_plan_supported(plan, len(units), kv_heads=getattr(cfg, "kv_heads", None),
                         sequence_parallel_ok=all(isinstance(u, SEQUENCE_PARALLEL_UNITS) for u in units),
                         num_experts=cfg.num_experts if getattr(cfg, "arch", "") == "moe" else 0)
    _check_tp_shapes(cfg, plan.groups[0].tp)
    return plan


def torchrun_command(args, plan) -> list[str]:
    nodes = _max_nodes(args.nnodes)
    nproc = args.nproc_per_node
    if nproc is None:
        if plan.num_gpus % nodes:
            raise ConfigError("--nproc-per-node", f"the plan's {plan.num_gpus} ranks do not divide over "
                              f"{nodes} nodes", "give --nproc-per-node explicitly")
        nproc = plan.num_gpus // nodes
    if nproc * nodes != plan.num_gpus:
        raise ConfigError("--nproc-per-node", f"{nproc} x {nodes} nodes = {nproc * nodes} processes, but the "
                          f"plan has {plan.num_gpus} ranks", f"use {plan.num_gpus // max(nodes, 1)} per node")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    multi = nodes > 1 or any(getattr(args, f) for f in ("rdzv_endpoint", "master_addr", "node_rank"))
    if not multi:
        cmd.append("--standalone")   # a local rendezvous on a free port
    if args.rdzv_endpoint and not args.rdzv_backend:
        args.rdzv_backend = "c10d"   # torchrun's default (static) ignores the endpoint
    for flag in TORCHRUN_FLAGS:
        value = getattr(args, flag)
        if value is not None and not (flag == "nnodes" and not multi):
            cmd.append(f"--{flag.replace('_', '-')}={value}")
    cmd += ["-m", "autoplan.runtime.worker", args.plan, "--model", args.model, "--out", args.out,
            "--steps", str(args.steps), "--seq-len", str(args.seq_len), "--optimizer", args.optimizer,
            "--lr", repr(args.lr), "--weight-decay", repr(args.weight_decay),
            "--max-grad-norm", repr(args.max_grad_norm), "--seed", str(args.seed),
            "--checkpoint-every", str(args.checkpoint_every), "--log-every", str(args.log_every),
            "--backend", args.backend, "--clock", args.clock, "--load-balancing", args.load_balancing]
    if args.checkpoint_dir:
        cmd += ["--checkpoint-dir", args.checkpoint_dir]
    if args.no_resume:
        cmd.append("--no-resume")
    return cmd


def run(args) -> int:
    plan = preflight(args)
    cmd = torchrun_command(args, plan)
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    env = dict(os.environ)
    # The workers import autoplan from the same place this process did, installed or not.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if args.clock == "thread":
        # One OpenMP thread from the start: a thread's CPU time is the step's work only
        # when no other thread shares it.
        env["OMP_NUM_THREADS"] = "1"
    if args.out and os.path.exists(args.out):
        os.remove(args.out)   # so a failed run cannot leave a stale record looking fresh
    rc = subprocess.call(cmd, env=env)
    if rc != 0:
        print(f"autoplan run: torchrun exited with status {rc}", file=sys.stderr)
        return rc
    if args.out and os.path.exists(args.out):
        from autoplan.runtime.record import load_record
        rec = load_record(args.out)
        s = rec.summary()
        if not rec.steps:
            print(f"nothing to do: the checkpoint is already at step {args.steps}; record: {args.out}")
            return 0
        print(f"{len(rec.steps)} steps, final loss {s['final_loss']:.4f}, {s['step_time_s'] * 1e3:.1f} ms/step, "
              f"{s['tokens_per_s']:,.0f} tokens/s; record: {args.out}")
    return 0
