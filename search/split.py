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
:class:`~search.tables.LayerTable` prefix sums. The DP keeps, per stage, a band of
``K x (units + 1)`` costs indexed by the stage's length ``d`` and end ``e`` (``K``: the
longest stage that can still beat the caller's period limit), so one DP step is a few
numpy operations: ``best_j[e] = min_d max(best_{j-1}[e - d], cost_j[e - d, e])``. The
length is the leading axis: the minimum over it is then an elementwise minimum of
contiguous rows, several times faster for these small arrays than a reduction along a
short trailing axis.
Embedding and head are units like any other, so their cost lands on the first and last
stage, whatever device runs it.

Interleaved schedules (``v`` chunks per group) are balanced per *group*, not per
chunk: besides the chunk DP, a water-filling split gives every group a share of the
units in proportion to its speed and spreads it over the group's chunks; the caller
keeps whichever the closed-form time prefers.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from search.evaluate import Setting, Skeleton
from search.inflight import inflight
from search.tables import RECOMPUTES, Tables

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
        self.L = tables.model.num_layers
        self._time: dict = {}
        self._mem: dict = {}
        self._band: dict = {}
        self._bands: dict = {}
        self._reserve: dict = {}
        self._free: dict = {}
        self._shares: dict = {}
        self._shortest: dict = {}
        self._memo: dict = {}
        self._inputs: dict = {}
        self.runs = 0
        """DP runs (for the search statistics; splits shared from the cache not counted)."""
        self.unreached = 0
        """DPs found to have no answer without running them (see _out_of_reach)."""

    # ---------------------------------------------------------- matrices
    def _time_mats(self, sk: Skeleton, g: int, st: Setting) -> np.ndarray:
        """cost[q, s, e]: forward + backward seconds of units [s, e) on group g under
        recompute mode q, as the cost model composes them (ZeRO-3 gathers included)."""
        group, kind = sk.groups[g], sk.kinds[g]
        z3 = st.zero >= 3 and group.dp * group.cp > 1
        # Under ZeRO-3 the cost depends on the group only through its collectives' costs.
        comm = (self.tables.dp_affines(group, "all_gather"), self.tables.dp_affines(group, "reduce_scatter")) \
            if z3 else None
        key = (kind, st.micro_batch, st.sequence_parallel and kind.tp > 1, comm, self.tables.traffic(sk, st, g))
        hit = self._time.get(key)
        if hit is not None:
            return hit
        t = self.tables.table(kind, st.micro_batch, st.sequence_parallel, (sk, st, g))
        cf, cbw = t.cum_forward, t.cum_backward_weight
        fwd = cf[None, :] - cf[:, None]
        bw = cbw[None, :] - cbw[:, None]
        bi = t.cum_backward_input[:, None, :] - t.cum_backward_input[:, :, None]
        cost = fwd[None] + bi + bw[None]
        if z3:
            params = t.cum_params[None, :] - t.cum_params[:, None]
            stack = self.tables.stack
            gather = self.tables.dp_collective(group, params * stack.gathered_weights_bytes_per_param, "all_gather")
            scatter = self.tables.dp_collective(group, params * stack.grad_reduce_bytes_per_param, "reduce_scatter")
            f2 = np.maximum(fwd, gather)
            on_compute, beside = self.tables.zero3_copy_rates(kind.pool)
            b = bi + bw[None] + (params * on_compute)[None]
            cost = f2[None] + b + np.maximum(0.0, (gather + scatter + params * beside)[None] - b)
        n = t.units + 1
        upper = np.triu(np.ones((n, n), dtype=bool), 1)
        cost = np.where(upper[None], cost, INF)
        self._time[key] = cost
        return cost

    def _mem_mats(self, sk: Skeleton, g: int, st: Setting) -> tuple[np.ndarray, np.ndarray]:
        """(base[q, s, e], act[q, s, e]): bytes of units [s, e) on one GPU of group g that
        do not depend on the in-flight count (states, transient), and activation bytes
        per micro-batch, both with the allocator's fragmentation on the dynamic part;
        memory = fixed + base + inflight * act (``Tables.memory_total``)."""
        group, kind = sk.groups[g], sk.kinds[g]
        cast_field = self.tables.cast_field(sk, st, g)
        key = (kind, st.micro_batch, st.sequence_parallel and kind.tp > 1, _sharding(group, st), st.zero, cast_field)
        hit = self._mem.get(key)
        if hit is not None:
            return hit
        t = self.tables.table(kind, st.micro_batch, st.sequence_parallel)
        dyn = self.tables.dynamic_factor
        params = t.cum_params[None, :] - t.cum_params[:, None]
        sharded = t.cum_zero_params[None, :] - t.cum_zero_params[:, None]
        cum_cast = getattr(t, cast_field)
        cast = cum_cast[None, :] - cum_cast[:, None]
        states = self.tables.state_bytes(params, t.max_params, group.dp * group.cp, st.zero, sharded)
        base = states[None] + dyn * (t.max_transient + self.tables.cast_bytes(cast, group.dp * group.cp, st.zero)[None])
        act = dyn * (t.cum_activation[:, None, :] - t.cum_activation[:, :, None])
        self._mem[key] = (base, act)
        return base, act

    def _step_mats(self, sk: Skeleton, g: int, st: Setting) -> np.ndarray:
        """floor[q, s, e]: bytes of units [s, e) on one GPU of group g during the optimizer
        step (states plus the step's temporaries, with fragmentation), whatever the in-flight
        count: a rank's peak is the larger of this and the compute phase's
        ``base + inflight * act`` (``Tables.memory_total``)."""
        group, kind = sk.groups[g], sk.kinds[g]
        key = ("step", kind, st.micro_batch, st.sequence_parallel and kind.tp > 1, _sharding(group, st), st.zero)
        hit = self._mem.get(key)
        if hit is None:
            t = self.tables.table(kind, st.micro_batch, st.sequence_parallel)
            shards = group.dp * group.cp
            params = t.cum_params[None, :] - t.cum_params[:, None]
            sharded = t.cum_zero_params[None, :] - t.cum_zero_params[:, None]
            floor = self.tables.state_bytes(params, t.max_params, shards, st.zero, sharded) \
                + self.tables.dynamic_factor * self.tables.step_bytes(params, shards, st.zero, sharded)
            hit = self._mem[key] = np.broadcast_to(floor, (len(RECOMPUTES),) + floor.shape)
        return hit

    def _index(self, K: int) -> tuple[np.ndarray, np.ndarray]:
        """(start[d, e], valid[d, e]) for the band of stages of length d+1 ending at e."""
        hit = self._band.get(K)
        if hit is None:
            e = np.arange(self.L + 1)[None, :]
            d = np.arange(1, K + 1)[:, None]
            s = e - d
            hit = self._band[K] = (np.maximum(s, 0), s >= 0)
        return hit

    # --------------------------------------------------------------- DP
    def split(self, sk: Skeleton, st: Setting, modes: tuple[str, ...], objective: str = "time",
              period_limit: float = INF, joint: bool = False) -> Split | None:
        """Best split of the model over ``sk`` under ``st`` with per-stage recompute
        chosen from ``modes``; None when no split fits in memory (or none has every stage
        under ``period_limit`` seconds per micro-batch, when one is given).

        ``objective="memory"`` instead minimizes the largest memory-to-capacity ratio
        (used to report how far from fitting the leanest plan is, and to find a split that
        fits at all), over stages under ``period_limit``.

        With v > 1 chunks per group, each chunk gets a share of its group's budget and an
        in-flight count: the most it ever holds (``joint=False``, always sufficient) or its
        count at the group's peak for equal chunks (``joint=True``, tighter; the caller
        checks the exact joint peak).

        The memory-free split comes first (every stage in the fastest mode; on a pipeline
        of one device kind it depends only on the kind, micro-batch and stage count, so it
        is computed once and shared by every data-parallel degree, ZeRO stage and schedule
        with those). Where it fits the setting's budgets it is the answer: it has the least
        period any split can have. Where memory binds, its period starts the constrained
        DP's band narrow (see below)."""
        if objective != "time":
            return self._split_dp(sk, st, modes, objective, period_limit, joint)

        free = self._unconstrained(sk, st, modes, period_limit)
        if free is None or free.period > period_limit * (1 + 1e-12):
            return None
        if self._fits(sk, st, modes, free, joint):
            return free
        # Memory binds: the constrained DP's least period is at least the free one. Stages
        # are first limited to runs costing at most a little more than it (a narrow band,
        # cheap); a split found under that limit is optimal, as every longer stage would
        # cost more. Otherwise the DP runs under the caller's limit: it finds the same least
        # period, and it weighs a superset of the period/total trade-offs a narrower band
        # would, so narrower retries could not do better by the DP's own objective.
        limit = free.period * 1.25
        if limit < period_limit:
            found = self._split_dp(sk, st, modes, objective, limit, joint)
            if found is not None:
                return found
        return self._split_dp(sk, st, modes, objective, period_limit, joint)

    def free_period(self, sk: Skeleton, st: Setting, modes: tuple[str, ...]) -> float:
        """The least period (slowest stage, seconds per micro-batch) any split of ``sk``
        can have under ``st``, memory aside (INF: the model does not split that finely)."""
        free = self._unconstrained(sk, st, modes)
        return INF if free is None else free.period

    def _unconstrained(self, sk: Skeleton, st: Setting, modes: tuple[str, ...],
                       period_limit: float = INF) -> Split | None:
        """The DP's split with unlimited memory and the fastest mode (cached), or None when
        no split has every stage under ``period_limit``."""
        v = st.virtual_stages
        z3 = st.zero >= 3 and sk.shards > 1
        # Under ZeRO-3 the stage times depend on each group's collectives.
        comm = tuple((self.tables.dp_affines(g, "all_gather"), self.tables.dp_affines(g, "reduce_scatter"))
                     for g in sk.groups) if z3 else None
        sp = st.sequence_parallel and any(k.tp > 1 for k in sk.kinds)
        # Without memory the DP takes the least period, and the least total among the
        # splits reaching it: the micro-batch count, which would only trade one against the
        # other, is left out (except under ZeRO-3 with few micro-batches, where the DP scans
        # the trade). Mixed pipelines are cached the same way (keyed by their kinds in order).
        m = st.num_micro_batches
        if len(set(sk.kinds)) == 1 and (comm is None or len(set(comm)) == 1):
            # One kind (and, under ZeRO-3, one set of collectives) on every group: every
            # stage costs alike, so the split depends on the number of stages alone, not on
            # the depth and chunk count that make it.
            shape = (sk.kinds[0], sk.pp * v, comm[0] if comm else None)
        else:
            shape = (sk.kinds, v, comm)
        key = (shape, st.micro_batch, sp, modes[0], m if z3 and m < 4 * sk.pp else None)
        # Cached with the period limit it was computed under: a split within that limit is
        # the least period under any limit; "none within this limit" (None, or a split
        # over it) also holds for every smaller limit.
        hit = self._free.get(key)
        exact = hit is not None and hit[0] is not None and hit[0].period <= hit[1]
        if hit is None or (not exact and period_limit > hit[1]):
            hit = self._free[key] = (self._split_dp(sk, st, modes[:1], "time", period_limit, False, unlimited=True),
                                     period_limit)
        return hit[0]

    def free_split_fits(self, sk: Skeleton, st: Setting, modes: tuple[str, ...]) -> bool:
        """Whether the memory-free split (see free_period) fits the budgets the DP gives its
        stages: then it is the DP's answer, and no split that fits has a smaller period."""
        free = self._unconstrained(sk, st, modes)
        return free is not None and self._fits(sk, st, modes, free, joint=False)

    def _fits(self, sk: Skeleton, st: Setting, modes: tuple[str, ...], split: Split, joint: bool) -> bool:
        """Whether every stage of ``split`` (fastest mode) fits the budget the DP gives it."""
        P, v = sk.pp, st.virtual_stages
        q = RECOMPUTES.index(modes[0])
        if v == 1:
            counts = inflight(st.schedule, P, st.num_micro_batches, v).per_chunk
        else:
            counts, budgets = self.chunk_budgets(sk, st, modes, joint)
        for j, (a, e) in enumerate(split.bounds):
            g, chunk = j % P, j // P
            if v == 1:
                pool = sk.kinds[g].pool
                budget = self.tables.capacity(pool) - self.tables.fixed_bytes(pool, sk.groups[g], P, sk.ep)
                base, act = self._mem_mats(sk, g, st)
                if self._step_mats(sk, g, st)[q][a, e] > budget:
                    return False
            else:
                budget = budgets[g][chunk]
                base, act = self._states_mats(sk, g, st)
            if base[q][a, e] + counts[g][chunk] * act[q][a, e] > budget:
                return False
        return True

    def _split_dp(self, sk: Skeleton, st: Setting, modes: tuple[str, ...], objective: str = "time",
                  period_limit: float = INF, joint: bool = False, unlimited: bool = False) -> Split | None:
        """The DP itself (see :meth:`split`); ``unlimited`` ignores memory."""
        P, v = sk.pp, st.virtual_stages
        S = P * v
        L = self.L
        if S > L:
            return None
        qs = [RECOMPUTES.index(m) for m in modes]
        K = L - S + 1
        time_ms, per_group = self._group_inputs(sk, st, qs, unlimited)
        if unlimited:
            # The even split (unit counts differing by at most one) bounds the least
            # period from above: no stage of the optimum costs more than it does.
            edges = [round(i * L / S) for i in range(S + 1)]
            even = max(float(time_ms[j % P][qs[0]][a, e]) for j, (a, e) in enumerate(zip(edges, edges[1:])))
            period_limit = min(period_limit, even * (1 + 1e-9))
        if np.isfinite(period_limit):
            # No stage may be longer than the shortest run of units that already exceeds
            # the limit on the fastest group. (shortest[d]: the cheapest run of d + 1 units
            # on any of the groups; it depends only on the groups' matrices, so it is
            # kept, at full width, for the next DP over them.)
            key = (frozenset(id(m) for m in time_ms), qs[0])
            shortest = self._shortest.get(key)
            if shortest is None:
                fastest = np.minimum.reduce([m[qs[0]] for m in {id(m): m for m in time_ms}.values()])
                start_k, valid_k = self._index(L)
                shortest = self._shortest[key] = np.where(
                    valid_k, fastest[start_k, np.arange(L + 1)[None, :]], INF).min(axis=1)
            over = np.nonzero(shortest[:K] > period_limit)[0]
            if len(over):
                K = int(over[0])
            if K < 1:
                return None
        start, valid = self._index(K)
        ends = np.arange(L + 1)[None, :]
        if not unlimited:
            fl = inflight(st.schedule, P, st.num_micro_batches, v)
            counts = fl.joint if joint else fl.per_chunk
            shares = self._chunk_shares(sk, st, counts)
        mode_key = tuple(qs)

        def band(mats: np.ndarray, fill: float) -> np.ndarray:
            """The band view (stage of d + 1 units ending at e) of a cached matrix, for
            the modes allowed: built once at full width, then sliced to this DP's K."""
            key = (id(mats), mode_key)
            hit = self._bands.get(key)
            if hit is None or hit[0] is not mats:
                full_start, full_valid = self._index(L)
                # (Only the modes allowed are gathered: the memory-free DP reads one.)
                picked = mats if mode_key == (0, 1, 2) else mats[qs]
                hit = self._bands[key] = (mats, np.where(full_valid[None], picked[:, full_start, ends], fill))
            return hit[1][:, :K]

        # Stages on groups with the same matrices are costed together: cost[d, e] (inf
        # where it does not fit) and the recompute mode chosen, for every stage at once;
        # stages with the same in-flight count and budget share one computation.
        alike: dict = {}
        for j in range(S):
            g, chunk = j % P, j // P
            time_m, base, act, floor, room = per_group[g]
            if unlimited:
                alike.setdefault((id(time_m),), (time_m, None, None, None, {}))[4].setdefault(None, []).append(j)
                continue
            budget = room if v == 1 else room * shares[g][chunk]
            entry = alike.setdefault((id(time_m), id(base), id(act), id(floor)), (time_m, base, act, floor, {}))
            entry[4].setdefault((counts[g][chunk], budget), []).append(j)
        # Every input of the DP is in ``alike`` (cached matrices, by identity, and each
        # stage's in-flight count and budget): skeletons and settings that differ in nothing
        # it reads (other data-parallel degrees without ZeRO, other micro-batch counts past
        # a few per stage) share its result. With one candidate period the result does
        # not depend on the period limit beyond it (see _recall).
        memo_key = None
        one_period = objective == "time" and not (st.num_micro_batches < 4 * P
                                                  and (st.zero >= 3 and sk.shards > 1 or not unlimited))
        if one_period and not unlimited:
            memo_key = (S, mode_key, tuple((k, tuple((r, tuple(js)) for r, js in e[4].items()))
                                           for k, e in alike.items()))
            remembered = self._recall(memo_key, period_limit)
            if remembered is not False:
                return remembered
        if objective == "time" and not unlimited \
                and self._out_of_reach(per_group, counts, shares, st, qs, period_limit):
            self.unreached += 1
            if memo_key is not None:
                self._memo[memo_key] = (None, period_limit)
            return None
        self.runs += 1
        # Stages costed alike share one band: costs[which[j]] is stage j's (K, L + 1) band
        # of costs, so the recurrences below prepare each band once, however many stages
        # read it.
        cost_parts = []
        which = [0] * S
        inputs: list = [None] * S   # (what each stage's mode is chosen from, see mode_of)
        limited = np.isfinite(period_limit)
        for time_m, base, act, floor, rows in alike.values():
            t_band = band(time_m, INF)                           # (modes, K, L + 1)
            if unlimited:
                for j in rows[None]:
                    which[j] = len(cost_parts)
                cost_parts.append(t_band[:1])
                continue
            keys = list(rows)
            n = np.array([k[0] for k in keys], dtype=float)[:, None, None]
            cap_j = np.array([k[1] for k in keys])[:, None, None]
            base_b, act_b = band(base, 0.0), band(act, 0.0)
            floor_b = band(floor, 0.0) if floor is not None else None
            if objective == "time":
                # The time objective keeps only the least time over the modes that fit;
                # which mode gives it is worked out for the chosen stages alone (see
                # mode_of), the one place it is read.
                best = np.full((len(keys),) + t_band.shape[1:], INF)
                need = np.empty(best.shape)
                fits = np.empty(best.shape, dtype=bool)
                for i, q in enumerate(qs):
                    np.multiply(n, act_b[i][None], out=need)
                    np.add(base_b[i][None], need, out=need)
                    if floor_b is not None:
                        # The optimizer step's temporaries can outgrow the compute phase's.
                        np.maximum(need, floor_b[i][None], out=need)
                    t_i = t_band[i]
                    if limited:
                        t_i = np.where(t_i <= period_limit, t_i, INF)
                    np.less_equal(need, cap_j, out=fits)
                    # (Where it does not fit, the mode leaves the least as it is.)
                    np.minimum(best, t_i[None], out=best, where=fits)
                for r, k in enumerate(keys):
                    for j in rows[k]:
                        which[j] = sum(len(c) for c in cost_parts) + r
                        inputs[j] = (t_band, base_b, act_b, floor_b, float(k[0]), k[1])
                cost_parts.append(best)
                continue
            no_room = [r for r, k in enumerate(keys) if not k[1] > 0]
            safe_cap = np.where(cap_j > 0, cap_j, 1.0)
            best = None
            need = np.empty((len(keys),) + t_band.shape[1:])
            for i, q in enumerate(qs):
                np.multiply(n, act_b[i][None], out=need)
                np.add(base_b[i][None], need, out=need)
                if floor_b is not None:
                    np.maximum(need, floor_b[i][None], out=need)
                # A device with no budget left (cap 0) takes nothing: any need is
                # infinite there, and 0/0 must not become NaN.
                val = need / safe_cap
                for r in no_room:
                    val[r] = np.where(need[r] > 0, INF, 0.0)
                if limited:
                    np.copyto(val, INF, where=t_band[i] > period_limit)
                # The least over the modes; which mode gives it (the first of equals, the
                # fastest) is worked out for the chosen stages alone (see mode_of).
                if best is None:
                    best = val
                else:
                    np.minimum(best, val, out=best)
            for r, k in enumerate(keys):
                for j in rows[k]:
                    which[j] = sum(len(c) for c in cost_parts) + r
                    inputs[j] = (t_band, base_b, act_b, floor_b, float(k[0]), k[1])
            cost_parts.append(best)
        costs = cost_parts[0] if len(cost_parts) == 1 else np.concatenate(cost_parts)

        def mode_of(j: int, e: int, d: int) -> int:
            """Recompute mode of stage j ending at e with d units: the first allowed mode
            with the least time among those that fit (memory objective: the least share of
            the budget), as the arrays above would say, by the same arithmetic on the one
            element."""
            if unlimited:
                return qs[0]   # (memory aside, every stage runs the one mode it is given)
            t_band, base_b, act_b, floor_b, count, cap = inputs[j]
            pick, least = qs[0], INF
            for i, q in enumerate(qs):
                need = base_b[i][d - 1, e] + count * act_b[i][d - 1, e]
                if floor_b is not None:
                    need = max(need, floor_b[i][d - 1, e])
                t = t_band[i][d - 1, e]
                if limited and not t <= period_limit:
                    t = INF
                if objective == "time":
                    val = t if need <= cap else INF
                elif limited and t == INF:
                    val = INF
                elif cap > 0:
                    val = need / cap
                else:
                    val = INF if need > 0 else 0.0   # (no budget: as the arrays' no-room rows)
                if val < least:
                    pick, least = q, val
            return pick
        period = _minmax(costs, which, start, valid, L)
        if period is None:
            if memo_key is not None:
                self._memo[memo_key] = (None, period_limit)
            return None
        m = st.num_micro_batches
        # (Without memory, on one kind, in one mode, only ZeRO-3 makes totals differ.)
        z3 = st.zero >= 3 and sk.shards > 1
        slower = ()
        if objective == "time" and m < 4 * P and (z3 or not unlimited):
            # Few micro-batches: the fill (sum of stage times) weighs like a few periods,
            # so a slightly slower period with less total work can win.
            slower = np.unique(costs[np.isfinite(costs) & (costs > period)])
        found = _least_objective(costs, which, start, valid, L, period, slower,
                                 m - 1 if objective == "time" else None)
        best_split = None
        if found is not None:
            total, picks, real_period = found
            rec = tuple(RECOMPUTES[mode_of(j, e, d)] for j, (e, d) in enumerate(picks))
            best_split = Split(bounds=tuple((e - d, e) for e, d in picks), recompute=rec, period=real_period,
                               total=total)
        if memo_key is not None:
            self._memo[memo_key] = (best_split, period_limit)
        return best_split

    def _group_inputs(self, sk: Skeleton, st: Setting, qs: list[int], unlimited: bool) -> tuple[list, list]:
        """(time matrix per group, per group (time, base, activation, step-floor matrices,
        memory room)) for the DP: what a stage needs depends on its group (and, through the
        budget share and the in-flight count, on its chunk), so the group's matrices are
        looked up once. Kept per skeleton (by identity) and what they depend on of the
        setting: the DPs of one skeleton's candidates read them again and again."""
        P, v = sk.pp, st.virtual_stages
        # (The memory room depends on the tables' margin, which a search may drop.)
        key = (id(sk), st.micro_batch, st.sequence_parallel, st.zero, v, tuple(qs), unlimited,
               self.tables.margin)
        hit = self._inputs.get(key)
        if hit is not None and hit[0] is sk:
            return hit[1], hit[2]
        time_ms = [self._time_mats(sk, g, st) for g in range(P)]
        per_group = []
        for g in range(P):
            time_m = time_ms[g]
            if unlimited:
                per_group.append((time_m, None, None, None, 0.0))
                continue
            pool = sk.kinds[g].pool
            cap = self.tables.capacity(pool) - self.tables.fixed_bytes(pool, sk.groups[g], P, sk.ep)
            if v == 1:
                base, act = self._mem_mats(sk, g, st)
                per_group.append((time_m, base, act, self._step_mats(sk, g, st), cap))
            else:
                # A group's chunks share its memory, but its transient peak happens once:
                # set aside the largest transient the group can see, split the rest.
                base, act = self._states_mats(sk, g, st)
                per_group.append((time_m, base, act, None, cap - self.tables.dynamic_factor
                                  * self._transient_reserve(sk, g, st, qs)))
        self._inputs[key] = (sk, time_ms, per_group)
        return time_ms, per_group

    def _out_of_reach(self, per_group: list, counts, shares, st: Setting, qs: list[int],
                      period_limit: float) -> bool:
        """Whether no split can have every stage fit (and cost at most ``period_limit``),
        proved without the DP. A stage's memory and time only grow with its run (prefix
        sums and range maxima of non-negative terms, correctly rounded), so a run inside
        one that fits fits too. Let h be the furthest any split's first j - 1 stages can
        end; a fitting stage j = [a, e) with a <= h either ends by h or contains [h, e),
        which then fits: so stage j ends by h or by the longest fitting run from h. Where
        this bound stays short of the last unit after every stage, nothing fits. The same
        arithmetic as the DP's, so it never rules out a split the DP finds."""
        P, v, L = len(per_group), st.virtual_stages, self.L
        limited = np.isfinite(period_limit)
        every = qs == list(range(len(RECOMPUTES)))
        # (Basic slices of the matrices, not a gather per stage: with every mode allowed
        # the matrices are read as they are.)
        mats = [tuple(m if m is None or every else m[qs] for m in entry[:4]) for entry in per_group]
        s = 0
        for j in range(P * v):
            g, chunk = j % P, j // P
            time_m, base, act, floor = mats[g]
            room = per_group[g][4]
            budget = room if v == 1 else room * shares[g][chunk]
            need = base[:, s, s + 1:] + float(counts[g][chunk]) * act[:, s, s + 1:]
            if floor is not None:
                need = np.maximum(need, floor[:, s, s + 1:])
            ok = need <= budget
            if limited:
                ok &= time_m[:, s, s + 1:] <= period_limit
            # (Each mode's ok holds on a prefix of the ends, so their union does too.)
            s += int(np.count_nonzero(np.logical_or.reduce(ok, axis=0)))
            if s >= L:
                return False
        return True

    def _recall(self, key, period_limit: float):
        """A DP's result remembered under ``key`` that holds under ``period_limit``, or
        False. With one candidate period the DP returns the least-total split among those
        whose stages all cost at most the least period p (within 1e-9): computed under a
        limit at least that, it is the answer under every limit at least that, and under
        a limit below p nothing qualifies; "no split" under a limit also holds below it."""
        hit = self._memo.get(key)
        if hit is None:
            return False
        split, limit = hit
        if split is None:
            return None if period_limit <= limit else False
        reach = split.period * (1 + 1e-9)
        if reach > limit:
            return False
        if period_limit >= reach:
            return split
        return None if period_limit < split.period else False

    def _states_mats(self, sk: Skeleton, g: int, st: Setting) -> tuple[np.ndarray, np.ndarray]:
        """Like _mem_mats without the transient: (states[q, s, e], act[q, s, e])."""
        group, kind = sk.groups[g], sk.kinds[g]
        cast_field = self.tables.cast_field(sk, st, g)
        key = ("states", kind, st.micro_batch, st.sequence_parallel and kind.tp > 1, _sharding(group, st), st.zero,
               cast_field)
        hit = self._mem.get(key)
        if hit is None:
            t = self.tables.table(kind, st.micro_batch, st.sequence_parallel)
            params = t.cum_params[None, :] - t.cum_params[:, None]
            sharded = t.cum_zero_params[None, :] - t.cum_zero_params[:, None]
            cum_cast = getattr(t, cast_field)
            cast = cum_cast[None, :] - cum_cast[:, None]
            states = self.tables.state_bytes(params, t.max_params, group.dp * group.cp, st.zero, sharded) \
                + self.tables.dynamic_factor * self.tables.cast_bytes(cast, group.dp * group.cp, st.zero)
            act = self.tables.dynamic_factor * (t.cum_activation[:, None, :] - t.cum_activation[:, :, None])
            hit = self._mem[key] = (np.broadcast_to(states, act.shape), act)
        return hit

    def _transient_reserve(self, sk: Skeleton, g: int, st: Setting, qs: list[int]) -> float:
        """The largest transient a unit can cause on group g (the head's only on the group
        that runs the last chunk), under the modes allowed."""
        holds_head = g == (sk.pp * st.virtual_stages - 1) % sk.pp
        key = (sk.kinds[g], st.micro_batch, st.sequence_parallel, holds_head, tuple(qs))
        hit = self._reserve.get(key)
        if hit is None:
            t = self.tables.table(sk.kinds[g], st.micro_batch, st.sequence_parallel)
            kinds = [l.kind for l in self.tables.model.layers]
            units = [i for i in range(self.L) if holds_head or kinds[i] != "head"]
            hit = self._reserve[key] = float(t.transient[qs][:, units].max())
        return hit

    def chunk_budgets(self, sk: Skeleton, st: Setting, modes: tuple[str, ...], joint: bool):
        """(counts, budgets) the DP holds interleaved chunks to: ``counts[g][c]`` micro-batches
        in flight and ``budgets[g][c]`` bytes (the group's room after its context, buffers and
        largest transient, shared out by :meth:`_chunk_shares`) for chunk c of group g, with
        the joint peak's counts (``joint``) or each chunk's own most. Every split the DPs,
        the group-balanced split and the leanest split within budget return keeps each chunk's
        ``base + count * act`` within these."""
        fl = inflight(st.schedule, sk.pp, st.num_micro_batches, st.virtual_stages)
        counts = fl.joint if joint else fl.per_chunk
        shares = self._chunk_shares(sk, st, counts)
        qs = [RECOMPUTES.index(x) for x in modes]
        budgets = []
        for g in range(sk.pp):
            pool = sk.kinds[g].pool
            cap = self.tables.capacity(pool) - self.tables.fixed_bytes(pool, sk.groups[g], sk.pp, sk.ep)
            room = cap - self.tables.dynamic_factor * self._transient_reserve(sk, g, st, qs)
            budgets.append(tuple(room * share for share in shares[g]))
        return counts, tuple(budgets)

    def _chunk_shares(self, sk: Skeleton, st: Setting, counts) -> list[list[float]]:
        """Share of its group's memory budget each chunk may use. With v chunks per group
        the budget is split in proportion to what an even chunk would need (its share of
        the states plus its in-flight micro-batches of activations): chunk 0 holds the
        most. A sufficient separation; the exact joint peak is checked afterwards."""
        P, v = sk.pp, st.virtual_stages
        if v == 1:
            return [[1.0] for _ in range(P)]
        key = (sk.kinds, sk.shards, st.micro_batch, st.sequence_parallel, st.zero, counts)
        hit = self._shares.get(key)
        if hit is not None:
            return hit
        out = self._shares[key] = []
        for g in range(P):
            t = self.tables.table(sk.kinds[g], st.micro_batch, st.sequence_parallel)
            states = self.tables.state_bytes(float(t.cum_params[self.L]), 0.0, sk.shards, st.zero)
            act = float(t.cum_activation[0, self.L])
            w = [states + n * act for n in counts[g]]
            out.append([x / sum(w) for x in w])
        return out

    # ------------------------------------------------- interleaved groups
    def balanced_interleave(self, sk: Skeleton, st: Setting, modes: tuple[str, ...]) -> Split | None:
        """Interleaved split balanced per group: water-fill the units over groups by
        their speed (each group's time = its units x its per-unit time, plus embedding or
        head), spread each group's units evenly over its chunks (later chunks, which hold
        fewer micro-batches, take the remainder), and give each chunk the fastest
        recompute mode whose memory fits its share of the group's budget."""
        P, v = sk.pp, st.virtual_stages
        S, L = P * v, self.L
        kinds = [l.kind for l in self.tables.model.layers]
        lead = 1 if kinds[0] == "embedding" else 0
        tail = 1 if L - lead > 0 and kinds[-1] == "head" else 0
        body = L - lead - tail
        if body < S:
            return None
        qs = [RECOMPUTES.index(m) for m in modes]
        unit, extra = [], []
        for g in range(P):
            tm = self._time_mats(sk, g, st)[qs[0]]
            unit.append(float(tm[lead, L - tail]) / body)
            extra.append((float(tm[0, lead]) if g == 0 and lead else 0.0)
                         + (float(tm[L - tail, L]) if g == (S - 1) % P and tail else 0.0))
        counts = [v] * P
        heap = [(extra[g] + unit[g] * (v + 1), g) for g in range(P)]
        heapq.heapify(heap)
        for _ in range(body - v * P):
            _, g = heapq.heappop(heap)
            counts[g] += 1
            heapq.heappush(heap, (extra[g] + unit[g] * (counts[g] + 1), g))
        chunk_units = [0] * S
        for g in range(P):
            base, rem = divmod(counts[g], v)
            for c in range(v):
                chunk_units[c * P + g] = base + (1 if c >= v - rem else 0)
        bounds, s = [], 0
        for j in range(S):
            e = s + chunk_units[j] + (lead if j == 0 else 0) + (tail if j == S - 1 else 0)
            bounds.append((s, e))
            s = e
        held, budgets = self.chunk_budgets(sk, st, modes, joint=True)
        rec, period, total = [], 0.0, 0.0
        for j, (a, b) in enumerate(bounds):
            g, chunk = j % P, j // P
            base, act = self._states_mats(sk, g, st)
            ok = [q for q in qs if base[q][a, b] + held[g][chunk] * act[q][a, b] <= budgets[g][chunk]]
            if not ok:
                return None
            cost = float(self._time_mats(sk, g, st)[ok[0]][a, b])
            rec.append(RECOMPUTES[ok[0]])
            period, total = max(period, cost), total + cost
        return Split(bounds=tuple(bounds), recompute=tuple(rec), period=period, total=total)


