"""Start the ranks of a single-node run without opening the machine to the network.

``torchrun --standalone`` rendezvouses through a TCP store that listens, unauthenticated,
on every interface of the machine. A run on one machine needs no network at all: here
the ranks meet through a file store in a private directory (mode 0700), gloo's and
NCCL's own sockets are bound to the loopback interface, and the launcher watches the
ranks as torchrun does: when one fails the others are stopped, and the exit status is
the first failure's (0 only when every rank finished). Several nodes still go through
torchrun (see ``autoplan run --nnodes``).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

INIT_METHOD_ENV = "AUTOPLAN_INIT_METHOD"
"""Environment variable a worker reads its process-group init method from."""
STOP_GRACE_S = 10.0
"""Seconds the other ranks get to stop after one failed, before they are killed."""


def loopback_interface() -> str | None:
    """The name of the loopback network interface ('lo' on Linux, 'lo0' on macOS)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return next((n for n in names if n.startswith("lo")), None)


def rank_env(base: dict, rank: int, world: int, init_method: str) -> dict:
    """The environment of local rank ``rank`` of ``world`` (torchrun's variable names)."""
    env = dict(base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               GROUP_RANK="0", NNODES="1", MASTER_ADDR="127.0.0.1", **{INIT_METHOD_ENV: init_method})
    # One intra-op thread per rank unless asked otherwise, as torchrun does: ranks sharing
    # the cores would oversubscribe them (and a run's float results would depend on it).
    if world > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    lo = loopback_interface()
    if lo:
        # Keep gloo's and NCCL's connections between the ranks on the loopback interface
        # (unless the user chose an interface).
        env.setdefault("GLOO_SOCKET_IFNAME", lo)
        env.setdefault("NCCL_SOCKET_IFNAME", lo)
    return env


def launch_local(worker_argv: list[str], nproc: int, env: dict | None = None) -> int:
    """Run ``python -m autoplan.runtime.worker <worker_argv>`` as ``nproc`` local ranks;
    return 0 when all finished, else the exit status of the first rank that failed
    (a rank killed by signal N gives 128 + N)."""
    base = dict(os.environ if env is None else env)
    store_dir = tempfile.mkdtemp(prefix="autoplan-run-")
    init_method = f"file://{os.path.join(store_dir, 'store')}"
    procs: list[subprocess.Popen] = []
    received: list[int] = []

    def forward(signum, _frame):
        received.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for rank in range(nproc):
            procs.append(subprocess.Popen([sys.executable, "-m", "autoplan.runtime.worker", *worker_argv],
                                          env=rank_env(base, rank, nproc, init_method)))
        status = 0
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                status = _exit_status(failed[0])
                _stop(procs)
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(0.05)
        if received:
            status = status or 128 + received[0]
        return status
    finally:
        _stop(procs)
        for s, handler in old.items():
            signal.signal(s, handler)
        shutil.rmtree(store_dir, ignore_errors=True)


def _exit_status(code: int) -> int:
    return 128 - code if code < 0 else code


def _stop(procs: list[subprocess.Popen]) -> None:
    """Terminate the ranks still running; kill those that do not stop in time."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in alive:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
