"""Data dependencies between operator layouts: what a redistribution costs on the actual links.

Which collective a change of placement needs is part of the layouts' semantics
(:func:`autoplan.layouts.redistribute_kind`, DTensor's ``redistribute``); this module times
it with :func:`costmodel.comm.collective_time` over each group's own ranks, so a group
whose ranks sit on slower links (a heterogeneous cluster, a group across nodes) pays for
them, and charges a layer's implied collectives (:class:`autoplan.models.spec.Collective`).
"""
from __future__ import annotations

from typing import Sequence

from autoplan.cluster import Cluster
from autoplan.layouts import redistribute_kind
from autoplan.models.spec import LayerSpec
from costmodel.comm import collective_time


def redistribute_time(cluster: Cluster, groups: Sequence[Sequence[int]], nbytes: float, src: str,
                      dst: str) -> float:
    """Seconds to redistribute a tensor of ``nbytes`` (its full size) from ``src`` to ``dst``
    on every group in ``groups`` at once (the slowest group decides)."""
    kind = redistribute_kind(src, dst)
    if kind is None or nbytes <= 0:
        return 0.0
    return max((collective_time(cluster, g, nbytes, kind) for g in groups), default=0.0)


def layout_comm(cluster: Cluster, tp_groups: Sequence[Sequence[int]], layer: LayerSpec, micro_batch: int,
                pipeline_groups: Sequence[Sequence[int]] | None = None) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch of the collectives an operator-level layout
    implies for one layer (``LayerSpec.tp_collectives``; those scoped 'pipeline' run over every
    rank of the pipeline, for interlaced units). The family recipe's all-reduces
    (``tp_allreduces_fwd``) are the stage model's own."""
    fwd = bwd = 0.0
    for c in layer.tp_collectives:
        groups = pipeline_groups if c.scope == "pipeline" and pipeline_groups else tp_groups
        nbytes = c.nbytes * (micro_batch if c.batch_scaled else 1)
        t = max((collective_time(cluster, g, nbytes, c.kind) for g in groups), default=0.0)
        if c.phase == "forward":
            fwd += t
        else:
            bwd += t
    return fwd, bwd
