"""Synthetic models and clusters with exactly known costs, for closed-form checks."""
from __future__ import annotations

from autoplan.cluster import Cluster
from autoplan.models.spec import ActivationBytes, Gemm, LayerSpec, ModelSpec, Split


def uniform_model(blocks: int, flops: float = 1e12, params: float = 1e6, act_bytes: float = 1e6,
                  out_bytes: float = 0.0) -> ModelSpec:
    """``blocks`` identical units with one square matmul each and nothing else."""
    n = round((flops / 2) ** (1 / 3))
    layer = LayerSpec(
        name="block", kind="block", params=Split(sharded=params),
        flops_fwd=Split(sharded=2.0 * n ** 3), flops_bwd=Split(sharded=4.0 * n ** 3),
        gemms_fwd=(Gemm(n, n, n, shard_dim="n"),),
        gemms_bwd=(Gemm(n, n, n, shard_dim="n"), Gemm(n, n, n, shard_dim="n", batch_dim="k")),
        activation_bytes=ActivationBytes(none=Split(sharded=act_bytes), selective=Split(sharded=act_bytes),
                                         full=Split(replicated=act_bytes / 10)),
        output_bytes=out_bytes)
    layers = tuple(_renamed(layer, i) for i in range(blocks))
    return ModelSpec(name="uniform", layers=layers, seq_len=1, heads=64, kv_heads=64, tokens_per_sample=1)


def _renamed(layer: LayerSpec, i: int) -> LayerSpec:
    import dataclasses
    return dataclasses.replace(layer, name=f"block.{i}")


def ideal_cluster(gpus: int, gpus_per_node: int | None = None, device: str = "A100-80GB") -> Cluster:
    """Links so fast that communication is free, to isolate schedule effects."""
    per_node = gpus_per_node or gpus
    return Cluster.from_dict({
        "name": "ideal",
        "inter_node": {"bandwidth_GBps": 1e12, "latency_us": 0},
        "node_groups": [{"name": "g", "device": device, "nodes": gpus // per_node, "gpus_per_node": per_node,
                         "intra_node": {"bandwidth_GBps": 1e12, "latency_us": 0}}],
    })
