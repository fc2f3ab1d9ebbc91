"""Hand rules practitioners use instead of a search, as plain :class:`~autoplan.plan.Plan` s
under the same cost model, so searched plans can be compared with them.

Each rule follows its published recipe and uses the cost model only the way a person
would use a trial run: to see whether a configuration fits in memory. The rules know
nothing about heterogeneous clusters: they lay out uniform degrees over all GPUs in rank
order (tensor parallel fastest, then data, then pipeline), as Megatron-LM and DeepSpeed
do, whatever device each rank turns out to be. That is exactly why they lose there.

When no configuration of a rule fits, the rule still returns its leanest plan (the
most memory-saving configuration it would try) rather than raising: the caller sees
``autoplan.estimate(model, cluster, plan).fits == False``. Comparisons in reports can then
show "does not fit" for the rule instead of losing the row.
"""
from __future__ import annotations

from autoplan import models as _models
from autoplan.cluster import Cluster
from autoplan.errors import ConfigError
from autoplan.plan import Plan

__all__ = ["megatron", "deepspeed"]


def _check(model, cluster: Cluster, global_batch: int):
    model = _models.get(model)
    if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch < 1:
        raise ConfigError("global_batch", f"must be a positive integer, got {global_batch!r}")
    return model


def _node_tp(model, cluster: Cluster, limit: int = 8) -> int:
    """Tensor parallelism as wide as a node allows: the largest degree that divides every
    node's GPU count (rank-order layout keeps each group inside a node), is at most
    ``limit`` and divides the attention heads."""
    from math import gcd
    per_node = 0
    for g in cluster.groups:
        per_node = gcd(per_node, g.gpus_per_node)
    allowed = [t for t in model.tp_degrees(min(per_node, limit)) if per_node % t == 0]
    return max(allowed) if allowed else 1


def _fits(model, cluster: Cluster, plan: Plan, stack=None) -> bool:
    from costmodel import estimate
    return estimate(model, cluster, plan, stack=stack).fits


def _first_fitting(model, cluster: Cluster, plans, layouts: str, global_batch: int, stack=None) -> Plan:
    """The first of ``plans`` (ordered from the rule's preferred to its leanest) that fits,
    else the last one tried, the leanest; a recipe with no layout at all is an error."""
    lean = None
    for plan in plans:
        if _fits(model, cluster, plan, stack):
            return plan
        lean = plan
    if lean is None:
        raise ConfigError("global_batch", f"{layouts} has a data-parallel degree dividing {global_batch}",
                          "use a global batch divisible by the GPU count")
    return lean


def _body_layers(model) -> int:
    kinds = [l.kind for l in model.layers]
    return sum(1 for k in kinds if k not in ("embedding", "head"))


