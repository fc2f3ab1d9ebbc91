"""What the one-GPU benchmarks share: a process group of one rank on the local GPU (the
runtime's trainer wants one) and the catalog cluster of that GPU."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from autoplan.cluster import Cluster


def one_gpu_cluster(device_name: str) -> Cluster:
    """A one-GPU cluster of the catalog family of the GPU named ``device_name`` as CUDA names
    it (H100, H200, else A100)."""
    family = "H100" if "H100" in device_name else "H200" if "H200" in device_name else "A100"
    return Cluster.homogeneous(family, 1, 1)


def init_one_gpu(port: int) -> tuple[str, Cluster]:
    """Start an NCCL group of one rank on GPU 0 (``port`` on loopback); returns the device's
    name and a one-GPU cluster of its catalog family (H100, H200, else A100)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    device = torch.cuda.get_device_name(0)
    return device, one_gpu_cluster(device)
