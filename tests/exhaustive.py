"""An exhaustive enumeration of the plans the search can express, timed by the full cost
model: the reference the search's guarantee test compares against.

Deliberately independent of ``search``: it imports nothing from it, restates the space in
plain loops, and times every plan with ``costmodel.estimate``. Slow by design (every
contiguous split, every per-stage recompute assignment); use it on small cases only.

The space (what ``search.search`` documents, docs/search.md "What is searched"):

* device groups: on one node group, ``pp`` groups of ``dp x tp`` consecutive ranks in
  Megatron order (tensor parallel fastest, then data, then pipeline); on several node
  groups, each node group serves at most one run of consecutive pipeline positions, all of
  one tensor-parallel degree (dividing its node), the runs in any order, each group taking
  the next ``dp x tp`` ranks of its node group;
* tensor-parallel degrees the model's heads allow within the largest node; data-parallel
  degrees dividing the global batch; pipelines of 1 .. ``min(units, max_stages)`` groups;
* micro-batch: divisors of the per-replica batch up to ``max_micro_batch``;
* schedules: every allowed one when there is a pipeline (interleaved-1f1b with 2 ..
  ``max_virtual_stages`` chunks when the micro-batches divide by ``pp``); one stage runs
  plain gradient accumulation, labelled 1F1B;
* context parallelism (one node group only): cp = 1, and each cp splitting the sequence
  into parts of at least ``min_cp_tokens`` tokens (or the ``cp`` given), ranks ``tp``
  fastest then ``cp`` then ``dp`` in a group, with every exchange the sequence and heads
  allow (rings: 2*cp chunks on causal models and fused attention; a2a: whole heads per rank);
* ZeRO stages (only the smallest without data or context parallelism), sequence
  parallelism (only with tensor parallelism);
* expert-parallel degrees: divisors of dp x cp that divide the model's experts (1 for a
  dense model);
* every contiguous split of the units into ``pp x v`` non-empty stages, and every
  assignment of an allowed recompute mode to every stage.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from autoplan.cluster import Cluster
from autoplan.models.spec import ModelSpec
from autoplan.plan import CP_COMMS, SCHEDULES, DeviceGroup, Plan, Stage
from costmodel import estimate


@dataclass(frozen=True)
class Space:
    """The constraints both the search and the enumeration are given."""

    schedules: tuple[str, ...] = SCHEDULES
    recompute: tuple[str, ...] = ("none", "selective", "full")
    zero: tuple[int, ...] = (0, 1, 2, 3)
    sequence_parallel: tuple[bool, ...] = (False, True)
    max_micro_batch: int = 16
    max_virtual_stages: int = 4
    max_stages: int = 32
    pp: tuple[int, ...] | None = None
    tp: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = None
    cp_comm: tuple[str, ...] = CP_COMMS
    min_cp_tokens: int = 4096
    ep: tuple[int, ...] | None = None

    def search_kwargs(self) -> dict:
        out = dict(schedules=list(self.schedules), recompute=list(self.recompute), zero=list(self.zero),
                   sequence_parallel=list(self.sequence_parallel), max_micro_batch=self.max_micro_batch,
                   max_virtual_stages=self.max_virtual_stages, max_stages=self.max_stages)
        if self.pp is not None:
            out["pp"] = list(self.pp)
        if self.tp is not None:
            out["tp"] = list(self.tp)
        if self.cp is not None:
            out["cp"] = list(self.cp)
        out["cp_comm"] = list(self.cp_comm)
        out["min_cp_tokens"] = self.min_cp_tokens
        if self.ep is not None:
            out["ep"] = list(self.ep)
        return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _splits(units: int, stages: int):
    for cuts in itertools.combinations(range(1, units), stages - 1):
        edges = (0, *cuts, units)
        yield [(edges[i], edges[i + 1]) for i in range(stages)]


def pipelines(model: ModelSpec, cluster: Cluster, global_batch: int, space: Space):
    """Every sequence of device groups (one per pipeline position) in the space."""
    gpn = max(g.gpus_per_node for g in cluster.groups)
    tps = [t for t in model.tp_degrees(gpn) if space.tp is None or t in space.tp]
    longest = min(model.num_layers, space.max_stages if len(cluster.groups) > 1 else model.num_layers)
    depths = [p for p in range(1, longest + 1) if space.pp is None or p in space.pp]
    n = cluster.num_gpus
    for dp in [d for d in _divisors(global_batch) if d <= n]:
        if len(cluster.groups) == 1:
            per_node = cluster.groups[0].gpus_per_node
            for tp in tps:
                for cp in _cps(model, n // tp, space):
                    for pp in depths:
                        per = tp * cp * dp
                        if per_node % tp or per * pp > n:
                            continue
                        yield tuple(DeviceGroup(tuple(range(p * per, (p + 1) * per)), tp, cp) for p in range(pp))
            continue
        # One run per node group (absent, or n groups of one tp), in any order.
        runs = []
        for k, ng in enumerate(cluster.groups):
            options = [None] + [(k, t, count) for t in tps if ng.gpus_per_node % t == 0
                                for count in range(1, ng.num_gpus // (dp * t) + 1)]
            runs.append(options)
        for choice in itertools.product(*runs):
            used = [r for r in choice if r is not None]
            if not used or sum(c for _, _, c in used) not in depths:
                continue
            for order in itertools.permutations(used):
                groups = []
                for k, t, count in order:
                    first = cluster.group_ranks(k).start
                    for i in range(count):
                        groups.append(DeviceGroup(tuple(range(first + i * dp * t, first + (i + 1) * dp * t)), t))
                yield tuple(groups)


def _cps(model: ModelSpec, most: int, space: Space) -> list[int]:
    """Context-parallel degrees: 1 and those leaving every rank min_cp_tokens (or the given)."""
    if not model.heads:
        return [1]
    return [c for c in range(1, most + 1)
            if (c in space.cp if space.cp is not None else c == 1 or model.seq_len // c >= space.min_cp_tokens)]


def _exchanges(model: ModelSpec, groups: tuple[DeviceGroup, ...], space: Space) -> list[str]:
    """The context-parallel exchanges a pipeline may use (one label without cp)."""
    cp, tp = groups[0].cp, groups[0].tp
    if cp == 1:
        return ["p2p"]
    causal = any(l.causal for l in model.layers)
    fused = any(l.attention_flops_fwd.total > 0 for l in model.layers)
    out = []
    for comm in space.cp_comm:
        if comm == "a2a":
            if model.seq_len % cp == 0 and all(max(h // tp, 1) % cp == 0
                                               for h in (model.heads, model.kv_heads or model.heads)):
                out.append(comm)
        elif fused and model.seq_len % (2 * cp if causal else cp) == 0:
            out.append(comm)
    return out


def settings(model: ModelSpec, groups: tuple[DeviceGroup, ...], global_batch: int, space: Space):
    """(micro-batch, micro-batches, schedule, chunks, ZeRO, sequence parallel, context
    exchange) for a pipeline."""
    pp, dp = len(groups), groups[0].dp
    per_replica = global_batch // dp
    if pp == 1:
        flat = [s for s in space.schedules if s != "interleaved-1f1b"]
        schedules = ["1f1b"] if "1f1b" in flat else flat[:1]
    else:
        schedules = list(space.schedules)
    zeros = space.zero if dp * groups[0].cp > 1 else (min(space.zero),)
    sps = space.sequence_parallel if any(g.tp > 1 for g in groups) else (min(space.sequence_parallel),)
    for b in [x for x in _divisors(per_replica) if x <= space.max_micro_batch]:
        m = per_replica // b
        for schedule in schedules:
            if schedule != "interleaved-1f1b":
                chunks = [1]
            else:
                chunks = [v for v in range(2, space.max_virtual_stages + 1)
                          if pp > 1 and m % pp == 0 and pp * v <= model.num_layers]
            for v, zero, sp, comm in itertools.product(chunks, zeros, sps, _exchanges(model, groups, space)):
                yield b, m, schedule, v, zero, sp, comm


def expert_degrees(model: ModelSpec, shards: int, space: Space) -> list[int]:
    """Expert-parallel degrees over ``shards`` = dp x cp ranks."""
    return [e for e in _divisors(shards) if (e == 1 or (model.num_experts and model.num_experts % e == 0))
            and (space.ep is None or e in space.ep)]


def best_plan(model: ModelSpec, cluster: Cluster, global_batch: int, space: Space):
    """(iteration seconds, plan, plans timed) of the fastest plan that leaves the memory margin
    free, or where none does of the fastest that fits at all (tight), as the search ranks
    them (docs/search.md); (None, None, n) when nothing fits."""
    best = {False: (None, None), True: (None, None)}   # (by tightness)
    count = 0
    L = model.num_layers
    for groups in pipelines(model, cluster, global_batch, space):
        pp = len(groups)
        for (b, m, schedule, v, zero, sp, comm), ep in itertools.product(
                settings(model, groups, global_batch, space),
                expert_degrees(model, groups[0].dp * groups[0].cp, space)):
            for split in _splits(L, pp * v):
                for modes in itertools.product(space.recompute, repeat=pp * v):
                    stages = tuple(Stage(a, e, j % pp, r) for j, ((a, e), r) in enumerate(zip(split, modes)))
                    plan = Plan(groups=groups, stages=stages, micro_batch=b, num_micro_batches=m,
                                schedule=schedule, virtual_stages=v, sequence_parallel=sp, zero=zero, ep=ep,
                                dtype=model.dtype, model=model.name, seq_len=model.seq_len, cp_comm=comm)
                    est = estimate(model, cluster, plan)
                    count += 1
                    t = best[est.tight][0]
                    if est.fits and (t is None or est.iteration_time_s < t):
                        best[est.tight] = (est.iteration_time_s, plan)
    best_t, best_p = best[False] if best[False][0] is not None else best[True]
    return best_t, best_p, count