def _meshes(gpus: int, tp: int, body_layers: int, global_batch: int):
    """(pp, dp) for every pipeline depth, shallowest first, that uses all ``gpus`` with
    tensor degree ``tp`` and whose data-parallel degree divides the global batch."""
    for pp in range(1, max(body_layers, 1) + 1):
        if gpus % (tp * pp) == 0 and global_batch % (gpus // (tp * pp)) == 0:
            yield pp, gpus // (tp * pp)


def megatron(model, cluster: Cluster, global_batch: int, stack=None, dtype: str = "bf16") -> Plan:
    """Megatron-LM's published practice.

    * Tensor parallelism across the GPUs of a node, up to 8 and dividing the heads
      (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
      Using Megatron-LM", SC21, §3.3 takeaway #1: tensor parallel within a node).
    * Pipeline parallelism with the fewest stages that make the model fit (§3.3 takeaway
      #1: pipeline parallelism to scale across nodes, only as much as needed), layers split
      evenly (embedding on the first stage, head on the last).
    * Data parallelism over the remaining GPUs (§3.3 takeaway #2).
    * Micro-batch size 1 (§3.4: small micro-batches minimize the pipeline bubble at the
      batch sizes of interest), interleaved 1F1B with 2 model chunks per device where it
      applies (pipeline parallel, blocks divisible by 2 x pp, micro-batches by pp; §2.2).
    * Sequence parallelism with tensor parallelism, and activation recomputation only when
      needed to fit: selective first, then full (Korthikanti et al., "Reducing Activation
      Recomputation in Large Transformer Models", 2022, §5).

    Uses every GPU: pp * tp must divide the GPU count and dp must divide the global batch.
    When nothing fits, returns the leanest such plan (most stages, full recomputation).
    Whether a plan fits is judged on ``stack`` (a training stack name; None: autoplan's)."""
    model = _check(model, cluster, global_batch)
    n = cluster.num_gpus
    tp = _node_tp(model, cluster)
    body = _body_layers(model)

    def plans():
        for pp, dp in _meshes(n, tp, body, global_batch):
            m = global_batch // dp
            interleave = pp > 1 and body % (2 * pp) == 0 and m % pp == 0
            schedule, v = ("interleaved-1f1b", 2) if interleave else ("1f1b", 1)
            for recompute in ("none", "selective", "full"):
                yield Plan.uniform(model, cluster, tp=tp, pp=pp, dp=dp, micro_batch=1, global_batch=global_batch,
                                   schedule=schedule, virtual_stages=v, recompute=recompute,
                                   sequence_parallel=tp > 1, dtype=dtype)

    return _first_fitting(model, cluster, plans(), f"no Megatron layout of {n} GPUs (tp={tp})", global_batch, stack)


def deepspeed(model, cluster: Cluster, global_batch: int, variant: str = "zero3", stack=None,
              dtype: str = "bf16") -> Plan:
    """DeepSpeed's recipes.

    ``variant="zero3"``: ZeRO stage 3 data parallelism over all GPUs (Rajbhandari et al.,
    "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC20, §5:
    optimizer states, gradients and parameters partitioned), no model parallelism, with the
    largest micro-batch that fits (§8: ZeRO's memory savings buy a larger batch per GPU);
    activation checkpointing only if even micro-batch 1 does not fit (ZeRO-R, §6.1).

    ``variant="3d"``: DeepSpeed's 3D parallelism as used with Megatron (DeepSpeed team,
    "DeepSpeed: Extreme-scale model training for everyone", 2020; Smith et al., "Using
    DeepSpeed and Megatron to Train Megatron-Turing NLG 530B", 2022, §3): ZeRO stage 1 over
    data parallelism, 1F1B pipeline with the fewest stages that fit, tensor parallelism
    inside a node, micro-batch 1, activation checkpointing (full) only when needed.

    Uses every GPU (the data-parallel degree is the largest divisor of the global batch
    the GPUs allow). When nothing fits, returns the leanest plan tried. Whether a plan fits
    is judged on ``stack`` (a training stack name; None: autoplan's). ``dtype``: the training
    dtype (both rules take it), e.g. fp16 on devices without bf16."""
    model = _check(model, cluster, global_batch)
    n = cluster.num_gpus
    if variant == "zero3":
        dp = max(d for d in range(1, n + 1) if global_batch % d == 0 and n % d == 0)
        per_replica = global_batch // dp
        sizes = sorted((b for b in range(1, per_replica + 1) if per_replica % b == 0), reverse=True)
        # The last plan tried (micro-batch 1, full recompute) is the leanest.
        plans = (Plan.uniform(model, cluster, tp=1, pp=1, dp=dp, micro_batch=b, global_batch=global_batch,
                              recompute=recompute, zero=3, dtype=dtype)
                 for recompute in ("none", "full") for b in sizes)
        return _first_fitting(model, cluster, plans, f"no ZeRO-3 layout of {n} GPUs", global_batch, stack)
    if variant == "3d":
        tp = _node_tp(model, cluster)
        body = _body_layers(model)
        plans = (Plan.uniform(model, cluster, tp=tp, pp=pp, dp=dp, micro_batch=1, global_batch=global_batch,
                              schedule="1f1b", recompute=recompute, zero=1 if dp > 1 else 0, dtype=dtype)
                 for pp, dp in _meshes(n, tp, body, global_batch) for recompute in ("none", "full"))
        return _first_fitting(model, cluster, plans, f"no 3D layout of {n} GPUs (tp={tp})", global_batch, stack)
    raise ConfigError("variant", f"{variant!r} is not a DeepSpeed recipe", "choose 'zero3' or '3d'")