def _sharding(group, st: Setting) -> int:
    """What a group's memory matrices depend on of its data x context ranks: their number
    when ZeRO shards states over them, else nothing (unsharded states and casts are
    the same however many replicas there are)."""
    return group.dp * group.cp if st.zero >= 1 else 1


def _least_objective(costs: np.ndarray, which: list[int], start: np.ndarray, valid: np.ndarray, L: int,
                     period: float, slower: np.ndarray, weight: float | None):
    """The DP's choice among candidate periods: the least ``period`` (``_minmax``'s) and the
    three smallest costs of ``slower`` (every stage cost above it, sorted), each giving the
    least-total split with every stage within it (``_minsum``); of those, the one of least
    ``weight * its period + its total`` (``weight`` None: its period alone), a later
    candidate winning only by more than a relative 1e-12. Returns (total, [(end, length)]
    per stage, period) or None.

    A slower candidate's split beats the least period's only by a smaller total. It either
    keeps every stage within the least period's own limit (then its total is no smaller)
    or has a stage costing at least the next cost above that limit, with a total no smaller
    than the least under the largest candidate. When neither bound beats the least period's
    split, the candidates between are not tried: the same answer, with fewer DPs."""
    cands = [period] + [float(x) for x in slower[:3]]
    found_at = {}
    if len(cands) > 1 and weight is not None:
        first = found_at[0] = _minsum(costs, which, start, valid, L, cands[0])
        widest = found_at[len(cands) - 1] = _minsum(costs, which, start, valid, L, cands[-1])
        if first is not None and widest is not None:
            first_obj = weight * _period_of(costs, which, first[1]) + first[0]
            above = slower[np.searchsorted(slower, period * (1 + 1e-9), side="right"):]
            least = min(weight * period + first[0], weight * float(above[0]) + widest[0] if len(above) else INF)
            if not least < first_obj * (1 - 1e-12):
                cands = cands[:1]
    best_obj, best = INF, None
    for i, tau in enumerate(cands):
        found = found_at[i] if i in found_at else _minsum(costs, which, start, valid, L, tau)
        if found is None:
            continue
        total, picks = found
        real_period = _period_of(costs, which, picks)
        obj = weight * real_period + total if weight is not None else real_period
        if obj < best_obj * (1 - 1e-12):
            best_obj, best = obj, (total, picks, real_period)
    return best


