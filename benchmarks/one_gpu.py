"""What the one-GPU benchmarks share: a process group of one rank on the local GPU (the
runtime's trainer wants one) and the catalog cluster of that GPU."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from autoplan.cluster import Cluster


def one_gpu_cluster(device_name: str) -> Cluster:
    """A one-GPU cluster of the catalog family of the GPU named ``device_name`` as CUDA names
    it (H100, H200, else A100)."""
    family = "H100" if "H100" in device_name else "H200" if "H200" in device_name else "A100"
    return Cluster.homogeneous(family, 1, 1)


def init_one_gpu(program: str, port: int, out: str) -> tuple[str, Cluster, Path] | None:
    """Start an NCCL group of one rank on GPU 0 (``port`` on loopback) and make the output
    directory ``out``; returns the device's name, a one-GPU cluster of its catalog family
    (H100, H200, else A100) and the directory, or None (said on stderr, as ``program``)
    where there is no CUDA device."""
    if not torch.cuda.is_available():
        print(f"{program}: no CUDA device", file=sys.stderr)
        return None
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    device = torch.cuda.get_device_name(0)
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    return device, one_gpu_cluster(device), path
