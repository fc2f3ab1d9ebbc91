"""Dynamic programming over contiguous layer splits.

Given the pipeline's device groups (a :class:`~search.evaluate.Skeleton`) and the
setting (micro-batch, schedule, ZeRO, ...), choose where every stage starts and ends and
how each stage recomputes, so that

* every group fits in its devices' memory, with the in-flight activations its position
  in the schedule implies (under 1F1B the first stage holds ``pp`` micro-batches, the
  last one), and
* the slowest stage is as fast as possible (the steady-state period of the pipeline);
  among the splits reaching that period, the total work is smallest (the fill/drain),
  and, when micro-batches are few, the period is traded against the total by scanning
  the next thresholds.

The cost of a stage on group ``g`` covering units ``[s, e)`` comes from
:class:`~search.tables.LayerTable` prefix sums, for all ``(s, e)`` at once as
``(units+1) x (units+1)`` matrices, so one DP step is a handful of numpy operations:
``best_j[e] = min_s max(best_{j-1}[s], cost_j[s, e])``. Embedding and head are units
like any other, so their cost lands on the first and last stage, whatever device runs it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from costmodel.memory import GRAD_BYTES_PER_PARAM
from search.evaluate import Setting, Skeleton
from search.inflight import inflight
from search.tables import DYNAMIC_FACTOR, OVERHEAD, RECOMPUTES, Tables

INF = np.inf


@dataclass
class Split:
    """A layer split chosen by the DP."""

    bounds: tuple[tuple[int, int], ...]
    """[start, end) units of every stage."""
    recompute: tuple[str, ...]
    """Recompute mode of every stage."""
    period: float
    """Largest per-micro-batch stage time (the DP's objective)."""
    total: float
    """Sum of per-micro-batch stage times."""


class Splitter:
    """Runs the DP; caches the per-(kind, setting) matrices it needs."""

    def __init__(self, tables: Tables):
        self.tables = tables
        self._time: dict = {}
        self._mem: dict = {}
        self.runs = 0
        """DP runs (for the search statistics)."""

    # ---------------------------------------------------------- matrices
    def _time_mats(self, sk: Skeleton, g: int, st: Setting) -> np.ndarray:
        """cost[q, s, e]: forward + backward seconds of units [s, e) on group g under
        recompute mode q, as the cost model composes them (ZeRO-3 gathers included)."""
        group, kind = sk.groups[g], sk.kinds[g]
        z3 = st.zero >= 3 and group.dp > 1
        key = (kind, st.micro_batch, st.sequence_parallel and kind.tp > 1, group if z3 else None, z3)
        hit = self._time.get(key)
        if hit is not None:
            return hit
        t = self.tables.table(kind, st.micro_batch, st.sequence_parallel)
        cf, cbw = t.cum_forward, t.cum_backward_weight
        fwd = cf[None, :] - cf[:, None]
        bw = cbw[None, :] - cbw[:, None]
        bi = t.cum_backward_input[:, None, :] - t.cum_backward_input[:, :, None]
        cost = fwd[None] + bi + bw[None]
        if z3:
            params = t.cum_params[None, :] - t.cum_params[:, None]
            gather = self.tables.dp_collective(group, params * self.tables.weight_bytes, "all_gather")
            scatter = self.tables.dp_collective(group, params * GRAD_BYTES_PER_PARAM, "reduce_scatter")
            f2 = np.maximum(fwd, gather)
            b = bi + bw[None]
            cost = f2[None] + b + np.maximum(0.0, (gather + scatter)[None] - b)
        n = t.units + 1
        upper = np.triu(np.ones((n, n), dtype=bool), 1)
        cost = np.where(upper[None], cost, INF)
        self._time[key] = cost
        return cost

    def _mem_mats(self, sk: Skeleton, g: int, st: Setting) -> tuple[np.ndarray, np.ndarray]:
        """(base[q, s, e], act[q, s, e]): bytes of units [s, e) on one GPU of group g that
        do not depend on the in-flight count (states, transient), and activation bytes
        per micro-batch; memory = OVERHEAD + DYNAMIC_FACTOR * (base + inflight * act)."""
        group, kind = sk.groups[g], sk.kinds[g]
        key = (kind, st.micro_batch, st.sequence_parallel and kind.tp > 1, group.dp, st.zero)
        hit = self._mem.get(key)
        if hit is not None:
            return hit
        t = self.tables.table(kind, st.micro_batch, st.sequence_parallel)
        params = t.cum_params[None, :] - t.cum_params[:, None]
        states = self.tables.state_bytes(params, t.max_params, group.dp, st.zero)
        base = states[None] + t.max_transient
        act = t.cum_activation[:, None, :] - t.cum_activation[:, :, None]
        self._mem[key] = (base, act)
        return base, act

    # --------------------------------------------------------------- DP
    def split(self, sk: Skeleton, st: Setting, modes: tuple[str, ...], objective: str = "time") -> Split | None:
        """Best split of the model over ``sk`` under ``st`` with per-stage recompute
        chosen from ``modes``; None when no split fits in memory.

        ``objective="memory"`` instead minimizes the largest memory-to-capacity ratio
        (used to report how far from fitting the leanest plan is)."""
        self.runs += 1
        P, v = sk.pp, st.virtual_stages
        S = P * v
        L = self.tables.model.num_layers
        if S > L:
            return None
        fl = inflight(st.schedule, P, st.num_micro_batches, v)
        qs = [RECOMPUTES.index(m) for m in modes]
        # Per stage: cost[s, e] (inf where it does not fit) and the recompute mode chosen.
        costs, choices = [], []
        for j in range(S):
            g, chunk = j % P, j // P
            cap = self.tables.cluster.groups[sk.kinds[g].pool].device.memory_bytes
            # With v chunks per group, each chunk gets 1/v of the group's budget (a
            # conservative separation; the exact joint peak is checked afterwards).
            budget = (cap - OVERHEAD) / DYNAMIC_FACTOR / v
            n_inflight = fl.per_chunk[g][chunk]
            tm = self._time_mats(sk, g, st)
            base, act = self._mem_mats(sk, g, st)
            best = np.full(tm.shape[1:], INF)
            pick = np.zeros(tm.shape[1:], dtype=np.int8)
            for q in qs:
                need = base[q] + n_inflight * act[q]
                if objective == "memory":
                    val = np.where(np.isfinite(tm[q]), need / budget, INF)
                else:
                    val = np.where(need <= budget, tm[q], INF)
                better = val < best
                best = np.where(better, val, best)
                pick = np.where(better, q, pick)
            costs.append(best)
            choices.append(pick)
        res = _minmax(costs, L)
        if res is None:
            return None
        period, _ = res
        cands = [period]
        m = st.num_micro_batches
        if objective == "time" and m < 4 * P:
            # Few micro-batches: the fill (sum of stage times) weighs like a few periods,
            # so a slightly slower period with less total work can win.
            vals = np.unique(np.concatenate([c[np.isfinite(c) & (c > period)] for c in costs]))
            cands += list(vals[:6])
        best_obj, best_split = INF, None
        for tau in cands:
            found = _minsum(costs, L, tau)
            if found is None:
                continue
            total, bounds = found
            real_period = max(costs[j][a, b] for j, (a, b) in enumerate(bounds))
            obj = (m - 1) * real_period + total if objective == "time" else real_period
            if obj < best_obj * (1 - 1e-12):
                best_obj = obj
                rec = tuple(RECOMPUTES[int(choices[j][a, b])] for j, (a, b) in enumerate(bounds))
                best_split = Split(bounds=tuple(bounds), recompute=rec, period=real_period, total=total)
        return best_split


def _minmax(costs: list[np.ndarray], L: int) -> tuple[float, list] | None:
    """Smallest achievable max_j cost_j over contiguous splits of L units into len(costs)
    non-empty stages."""
    best = np.full(L + 1, INF)
    best[0] = 0.0
    for c in costs:
        m = np.maximum(best[:, None], c)
        best = m.min(axis=0)
    if not np.isfinite(best[L]):
        return None
    return float(best[L]), []


def _minsum(costs: list[np.ndarray], L: int, cap: float) -> tuple[float, list] | None:
    """Smallest sum of stage costs with every stage at most ``cap``; returns (sum, bounds).
    Ties go to the earliest boundary (np.argmin), so results are deterministic."""
    limit = cap * (1 + 1e-9)
    best = np.full(L + 1, INF)
    best[0] = 0.0
    back = []
    for c in costs:
        cc = np.where(c <= limit, c, INF)
        m = best[:, None] + cc
        arg = m.argmin(axis=0)
        best = m[arg, np.arange(L + 1)]
        back.append(arg)
    if not np.isfinite(best[L]):
        return None
    bounds = []
    e = L
    for arg in reversed(back):
        s = int(arg[e])
        bounds.append((s, e))
        e = s
    bounds.reverse()
    return float(best[L]), bounds
