"""Cheap lower bounds that order and prune candidates before any layer split is computed.

For a pipeline of device groups (a skeleton) under a setting, without choosing the
split, the closed-form time of :mod:`search.evaluate` is bounded below by:

* **work** - the whole model's per-micro-batch work, spread over the groups in
  proportion to their speed (a rank cannot beat its share), and no better than the
  rank that holds the most units can do (pigeonhole: ``ceil(units / pp)`` units, at
  least the cheapest ones);
* **recomputation that memory forces** - each stage ``j`` must hold its model states
  and ``n_j`` micro-batches of activations in its budget ``B_j``; dividing by ``n_j``
  and summing gives ``sum_u a_u(mode_u) <= sum_j B_j / n_j - states / max_j n_j``, a
  knapsack on the units' activation bytes whose LP relaxation (solved exactly through
  its Lagrangian dual, a handful of lines per device kind) bounds the recompute time any
  split must add; when even the leanest mode exceeds it, nothing fits at all;
* the schedule's fill (1F1B/interleaved ``total / v``, GPipe ``total``), the pipeline
  sends (every boundary is crossed once each way), ZeRO-3's per-micro-batch gathers,
  and for a single stage the exposed gradient reduction and the optimizer step.

The bounds are exact relaxations of the closed form for 1F1B, GPipe and zero-bubble
(which holds at least 1F1B's micro-batches). For interleaved schedules the memory part
assumes the same in-flight counts as 1F1B, which balanced chunks always exceed
(Narayanan et al. SC21 §2.2), so it may be optimistic only for lopsided chunks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from costmodel.host import layer_host_kernels, with_host
from search.evaluate import Setting, Skeleton, simulated
from search.tables import RECOMPUTES, Kind, Tables

INF = float("inf")


@dataclass
class KindSummary:
    """Whole-model figures of one device kind at one (micro-batch, sequence parallel)."""

    work: float
    """Per-micro-batch seconds of all units under the fastest allowed recompute."""
    params: float
    """Parameters per GPU of the whole model (tensor-parallel shard)."""
    act_lean: float
    """Activation bytes per micro-batch of all units under the leanest allowed mode."""
    smallest: np.ndarray
    """smallest[k]: sum of the k cheapest unit costs (fastest mode)."""
    out_bytes: float
    """Smallest activation a pipeline boundary carries (one micro-batch of this size)."""
    zb_fill: float
    """sum of F + B_input - B_weight over all units (zero-bubble's fill, fastest mode)."""
    lam: np.ndarray
    """Lagrange multipliers of the recompute knapsack's dual (s per byte)."""
    dual: np.ndarray
    """dual[i] = sum_u min_mode (cost + lam[i] * act): the line dual[i] - lam[i] * A
    bounds the least total cost whose activations fit in A bytes."""


class Bounds:
    """Computes and caches the bounds for one search."""

    def __init__(self, tables: Tables, modes: tuple[str, ...], global_batch: int):
        self.tables = tables
        self.global_batch = global_batch
        self.L = tables.model.num_layers
        self.qs = [RECOMPUTES.index(m) for m in modes]
        self._kind: dict = {}
        self._comm: dict = {}
        self._z3: dict = {}
        self._kinds: dict = {}
        self._pairs: dict = {}
        self._mixed: dict = {}
        self._counts: dict = {}
        self._mb_bound: dict = {}
        self._periods: dict = {}
        self._caps: dict = {}
        self._extra: dict = {}
        self._rank_lines: dict = {}
        self._share: dict = {}
        self._count_stats: dict = {}
        self._lines: dict = {}
        self._chains: dict = {}
        self._unit: dict = {}
        self._mixed_periods: dict = {}
        self._model_kernels: dict = {}
        self._host: dict = {}
        self._one_pool = len(tables.cluster.groups) == 1
        self._fill: dict = {}
        self._contexts: dict = {}
        self._per_sample: dict = {}
        self._regular: dict = {}
        self._shaped: dict = {}
        self._runs: dict = {}
        cluster = tables.cluster
        self._gpn = cluster.groups[0].gpus_per_node
        # (Pair classes by shape need node n to hold ranks n * gpn .. n * gpn + gpn - 1.)
        self._consecutive_nodes = len(cluster.groups) == 1 and all(
            slot.node == r // self._gpn for r, slot in enumerate(cluster.slots))

    def summary(self, kind: Kind, b: int, sp: bool) -> KindSummary:
        key = (kind, b, sp and kind.tp > 1)
        hit = self._kind.get(key)
        if hit is not None:
            return hit
        t = self.tables.table(kind, b, sp)
        qs = self.qs
        cost = np.stack([t.forward + t.backward_input[q] + t.backward_weight for q in qs])   # (modes, units)
        act = np.stack([t.activation[q] for q in qs])
        hit = _summarize(cost, act, float(t.cum_params[self.L]), t, _zb_fill(t, qs[0]))
        self._kind[key] = hit
        return hit

    def _comm_prefix(self, sk: Skeleton, out: float) -> tuple[list[float], float]:
        """(prefix, wrap): prefix[g] = summed cost of the boundaries (0, 1) .. (g - 1, g),
        both ways, for a micro-batch of ``out`` bytes (at least P entries); wrap = the
        boundary from the last group back to the first (interleaved chunks cross it)."""
        P = sk.pp
        first = sk.groups[0]
        # Skeletons share their device-group objects (every depth of one mesh shape starts
        # with the same groups): the consecutive boundaries' prefix sums are kept per first
        # group and message size, and grown as deeper pipelines ask (by identity: hashing
        # a group hashes all its ranks).
        ckey = (id(first), out)
        chain = self._chains.get(ckey)
        if chain is None or chain[0][0] is not first:
            chain = self._chains[ckey] = ([first], [0.0])
        groups, prefix = chain
        for g in range(1, P):
            if g < len(groups):
                if groups[g] is not sk.groups[g]:
                    break
                continue
            groups.append(sk.groups[g])
            prefix.append(prefix[-1] + self._boundary(groups[g - 1], groups[g], out))
        else:
            return prefix, self._boundary(sk.groups[P - 1], first, out)
        # Another pipeline from the same first group: its own prefix sums.
        own = [0.0]
        for g in range(1, P):
            own.append(own[-1] + self._boundary(sk.groups[g - 1], sk.groups[g], out))
        return own, self._boundary(sk.groups[P - 1], first, out)

    def _boundary(self, src, dst, out: float) -> float:
        """One micro-batch across the boundary src -> dst and its gradient back."""
        pkey = (id(src), id(dst), out)
        hit = self._comm.get(pkey)
        if hit is None:
            shape = self._pair_shape(src, dst)
            if shape is None:
                p2p = self.tables.p2p_classes
                cost = _p2p_eval(p2p(src, dst), out) + _p2p_eval(p2p(dst, src), out)
            else:
                classes = self._shaped.get(shape)
                if classes is None:
                    p2p = self.tables.p2p_classes
                    classes = self._shaped[shape] = (p2p(src, dst), p2p(dst, src))
                cost = _p2p_eval(classes[0], out) + _p2p_eval(classes[1], out)
            hit = self._comm[pkey] = (cost, src, dst)   # (the groups kept alive: ids stay theirs)
        return hit[0]

    def _pair_shape(self, src, dst) -> tuple | None:
        """On a cluster of one node group whose nodes hold consecutive ranks, between groups
        that are runs of consecutive ranks: what a transfer's cost depends on. Replica i's
        shard t goes from rank first_src + i * tp_src + t to first_dst + i * tp_dst + t; the
        pair's link (same node or not) follows from the sender's offset in its node and the
        distance, so the groups' sizes and degrees, the sender's offset and the distance
        decide every pair class (None: look the groups up rank by rank)."""
        if not self._consecutive_nodes:
            return None
        a, b = self._run_of(src), self._run_of(dst)
        if a is None or b is None:
            return None
        return a[1:], b[1:], a[0] % self._gpn, b[0] - a[0]

    def _shape_groups(self, sk: Skeleton) -> list:
        """One group of ``sk`` per distinct shape of its data-parallel groups (on nodes of
        consecutive ranks a run of consecutive ranks' collectives depend only on its size,
        degrees and offset in its node); every group where that does not apply."""
        if not self._consecutive_nodes:
            return list(sk.groups)
        out, seen = [], set()
        for g in sk.groups:
            run = self._run_of(g)
            key = (run[1:], run[0] % self._gpn) if run is not None else id(g)
            if key not in seen:
                seen.add(key)
                out.append(g)
        return out

    def _run_of(self, group) -> tuple | None:
        """(first rank, ranks, tp, replicas) of a group whose ranks are consecutive, else None."""
        hit = self._runs.get(id(group))
        if hit is None or hit[0] is not group:
            r = group.ranks
            run = (r[0], len(r), group.tp, group.dp * group.cp) if r == tuple(range(r[0], r[0] + len(r))) else None
            hit = self._runs[id(group)] = (group, run)
        return hit[1]

    def _distinct(self, sk_id: int, sk: Skeleton) -> list[tuple[Kind, int]]:
        """The pipeline's device kinds with how many groups have each."""
        hit = self._kinds.get(sk_id)
        if hit is None:
            first = sk.kinds[0]
            if all(k is first for k in sk.kinds):
                # (One kind object for every group, the usual case: no hashing.)
                hit = self._kinds[sk_id] = [(first, len(sk.kinds))]
                return hit
            counts: dict[Kind, int] = {}
            for k in sk.kinds:
                counts[k] = counts.get(k, 0) + 1
            hit = self._kinds[sk_id] = list(counts.items())
        return hit

    def _mixed_period(self, sk_id: int, sk: Skeleton, st: Setting) -> float:
        """Mixed pipelines: the smallest period at which the groups can take all units,
        each at most as many as its memory holds (average unit, leanest recompute, its
        position's 1F1B in-flight count) and no more than its speed allows in the period:
        find the least tau with sum_g min(tau / t_g, U_g) >= units (water-filling)."""
        P, m = sk.pp, st.num_micro_batches
        gpipe = st.schedule == "gpipe"
        # (The in-flight counts depend on m only under GPipe or below the depth.)
        key = (sk_id, st.micro_batch, st.sequence_parallel, st.zero, m if gpipe or m < P else None, gpipe)
        hit = self._mixed_periods.get(key)
        if hit is None:
            hit = self._mixed_periods[key] = self._water_fill(sk, st)
        return hit

    def _water_fill(self, sk: Skeleton, st: Setting) -> float:
        P, m, L = sk.pp, st.num_micro_batches, self.L
        rates, caps = [], []
        for g, kind in enumerate(sk.kinds):
            budget, states, act, rate = self._fill_terms(kind, st.micro_batch, st.sequence_parallel,
                                                         sk.shards, st.zero)
            n = m if st.schedule == "gpipe" else min(P - g, m)
            per_unit = (states + n * act) / L
            caps.append(max(0.0, budget / per_unit) if per_unit > 0 else float(L))
            rates.append(rate)
        if sum(caps) < L:
            return INF
        # Breakpoints tau_g = U_g / rate_g; between them the capacity is linear in tau.
        order = sorted(range(P), key=lambda g: caps[g] / rates[g])
        full, speed = 0.0, sum(rates)
        for g in order:
            tau = (L - full) / speed
            if tau <= caps[g] / rates[g]:
                return tau
            full += caps[g]
            speed -= rates[g]
        return INF

    def _fill_terms(self, kind: Kind, b: int, sp: bool, shards: int, zero: int) -> tuple[float, ...]:
        """What _water_fill reads of one kind (the same for every group of it, in every
        pipeline): (memory budget, whole-model states, least activation bytes per
        micro-batch, units per second per micro-batch)."""
        key = (kind, b, sp, shards, zero)
        hit = self._fill.get(key)
        if hit is None:
            s = self.summary(kind, b, sp)
            budget = self.tables.capacity(kind.pool) - self.tables.fixed_bytes(kind.pool)
            hit = self._fill[key] = (budget, self.tables.state_bytes(s.params, 0.0, shards, zero), s.act_lean,
                                     self.L / s.work)
        return hit

    def _zero3(self, sk_id: int, sk: Skeleton) -> tuple[float, float, float, float]:
        """Smallest (alpha, beta) of the all-gather and reduce-scatter over the pipeline's groups."""
        hit = self._z3.get(sk_id)
        if hit is None:
            ag = [ab for g in self._shape_groups(sk) for ab in self.tables.dp_affines(g, "all_gather")]
            rs = [ab for g in self._shape_groups(sk) for ab in self.tables.dp_affines(g, "reduce_scatter")]
            hit = self._z3[sk_id] = (min(a for a, _ in ag), min(b for _, b in ag),
                                     min(a for a, _ in rs), min(b for _, b in rs))
        return hit

    def _zero3_beside(self, sk: Skeleton) -> float:
        """The least seconds per parameter of ZeRO-3's copies beside the collectives over
        the pipeline's device pools (Tables.zero3_copy_rates)."""
        return min(self.tables.zero3_copy_rates(p)[1] for p in {k.pool for k in sk.kinds})

    def _counts_of(self, P: int, m: int, v: int, schedule: str) -> list[float]:
        """Micro-batches of its own activations each rank holds at least (per position)."""
        key = (P, m, v, schedule == "gpipe")
        counts = self._counts.get(key)
        if counts is None:
            if schedule == "gpipe":
                counts = [m] * P
            elif v > 1:
                # Megatron's interleaved warm-up (Narayanan et al. SC21 §2.2): rank g runs
                # 2(pp-g-1) + (v-1)pp chunk forwards before its first backward; with equal
                # chunks that is (warm-up + 1) / v micro-batches of the rank's activations.
                counts = [min(2 * (P - g - 1) + (v - 1) * P + 1, m * v) / v for g in range(P)]
            else:
                counts = [min(P - g, m) for g in range(P)]
            self._counts[key] = counts
        return counts

    def _count_sums(self, counts: list[float]) -> tuple[float, float, float]:
        """(sum of 1/n, max n, min n) of in-flight counts (cached per counts list)."""
        hit = self._count_stats.get(id(counts))
        if hit is None or hit[0] is not counts:
            hit = self._count_stats[id(counts)] = (counts, sum(1.0 / n for n in counts), max(counts), min(counts))
        return hit[1:]

    def recompute_extra(self, sk_id: int, sk: Skeleton, st: Setting) -> float:
        """Least recompute time (per micro-batch, summed over stages) any split needs to
        fit; INF when no split can fit. On a mixed pipeline every unit is taken at its
        cheapest and smallest over the pipeline's kinds (a relaxation)."""
        return self._extra_in(self._context(sk_id, sk, st.micro_batch, st.sequence_parallel), sk_id, sk, st)

    def _extra_in(self, ctx: "_Context", sk_id: int, sk: Skeleton, st: Setting) -> float:
        """recompute_extra() with the skeleton's part of its key read off its context: a
        one-kind pipeline depends on its skeleton only through the kind, the depth and the
        shards (which all its groups share), so many skeletons share the result; the
        in-flight counts stop depending on m once it reaches twice the depth."""
        P, m = sk.pp, st.num_micro_batches
        gpipe = st.schedule == "gpipe"
        who = ctx.who
        if st.zero == 0 and ctx.one_kind:
            # Unsharded states do not depend on the number of shards.
            who = (who[0], who[1], who[2] > 1, who[3])
        key = (who, st.micro_batch, st.sequence_parallel, st.zero, m if gpipe or m < 2 * P else None,
               st.virtual_stages, gpipe)
        hit = self._extra.get(key)
        if hit is None:
            hit = self._extra[key] = self._recompute_extra(sk_id, sk, st, ctx.first, ctx.one_kind)
        return hit

    def _recompute_extra(self, sk_id: int, sk: Skeleton, st: Setting, s: KindSummary, one_kind: bool) -> float:
        P = sk.pp
        counts = self._counts_of(P, st.num_micro_batches, st.virtual_stages, st.schedule)
        states = None
        if one_kind:
            # Every rank has the same budget: sums over ranks are sums over the counts.
            cap = self.tables.capacity(sk.kinds[0].pool) - self.tables.fixed_bytes(sk.kinds[0].pool)
            inverse, most, least = self._count_sums(counts)
            states = self.tables.state_bytes(s.params, 0.0, sk.shards, st.zero)
            room, total = cap * inverse - states / most, cap * P
        else:
            caps = self._caps.get(sk_id)
            if caps is None:
                caps = self._caps[sk_id] = [
                    self.tables.capacity(k.pool) - self.tables.fixed_bytes(k.pool)
                    for k in sk.kinds]
            s = self._mixed_summary(sk_id, sk, st)
            states = self.tables.state_bytes(s.params, 0.0, sk.shards, st.zero)
            room, total, least = sum(c / n for c, n in zip(caps, counts)) - states / max(counts), sum(caps), \
                min(counts)
        # Also: the states alone, and the average rank, must fit.
        if room < s.act_lean or states > total or states + least * s.act_lean > total:
            return INF
        lines = self._lines.get(id(s))
        if lines is None or lines[0] is not s:
            lines = self._lines[id(s)] = (s, list(zip(s.dual.tolist(), s.lam.tolist())))
        need = max(d - lam * room for d, lam in lines[1])   # (a dozen lines: no numpy call)
        return max(0.0, need - s.work)

    def _mixed_summary(self, sk_id: int, sk: Skeleton, st: Setting) -> KindSummary:
        """Per unit, the cheapest cost and smallest memory over the pipeline's kinds."""
        key = (sk_id, st.micro_batch, st.sequence_parallel)
        hit = self._mixed.get(key)
        if hit is not None:
            return hit
        tabs = [self.tables.table(k, st.micro_batch, st.sequence_parallel) for k, _ in self._distinct(sk_id, sk)]
        qs = self.qs
        cost = np.min([np.stack([t.forward + t.backward_input[q] + t.backward_weight for q in qs]) for t in tabs],
                      axis=0)
        act = np.min([np.stack([t.activation[q] for q in qs]) for t in tabs], axis=0)
        params = float(np.min([t.params for t in tabs], axis=0).sum())
        hit = self._mixed[key] = _summarize(cost, act, params, tabs[0], min(_zb_fill(t, qs[0]) for t in tabs))
        return hit

    def memory_period(self, sk: Skeleton, st: Setting) -> float:
        """A lower bound on the busiest rank's work per micro-batch (forward + backward,
        recomputation included) of any split that fits in memory (0.0 for interleaved
        pipelines of several device kinds: no bound; INF: no split fits).

        The relaxation keeps only the model's most common unit kind (dropping units only
        lightens every rank) and replaces each of those units by a virtual one with, per
        recompute mode, the least cost and activation bytes and the least states of any of
        them (each rank's on its own device kind and data-parallel degree). Rank ``g``
        holds ``n_g`` micro-batches of its activations at least (the
        schedule's in-flight peak; for interleaved chunks, the smallest chunk count of its
        peak vector) besides its states, within its budget ``B_g``. At a period ``tau`` it
        can then take at most ``k_g(tau)`` virtual units, the optimum of the linear program
        ``max sum_q y_q`` subject to ``sum_q c_q y_q <= tau`` and ``sum_q (s + n_g a_q) y_q
        <= B_g`` (``y_q``: units in mode ``q``, fractional); the least ``tau`` at which the
        ranks together can take every unit bounds the period of every real split, whose
        ranks also balance work against memory but in whole units. Without interleaving a
        rank holds one stage and a stage has one recompute mode, so there ``k_g(tau)`` is
        the best single mode's (see _single_mode_period), not a mix; on a pipeline of
        several device kinds only that case is bounded (a rank's line depends on its kind,
        and the interleaved ranks' dual vertices would be per kind)."""
        if sk.pp == 1:
            return 0.0
        P, m, v = sk.pp, st.num_micro_batches, st.virtual_stages
        if len(set(sk.kinds)) > 1:
            if v > 1:
                return 0.0
            key = ("mixed", sk.kinds, tuple(g.dp * g.cp for g in sk.groups), sk.ep, st.micro_batch,
                   st.sequence_parallel, st.zero, st.schedule == "gpipe",
                   m if st.schedule == "gpipe" or m < P else None)
            hit = self._rank_lines.get(key)
            if hit is None:
                hit = self._rank_lines[key] = self._one_stage_period(sk, st)
            return hit
        kind = sk.kinds[0]
        sp = st.sequence_parallel and kind.tp > 1
        # The in-flight peaks stop depending on m past a few times the depth (not GPipe's).
        key = (kind, P, sk.shards, st.micro_batch, sp, st.zero, st.schedule,
               m if st.schedule == "gpipe" or m < 4 * P else None, v)
        hit = self._rank_lines.get(key)
        if hit is None:
            hit = self._rank_lines[key] = self._memory_period(sk, st)
        return hit

    def _memory_period(self, sk: Skeleton, st: Setting) -> float:
        from search.inflight import inflight
        if st.virtual_stages == 1:
            return self._one_stage_period(sk, st)
        P, kind, tables = sk.pp, sk.kinds[0], self.tables
        cost, act, states, count = self._virtual_unit(kind, st.micro_batch, st.sequence_parallel, sk.shards, st.zero)
        if count == 0:
            return 0.0
        m = st.num_micro_batches
        fl = inflight(st.schedule, P, m, st.virtual_stages)
        n = np.array([max(min(vec) for vec in fl.peaks[g]) for g in range(P)], dtype=float)
        budget = tables.capacity(kind.pool) - tables.fixed_bytes(kind.pool, sk.groups[0], P, sk.ep)
        if budget <= 0:
            return INF
        # Ranks with one in-flight count take the same: solve each count once.
        ns, mult = np.unique(n, return_counts=True)
        mem = states + ns[:, None] * act[None, :]                      # (counts, modes)
        if float((budget / mem.min(axis=1) * mult).sum()) < count:
            return INF                     # even all in the leanest mode does not fit
        # k_g(tau) by LP duality: the least of alpha * tau + beta * B_g over the dual's
        # vertices, where two of alpha c_q + beta d_q >= 1, alpha >= 0, beta >= 0 are tight.
        Q = len(cost)
        alphas = [np.zeros(len(ns)), np.full(len(ns), 1.0 / cost.min())]
        betas = [1.0 / mem.min(axis=1), np.zeros(len(ns))]
        with np.errstate(divide="ignore", invalid="ignore"):
            for q1 in range(Q):
                for q2 in range(q1 + 1, Q):
                    det = cost[q1] * mem[:, q2] - cost[q2] * mem[:, q1]
                    alphas.append((mem[:, q2] - mem[:, q1]) / det)
                    betas.append((cost[q1] - cost[q2]) / det)
        alpha, beta = np.stack(alphas, axis=1), np.stack(betas, axis=1)   # (counts, vertices)
        ok = (alpha >= 0) & (beta >= 0) & np.isfinite(alpha) & np.isfinite(beta)
        ok &= ((alpha[:, :, None] * cost[None, None, :] + beta[:, :, None] * mem[:, None, :])
               >= 1 - 1e-9).all(axis=2)
        alpha = np.where(ok, alpha, 0.0)
        beta = np.where(ok, beta * budget, INF)      # (a vertex left out never is the least)

        # The least tau whose capacity reaches every unit. capacity(tau) is concave and
        # increasing (a sum of minima of lines); the sum of the lines active at tau lies on
        # or above it everywhere, so that sum's root is at most the answer, and at least tau
        # when capacity(tau) falls short: iterating from 0 climbs to the answer from below
        # (Newton's method on a concave function), exactly once the active lines are right.
        rows = np.arange(len(ns))
        tau = 0.0
        for _ in range(4 * (alpha.shape[1] + 1) * len(ns) + 8):
            active = (alpha * tau + beta).argmin(axis=1)
            slope = float((alpha[rows, active] * mult).sum())
            level = float((beta[rows, active] * mult).sum())
            if slope * tau + level >= count or slope <= 0.0:
                break
            nxt = (count - level) / slope
            if not nxt > tau:
                break
            tau = nxt
        return tau * (1.0 - 1e-12)   # (a lower bound: rounding must not lift it above)

    def _one_stage_period(self, sk: Skeleton, st: Setting) -> float:
        """memory_period without interleaving (one stage per rank, of one device kind or
        several): each rank's line from its own kind's virtual unit and budget (see
        _single_mode_period)."""
        P, m, tables = sk.pp, st.num_micro_batches, self.tables
        costs, most = [], []
        count = None
        for g in range(P):
            kind, group = sk.kinds[g], sk.groups[g]
            cost, act, states, count = self._virtual_unit(kind, st.micro_batch, st.sequence_parallel,
                                                          group.dp * group.cp, st.zero)
            budget = tables.capacity(kind.pool) - tables.fixed_bytes(kind.pool, group, P, sk.ep)
            if budget <= 0:
                return INF            # every stage holds a unit: this rank can hold none
            # Zero-bubble holds at least 1F1B's micro-batches (it frees them later).
            n = m if st.schedule == "gpipe" else min(P - g, m)
            costs.append(cost)
            most.append(budget / (states + n * act))
        if not count:
            return 0.0
        cost, most = np.array(costs), np.array(most)
        if float(most.max(axis=1).sum()) < count:
            return INF                # even all in the leanest mode does not fit
        return _single_mode_period(cost, most, np.ones(P), count)

    def share_period(self, sk: Skeleton, st: Setting, counts, budgets) -> float:
        """A lower bound on the busiest rank's work per micro-batch of any interleaved split
        whose every chunk fits the budget the layer-split DP gives it
        (``counts[g][c]`` micro-batches of chunk c of rank g in flight within ``budgets[g][c]``
        bytes, :meth:`Splitter.chunk_budgets`), one recompute mode per chunk as the DP
        chooses; INF when no such split exists. Much tighter than
        :meth:`memory_period`, which must also hold for splits that fit only by the exact
        joint peak and relaxes modes and units to fractions.

        The same virtual units as memory_period (each rank's of its own device kind and
        data-parallel degree), counted whole: x of them in chunk c take
        t_c(x) = x * (the least cost of a mode in which x fit the chunk's budget). Every
        stage holds a unit and only the first and last stages can hold no block, so every
        other chunk holds at least one. T_g(X), the least time of X units on rank g, is the
        min-plus convolution of its chunks' t_c; K_g(tau), the most units rank g can take
        within period tau, follows. The least tau at which the ranks together take every
        unit bounds the busiest rank's work of every such split."""
        P, S = sk.pp, sk.pp * st.virtual_stages
        b, sp, zero = st.micro_batch, st.sequence_parallel, st.zero
        ranks: dict = {}
        for g in range(P):
            # (Each rank's units are its own kind's, with its states sharded over its own
            # data x context ranks.)
            shards = sk.groups[g].dp * sk.groups[g].cp
            ends = tuple(int(c * P + g == 0) + 2 * int(c * P + g == S - 1) for c in range(st.virtual_stages))
            key = ((sk.kinds[g], shards), tuple(counts[g]), tuple(budgets[g]), ends)
            ranks[key] = ranks.get(key, 0) + 1
        key = (b, sp, zero, tuple(ranks.items()))
        hit = self._share.get(key)
        if hit is None:
            units = {u: (self._virtual_unit(u[0], b, sp, u[1], zero), self._end_units(u[0], b, sp, u[1], zero))
                     for u in dict.fromkeys(k[0] for k in ranks)}   # (in the ranks' order)
            hit = self._share[key] = _share_period(ranks, units)
        return hit

    def _end_units(self, kind: Kind, b: int, sp: bool, shards: int, zero: int) -> tuple:
        """(first, last): (cost[q], activation bytes[q], states) of the model's first and last
        units where they are not of its most common kind (the embedding and the head, which
        the first and the last stage hold), else None (see share_period)."""
        key = ("ends", kind, b, sp and kind.tp > 1, shards, zero)
        hit = self._unit.get(key)
        if hit is None:
            t = self.tables.table(kind, b, sp)
            kinds = [l.kind for l in self.tables.model.layers]
            common = max(set(kinds), key=lambda k: (kinds.count(k), k))
            dyn = self.tables.dynamic_factor
            zp = np.diff(t.cum_zero_params)
            states = self.tables.state_bytes(t.params, 0.0, shards, zero, zp) \
                + dyn * self.tables.cast_bytes(t.cast_params, shards, zero)
            out = []
            for u in (0, len(kinds) - 1):
                if kinds[u] == common:
                    out.append(None)
                    continue
                cost = np.array([float(t.forward[u] + t.backward_input[q][u] + t.backward_weight[u]) for q in self.qs])
                act = np.array([float(t.activation[q][u]) for q in self.qs]) * dyn
                out.append((cost, act, float(states[u])))
            hit = self._unit[key] = tuple(out)
        return hit

    def _virtual_unit(self, kind: Kind, b: int, sp: bool, shards: int, zero: int):
        """(cost[q], memory[q] per micro-batch of activations, states, count) of the virtual
        unit standing for the model's most common unit kind (see memory_period): costs and
        activations per mode, and states, each the least over those units."""
        key = (kind, b, sp and kind.tp > 1, shards, zero)
        hit = self._unit.get(key)
        if hit is None:
            t = self.tables.table(kind, b, sp)
            kinds = [l.kind for l in self.tables.model.layers]
            common = max(set(kinds), key=lambda k: (kinds.count(k), k))
            keep = np.array([k == common for k in kinds])
            qs = self.qs
            cost = np.array([float((t.forward + t.backward_input[q] + t.backward_weight)[keep].min()) for q in qs])
            dyn = self.tables.dynamic_factor
            act = np.array([float(t.activation[q][keep].min()) for q in qs]) * dyn
            zp = np.diff(t.cum_zero_params)
            st = self.tables.state_bytes(t.params, 0.0, shards, zero, zp) \
                + dyn * self.tables.cast_bytes(t.cast_params, shards, zero)
            hit = self._unit[key] = (cost, act, float(np.min(st[keep])), int(keep.sum()))
        return hit

    def skeleton_bound(self, sk_id: int, sk: Skeleton, micro_batches: list[int],
                       sequence_parallel: tuple[bool, ...]) -> float:
        """A bound valid for every setting of the skeleton (the least of its
        :meth:`micro_batch_bound` s). Skeletons of one sequence of kinds and depth share
        the least period per sample over the micro-batch sizes they allow (every
        data-parallel degree with the same sizes): it is found once."""
        key = (tuple(self._distinct(sk_id, sk)), sk.pp, tuple(micro_batches), tuple(sequence_parallel))
        per_sample = self._per_sample.get(key)
        if per_sample is None:
            per_sample = self._per_sample[key] = min(
                (self._period(key[0], sk.pp, b, sp) / b for b in micro_batches for sp in sequence_parallel),
                default=INF)
        # (The same arithmetic as micro_batch_bound's, on the least factor: equal to its least.)
        return per_sample * self.global_batch / sk.dp

    def micro_batch_bound(self, sk_id: int, sk: Skeleton, b: int, sp: bool) -> float:
        """A bound valid for every setting of the skeleton with micro-batch ``b`` and
        sequence parallelism ``sp``: every schedule's time is at least ``m`` periods (each
        rank runs all its micro-batches one after another), and the period at least the
        work spread over the groups at their speeds, and at least the least work of the
        ``ceil(units / pp)`` units some stage must hold."""
        key = (sk_id, b, sp)
        hit = self._mb_bound.get(key)
        if hit is None:
            period = self._period(tuple(self._distinct(sk_id, sk)), sk.pp, b, sp)
            m = self.global_batch / (b * sk.dp)
            hit = self._mb_bound[key] = with_host(period * m, self.host_floor(sk, m))
        return hit

    def host_floor(self, sk: Skeleton, m: float) -> float:
        """A lower bound on the host's time per step (``costmodel.host.pipeline_host_time``)
        over every split of ``sk`` with ``m`` micro-batches: some group pays its cost per
        step, and some group issues at least 1/pp of the model's kernels (without
        recomputation, the fewest) for each of the m micro-batches. Bounds on the step are
        ``with_host(device bound, this)``: the step grows with both."""
        most_step, least_step, least_kernels, _, _ = self._host_lines(sk)
        return max(most_step, least_step + least_kernels * m)

    def host_ceiling(self, sk: Skeleton, m: float) -> float:
        """An upper bound on the host's time per step over every split of ``sk`` with ``m``
        micro-batches (every kernel recomputed, all of them on the slowest host's path):
        where it is small against a step, the host cannot change what prunes."""
        most_step, _, _, most_kernels, depth = self._host_lines(sk)
        return most_step + most_kernels * (m + depth - 1)

    def _host_lines(self, sk: Skeleton) -> tuple[float, float, float, float, int]:
        """(most and least cost per step, least host seconds per micro-batch a group must
        spend, most the whole model can take per micro-batch, depth) of ``sk``'s hosts.
        Asked thousands of times per search, so kept by depth alone on a cluster of one
        node group (no key to build), by depth and pools elsewhere."""
        key = sk.pp if self._one_pool else (sk.pp, tuple(k.pool for k in sk.kinds))
        hit = self._host.get(key)
        if hit is None:
            costs = [self.tables.host_costs(k.pool) for k in set(sk.kinds)]
            counts = (False, True) if self.tables.stack.autocasts else (False,)   # (with autocast's casts or not)
            hit = self._host[key] = (
                max(c.per_step_s for c in costs), min(c.per_step_s for c in costs),
                min(c.per_kernel_s for c in costs) * min(self.model_kernels("none", a) for a in counts) / sk.pp,
                max(c.per_kernel_s for c in costs) * max(self.model_kernels("full", a) for a in counts),
                sk.pp)
        return hit

    def model_kernels(self, recompute: str, autocast: bool = False) -> float:
        """Kernels the whole model's units issue per micro-batch under ``recompute``, under
        autocast or not (``costmodel.host.layer_host_kernels``)."""
        hit = self._model_kernels.get((recompute, autocast))
        if hit is None:
            stack = self.tables.stack
            hit = self._model_kernels[(recompute, autocast)] = sum(
                layer_host_kernels(l, recompute, stack, autocast) for l in self.tables.model.layers)
        return hit

    def _period(self, distinct: tuple, P: int, b: int, sp: bool) -> float:
        """The least period of a pipeline of these (kind, groups) and depth, memory aside.
        It depends on the pipeline only through them (many skeletons share them: every
        data-parallel degree of a mesh shape)."""
        pkey = (distinct, P, b, sp)
        period = self._periods.get(pkey)
        if period is None:
            summ = [(self.summary(k, b, sp), n) for k, n in distinct]
            period = 1.0 / sum(n / s.work for s, n in summ)
            period = self._periods[pkey] = max(period, min(s.smallest[-(-self.L // P)] for s, _ in summ))
        return period

    def _context(self, sk_id: int, sk: Skeleton, b: int, sp: bool) -> "_Context":
        """What every setting of one skeleton at micro-batch ``b`` (sequence parallelism
        ``sp``) shares in its time bound: the kinds' summaries, the work spread over the
        groups, the pigeonhole floor, the boundaries' sends (computed once, not once per
        schedule, virtual-stage count and ZeRO stage)."""
        key = (sk_id, b, sp)
        hit = self._contexts.get(key)
        if hit is not None:
            return hit
        P = sk.pp
        kinds = self._distinct(sk_id, sk)
        summ = [(self.summary(k, b, sp), n) for k, n in kinds]
        one = len(summ) == 1
        first = summ[0][0]
        k_units = -(-self.L // P)
        works = [s.work for s, _ in summ]
        fastest = min(works)
        out = first.out_bytes            # the table is per micro-batch already
        prefix, wrap = self._comm_prefix_of(sk_id, sk, b, out) if P > 1 else ([0.0], 0.0)
        hit = self._contexts[key] = _Context(
            summaries=[s for s, _ in summ], first=first, one_kind=one,
            who=(sk.kinds[0], P, sk.shards, sk.groups[0].tp) if one else sk_id,
            spread=(fastest if one else None),
            speed_share=(1.0 if one else sum(n * fastest / s.work for s, n in summ)),
            pigeonhole=min(s.smallest[k_units] for s, _ in summ),
            least_work=fastest,
            prefix=prefix, wrap=wrap,
            kappa=min(((s.work + s.zb_fill) / (2 * s.work) for s, _ in summ if s.work > 0), default=1.0),
            zb_fill=min(s.zb_fill for s, _ in summ))
        return hit

    def _comm_prefix_of(self, sk_id: int, sk: Skeleton, b: int, out: float) -> tuple[list[float], float]:
        key = (sk_id, b, out)
        hit = self._pairs.get(key)
        if hit is None:
            regular = self._regular.get(sk_id)
            if regular is None:
                regular = self._regular[sk_id] = self._regular_key(sk)
            hit = self._pairs[key] = self._comm_prefix(sk, out) if regular is False \
                else self._regular_prefix(sk, regular, out)
        return hit

    def _regular_key(self, sk: Skeleton):
        """For a pipeline of runs of consecutive ranks of one shape, each starting where the
        previous one ends, on nodes of consecutive ranks: (the runs' shape, the first rank's
        offset in its node), which decide every boundary's sends; else False."""
        first = self._run_of(sk.groups[0]) if self._consecutive_nodes else None
        if first is None:
            return False
        start, n = first[0], first[1]
        for p, g in enumerate(sk.groups):
            run = self._run_of(g)
            if run is None or run[1:] != first[1:] or run[0] != start + p * n:
                return False
        return first[1:], start % self._gpn

    def _regular_prefix(self, sk: Skeleton, regular, out: float) -> tuple[list[float], float]:
        """_comm_prefix for a regular pipeline (see _regular_key): every pipeline of that
        shape and offset shares the prefix sums (grown as deeper ones ask) and, per depth,
        the wrap-around boundary."""
        P = sk.pp
        chain = self._chains.get((regular, out))
        if chain is None:
            chain = self._chains[(regular, out)] = ([0.0], {})
        prefix, wraps = chain
        while len(prefix) < P:
            g = len(prefix)
            prefix.append(prefix[-1] + self._boundary(sk.groups[g - 1], sk.groups[g], out))
        wrap = wraps.get(P)
        if wrap is None:
            wrap = wraps[P] = self._boundary(sk.groups[P - 1], sk.groups[0], out)
        return prefix, wrap

    def time_bound(self, sk_id: int, sk: Skeleton, st: Setting, period_floor: float = 0.0) -> float:
        """Lower bound on the closed-form time of any split (INF: nothing can fit).
        ``period_floor``: a lower bound on the busiest rank's work per micro-batch known
        from elsewhere (the memory-free split's, :meth:`memory_period`)."""
        ctx = self._context(sk_id, sk, st.micro_batch, st.sequence_parallel)
        extra = self._extra_in(ctx, sk_id, sk, st)
        if extra == INF:
            return INF
        return with_host(self._bound(ctx, sk_id, sk, st, extra, period_floor),
                         self.host_floor(sk, st.num_micro_batches))

    def item_bound(self, sk_id: int, sk: Skeleton, b: int, sp: bool, pipelinings, zero: int) -> float:
        """A bound valid for every setting of ``sk`` at micro-batch ``b`` and sequence
        parallelism ``sp`` with one of ``pipelinings`` ((micro-batches, schedule, virtual
        stages)) and a ZeRO stage of at most ``zero``: :meth:`time_bound`'s arithmetic
        with no recomputation forced by memory (time_bound adds what is forced) and
        without the costs only some ZeRO stages pay (ZeRO-3's gathers, the reduction of an
        unpipelined replica), at the most sharded stage (its states leave the most
        memory), for the pipelining that gives the least. Unlike
        :meth:`micro_batch_bound` it counts the pipeline's fill and sends, so most of the
        micro-batch sizes a skeleton allows are ruled out without bounding each setting."""
        ctx = self._context(sk_id, sk, b, sp)
        return min((with_host(self._bound(ctx, sk_id, sk, Setting(b, m, schedule, v, zero, sp), 0.0, 0.0,
                                          every_zero=True), self.host_floor(sk, m))
                    for m, schedule, v in pipelinings), default=INF)

    def _bound(self, ctx: "_Context", sk_id: int, sk: Skeleton, st: Setting, extra: float,
               period_floor: float, every_zero: bool = False) -> float:
        """time_bound() given the recomputation time forced by memory (``extra``);
        ``every_zero``: leave out what only some ZeRO stages pay (see item_bound)."""
        # Gradients are reduced and ZeRO shards over the data x context ranks.
        P, dp, m, v = sk.pp, sk.shards, st.num_micro_batches, st.virtual_stages
        tables = self.tables
        if ctx.one_kind:
            period = (ctx.spread + extra) / P
        else:
            period = self._mixed_period(sk_id, sk, st)
            if period == INF:
                return INF
            # The recomputation memory forces, spread at each group's relative speed.
            period = max(period, (ctx.least_work + extra) / ctx.speed_share)
        total = ctx.least_work + extra
        period = max(period, ctx.pigeonhole, period_floor)
        # Every rank's work is part of the total.
        total = max(total, period)
        first = ctx.first
        if st.zero >= 3 and dp > 1 and not every_zero:
            # Each stage costs at least its parameter gather + gradient scatter; on a dense
            # model its forward waits for one gather and its backward for a second (the
            # forward freed the gathered weights) besides the scatter and the copies beside
            # them (search.evaluate charges them so).
            params, stack = first.params, tables.stack
            a_g, b_g, a_s, b_s = self._zero3(sk_id, sk)
            gathers = 1 if tables.model.num_experts else 2
            beside = 0.0 if gathers == 1 else self._zero3_beside(sk)
            gs = (gathers * a_g + a_s) * P * v + (gathers * b_g * stack.gathered_weights_bytes_per_param
                                                  + b_s * stack.grad_reduce_bytes_per_param + beside) * params
            period = max(period, gs / P)
        if P == 1:
            bound = m * period
            if dp > 1 and st.zero < 3 and not every_zero:
                kind = tables.stack.grad_reduce_kind(st.zero)
                bound += tables.dp_collective(sk.groups[0], first.params * tables.stack.grad_reduce_bytes_per_param,
                                              kind) / self.L
            return bound + first.params / (dp if st.zero >= 1 else 1) * tables.optimizer_rate(sk.kinds[0].pool)
        # Every boundary is crossed once each way per chunk round (interleaved chunks also
        # cross from the last group back to the first).
        full, rest = divmod(P * v - 1, P)
        comm = full * (ctx.prefix[P - 1] + ctx.wrap) + ctx.prefix[rest]
        if tables.options.blocking_p2p:
            # Blocking sends hold their rank: every rank's time per micro-batch includes them.
            total += comm
            period = max(period, total / P)
        if simulated(st, P):
            # Timed by simulation: the closed form's fill can exceed the simulated fill when
            # stages are lopsided, so only sure bounds: the busiest rank's work, and one
            # micro-batch's way through every stage and back.
            # Stage g cannot start before micro-batch 0 has crossed the stages before it,
            # then works m * W_g, then the last micro-batch drains back through them:
            # T >= prefix_g + m W_g for every g, whose least max over splits equalizes the
            # terms: T = total / (1 - (1 - 1/m)^pp). Zero-bubble's weight-gradient passes
            # leave the chain, so there only a share kappa of each stage's work counts.
            kappa = ctx.kappa if st.schedule == "zero-bubble" else 1.0
            chain = kappa * total
            if v == 1:
                chain = max(chain, kappa * total / (1 - (1 - kappa / m) ** P))
            return max(m * period, chain)
        if st.schedule == "gpipe":
            pipe = total + (m - 1) * period
        elif st.schedule == "zero-bubble":
            # ZB-H1's bubble is sum(F + B_in - B_w) - max(...), and no stage's term
            # exceeds the period.
            pipe = (m - 1) * period + ctx.zb_fill
        else:
            pipe = (m - 1.0 / v) * period + total / v
        return pipe + comm


@dataclass
class _Context:
    """What the time bounds of one skeleton at one micro-batch size share (see
    :meth:`Bounds._context`)."""

    summaries: list
    """The KindSummary of each distinct device kind of the pipeline."""
    first: KindSummary
    """The first kind's (the only one on a pipeline of one kind)."""
    one_kind: bool
    """All groups of one device kind."""
    who: object
    """Key of the recompute bound: what it depends on of the skeleton."""
    spread: float | None
    """One kind: the whole model's work per micro-batch (divided by pp, the least period)."""
    speed_share: float
    """sum over groups of their speed relative to the fastest kind."""
    pigeonhole: float
    """The least work of the ceil(units / pp) units some stage must hold."""
    least_work: float
    """The least whole-model work per micro-batch over the kinds."""
    prefix: list
    """Sends of the consecutive boundaries, summed (see Bounds._comm_prefix)."""
    wrap: float
    """Sends of the boundary from the last group back to the first."""
    kappa: float
    """Zero-bubble: the share of a stage's work on the critical chain."""
    zb_fill: float
    """Zero-bubble's least fill over the kinds."""


def _single_mode_period(cost: np.ndarray, most: np.ndarray, mult: np.ndarray, count: int) -> float:
    """memory_period where each rank holds one stage, so one recompute mode: a rank that
    holds ``most[i, q]`` virtual units in mode ``q`` at the most takes ``k_i(tau) = max_q
    min(tau / cost[q], most[i, q])`` units at period ``tau`` (``mult[i]`` ranks alike); the
    least ``tau`` at which they take ``count`` units. ``cost``: per mode, or per rank and
    mode (ranks of several device kinds). The total is continuous, increasing and linear
    between the kinks ``cost[i, q] * most[i, q']`` (every place a min or the max can
    switch), so the answer is interpolated exactly between the two kinks around it."""
    cost = np.broadcast_to(np.atleast_2d(cost), most.shape)
    kinks = np.unique((cost[:, :, None] * most[:, None, :]).ravel())
    kinks = kinks[np.isfinite(kinks) & (kinks > 0)]
    reach = (np.minimum(kinks[:, None, None] / cost[None], most[None]).max(axis=2)
             * mult[None, :]).sum(axis=1)
    i = int(np.searchsorted(reach >= count, True))   # (the last kink holds every rank's most)
    if i >= len(kinks):
        return float(kinks[-1]) if len(kinks) else 0.0
    lo_t, lo_v = (float(kinks[i - 1]), float(reach[i - 1])) if i > 0 else (0.0, 0.0)
    hi_t, hi_v = float(kinks[i]), float(reach[i])
    tau = hi_t if hi_v <= lo_v else lo_t + (count - lo_v) * (hi_t - lo_t) / (hi_v - lo_v)
    return max(lo_t, tau * (1.0 - 1e-12))   # (a lower bound: rounding must not lift it above)


def _share_period(ranks: dict, units: dict) -> float:
    """Bounds.share_period over ranks given as {(unit key, in-flight counts per chunk, budgets
    per chunk, per chunk 1 if it is the first stage, 2 if the last): how many ranks alike},
    with ``units[unit key]`` = ((cost[q], activation bytes[q], states, count) of the rank's
    virtual unit, its (first, last) end units or None, see Bounds._end_units). All ranks at
    once: a few numpy operations per chunk position."""
    count = next(iter(units.values()))[0][3]
    if count == 0:
        return 0.0
    keys = list(ranks)
    mult = np.array([ranks[k] for k in keys])
    n = np.array([k[1] for k in keys], dtype=float)                 # (ranks, chunks)
    budget = np.array([k[2] for k in keys], dtype=float)
    where = np.array([k[3] for k in keys])
    cost = np.array([units[k[0]][0][0] for k in keys])[:, None, :]   # (ranks, 1, modes)
    act = np.array([units[k[0]][0][1] for k in keys])[:, None, :]
    states = np.array([units[k[0]][0][2] for k in keys])[:, None, None]
    # The first and last stages hold the end units besides any virtual ones (in the
    # stage's one mode); a stage holding one may hold no virtual unit, every other must.
    extra_cost = np.zeros(n.shape + (cost.shape[2],))
    extra_bytes = np.zeros(extra_cost.shape)
    exempt = np.zeros(n.shape, dtype=bool)
    for r, k in enumerate(keys):
        for bit, end in zip((1, 2), units[k[0]][1]):
            # (Only the ranks of the first and last stages hold end units: a plain test
            # of the key skips the others without numpy.)
            if end is None or not any(x & bit for x in k[3]):
                continue
            at = (where[r] & bit) > 0
            e_cost, e_act, e_states = end
            extra_cost[r] += at[:, None] * e_cost
            extra_bytes[r] += at[:, None] * (e_states + n[r][:, None] * e_act)
            exempt[r] |= at
    # Per chunk and mode, the most whole virtual units within the budget (-1: not even the
    # end unit fits in that mode).
    room = budget[..., None] - extra_bytes
    most = np.where(room >= 0, np.floor(np.maximum(room, 0.0) / (states + n[..., None] * act) * (1 + 1e-12)), -1.0)
    forced = (~exempt).sum(axis=1)
    # No rank usefully holds more than what the others' forced units leave.
    top = min(count, int(count - (forced * mult).sum() + forced.max()))
    if top < 0:
        return INF
    # Nor more than its chunks hold at their most: past that every least time below is
    # infinite, so the arrays stop there (the same answer from smaller arrays).
    top = min(top, int(np.clip(most.max(axis=2), 0, top).sum(axis=1).max()))
    xs = np.arange(top + 1)
    # t[r, c, x]: x units in chunk c of rank r, in the cheapest mode they fit in (fitting
    # is monotone in x, so t is finite on an interval, and does not decrease on it).
    t = np.where(xs[None, None, :, None] <= most[:, :, None, :],
                 xs[None, None, :, None] * cost[:, :, None, :] + extra_cost[:, :, None, :], INF).min(axis=3)
    t[:, :, 0] = np.where(exempt, t[:, :, 0], INF)
    # T[r, X]: least time of X units on rank r, the min-plus convolution over its chunks.
    rest = xs[None, :] - xs[:, None]                                   # [x, X]: X - x
    shift = np.clip(rest, 0, None)
    least = t[:, 0, :]
    for c in range(1, t.shape[1]):
        prev = np.where(rest >= 0, least[:, shift], INF)               # (ranks, x, X)
        least = (t[:, c, :, None] + prev).min(axis=1)
    finite = np.isfinite(least)
    if not finite.any(axis=1).all():
        return INF                                 # some rank cannot hold its chunks' units
    # Past every rank's forced units, rank r takes K_r(tau) = the most X with T[r, X] <= tau;
    # T is non-decreasing on the interval where it is finite, so that is its start plus the
    # count of entries within tau, less one.
    lo = finite.argmax(axis=1)
    lowest = float(least[np.arange(len(keys)), lo].max())
    taus = np.unique(least[finite & (least >= lowest)])
    within = (least[:, :, None] <= taus[None, None, :]).sum(axis=1)  # (ranks, taus)
    reach = ((lo[:, None] + within - 1) * mult[:, None]).sum(axis=0)
    ok = np.nonzero(reach >= count)[0]
    if len(ok) == 0:
        return INF                                 # not even every chunk at its most
    return float(taus[int(ok[0])]) * (1.0 - 1e-12)   # (a lower bound: rounding must not lift it above)


def _p2p_eval(classes: tuple[tuple[float, float, int], ...], nbytes: float) -> float:
    """The cost model's p2p_time from its pair classes (see Tables.p2p_classes)."""
    if nbytes <= 0:
        return 0.0
    return max((lat + nbytes / width * rate for lat, rate, width in classes), default=0.0)


def _summarize(cost: np.ndarray, act: np.ndarray, params: float, t, zb_fill: float) -> KindSummary:
    """A KindSummary from per-(mode, unit) costs and activations (modes fastest first)."""
    # Breakpoints of the dual: where a unit switches to a leaner mode.
    lams = {0.0}
    for i in range(len(cost)):
        for j in range(len(cost)):
            da = act[i] - act[j]
            dc = cost[j] - cost[i]
            ok = (da > 0) & (dc >= 0)
            lams.update(np.round(dc[ok] / da[ok], 30).tolist())
    lam = np.array(sorted(lams))
    dual = np.array([float((cost + x * act).min(axis=0).sum()) for x in lam])
    unit = cost[0]
    out = t.output_bytes[:-1]
    return KindSummary(work=float(unit.sum()), params=params, act_lean=float(act.min(axis=0).sum()),
                       smallest=np.concatenate(([0.0], np.cumsum(np.sort(unit)))),
                       out_bytes=float(out.min()) if len(out) else 0.0,
                       zb_fill=zb_fill, lam=lam, dual=dual)


def _zb_fill(t, q: int) -> float:
    """sum over units of F + B_input - B_weight (zero-bubble's per-stage fill terms)."""
    return float((t.forward + t.backward_input[q] - t.backward_weight).sum())