def _period_of(costs: np.ndarray, which: list[int], picks: list[tuple[int, int]]) -> float:
    """The slowest stage's cost of a split given as [(end, length)] per stage."""
    return max(float(costs[which[j]][d - 1, e]) for j, (e, d) in enumerate(picks))


def _minmax(costs: np.ndarray, which: list[int], start: np.ndarray, valid: np.ndarray, L: int) -> float | None:
    """Smallest achievable max_j cost_j over contiguous splits of L units into len(which)
    non-empty stages (costs[which[j], d-1, e]: stage j of d units ending at e)."""
    # best[L + 1] stays INF: stages that would start before unit 0 read it (one gather
    # per stage instead of a gather and a select).
    gather = np.where(valid, start, L + 1)
    best = np.full(L + 2, INF)
    best[0] = 0.0
    tmp = np.empty(gather.shape)
    # (The ufuncs are called directly, into reused buffers: the arrays are small and
    # there is one step per stage, so per-call overhead is most of the cost.)
    for i in which:
        np.maximum(best.take(gather), costs[i], out=tmp)
        np.minimum.reduce(tmp, axis=0, out=best[:L + 1])
    return float(best[L]) if np.isfinite(best[L]) else None


def _minsum(costs: np.ndarray, which: list[int], start: np.ndarray, valid: np.ndarray, L: int,
            cap: float) -> tuple[float, list[tuple[int, int]]] | None:
    """Smallest sum of stage costs with every stage at most ``cap``; returns (sum,
    [(end, length)] per stage). Ties go to the shortest stage (np.argmin takes the first),
    so results are deterministic."""
    limit = cap * (1 + 1e-9)
    # No stage longer than the longest run within the cap can be used: drop those rows.
    within = costs <= limit
    usable = np.nonzero(np.logical_or.reduce(within, axis=(0, 2)))[0]
    if len(usable) == 0:
        return None
    K = int(usable[-1]) + 1
    masked = np.where(within[:, :K], costs[:, :K], INF)
    gather = np.where(valid[:K], start[:K], L + 1)   # (see _minmax)
    best = np.full(L + 2, INF)
    best[0] = 0.0
    totals = []
    for i in which:
        tot = best.take(gather)
        tot += masked[i]
        totals.append(tot)
        np.minimum.reduce(tot, axis=0, out=best[:L + 1])
    if not np.isfinite(best[L]):
        return None
    # The chosen length of each stage is read back only along the path taken (one
    # column per stage), not for every end.
    picks = []
    e = L
    for tot in reversed(totals):
        d = int(tot[:, e].argmin()) + 1
        picks.append((e, d))
        e -= d
    picks.reverse()
    return float(best[L]), picks


