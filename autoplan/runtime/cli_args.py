"""Command-line training flags shared by ``autoplan run`` and its torchrun workers.
Kept free of torch imports so that building the CLI's parser stays fast."""
from __future__ import annotations

import argparse


def add_training_args(p: argparse.ArgumentParser) -> None:
    """Training flags shared by the worker and the ``autoplan run`` CLI."""
    p.add_argument("--steps", type=int, default=10, help="train until this many steps are done (default 10)")
    p.add_argument("--seq-len", type=int, default=0, help="tokens per sample (default: the plan's, else the model's)")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--lr", type=float, default=3e-4, help="learning rate (default 3e-4)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping; 0 disables (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="seeds weights and synthetic data (default 0)")
    p.add_argument("--checkpoint-dir", default=None, help="write checkpoints here and resume from the latest")
    p.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every K steps (default: at the end)")
    p.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints in --checkpoint-dir")
    p.add_argument("--log-every", type=int, default=1, help="log every K steps (default 1)")
    p.add_argument("--clock", choices=("wall", "thread"), default="wall",
                   help="time steps by elapsed time, or by the training thread's CPU time (a CPU rank with one "
                        "thread; immune to other jobs on the machine)")
    p.add_argument("--load-balancing", choices=("micro", "global"), default="micro",
                   help="MoE load-balancing loss over each micro-batch (default) or the global batch")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="process-group backend (default: nccl when CUDA is available, else gloo)")


def training_options(args: argparse.Namespace) -> dict:
    return dict(steps=args.steps, seq_len=args.seq_len, optimizer=args.optimizer, lr=args.lr,
                weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm, seed=args.seed,
                checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                resume=not args.no_resume, log_every=args.log_every, clock=args.clock,
                load_balancing=args.load_balancing)