TIE_BREAK = 1e-3
"""Weight of a stage's device time in the host-balancing split's cost (ties only)."""


class HostAwareSplitter(Splitter):
    """A splitter that balances what the hosts issue: a stage costs its kernels per
    micro-batch at the host's cost per kernel (``costmodel.host``), its device time only
    breaking ties. Where a step waits on its hosts (small models) the step's host time
    grows with the most kernels any group issues, which the device-balanced split does not
    weigh; this one's splits are offered beside it and the exact analysis decides. Its
    matrices never feed a bound."""

    def __init__(self, tables: Tables):
        super().__init__(tables)
        self._host: dict = {}

    def _time_mats(self, sk: Skeleton, g: int, st: Setting) -> np.ndarray:
        cost = super()._time_mats(sk, g, st)
        per_kernel = self.tables.host_costs(sk.kinds[g].pool).per_kernel_s
        if not per_kernel:
            return cost
        hit = self._host.get(id(cost))
        if hit is None or hit[0] is not cost:
            ck = self.tables.table(sk.kinds[g], st.micro_batch, st.sequence_parallel, (sk, st, g)).cum_kernels
            kernels = ck[:, None, :] - ck[:, :, None]
            hit = self._host[id(cost)] = (cost, per_kernel * kernels + TIE_BREAK * cost)
        return hit[1]
