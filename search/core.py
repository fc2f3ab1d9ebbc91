"""The search: enumerate pipelines of device groups and settings, bound, split, rank.

Phases (each timed in ``SearchStats.phase_s``):

1. **placement** - the pipelines of device groups ("skeletons"). On a single node
   group every (tp, pp, dp) mesh is one skeleton, ranks in Megatron order (tensor
   parallel fastest, then data, then pipeline). On several node groups CP-SAT chooses
   which node groups serve which pipeline positions with which tp (:mod:`search.placement`).
2. **enumerate** - every skeleton x setting (micro-batch, schedule, virtual stages,
   ZeRO, sequence parallel) gets two cheap bounds: a memory lower bound (states spread
   perfectly, the leanest recompute allowed) that prunes it outright, and a time lower
   bound (perfectly balanced work plus the schedule's fill) that orders the rest.
3. **split** - branch and bound in the order of the time bound: each candidate gets its
   layer split and per-stage recompute from the DP (:mod:`search.split`) and a
   closed-form time (:mod:`search.evaluate`); once the bound of the next candidate
   cannot beat the shortlist, the rest are pruned unexamined.
4. **estimate** - the shortlist goes through the full cost model
   (``costmodel.estimate``: schedule program, event simulation) and is ranked by it.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import replace

from autoplan.cluster import Cluster
from autoplan.errors import ConfigError, NoPlanFitsError
from autoplan.models.spec import ModelSpec
from autoplan.plan import DeviceGroup, Plan, Stage
from autoplan.units import GiB
from costmodel import estimate as full_estimate
from search.bounds import Bounds
from search.evaluate import Candidate, Setting, Skeleton, analyze, program_actions, simulated
from search.placement import PlacementStats, allocate, place, pool_kinds
from search.progress import Progress
from search.result import RankedPlan, SearchResult, SearchStats
from search.space import Constraints, divisors
from search.split import INF, Split, Splitter
from search.tables import Kind, Tables


def search(model: ModelSpec, cluster: Cluster, global_batch: int, **constraints) -> SearchResult:
    """Best plans for training ``model`` on ``cluster`` with ``global_batch`` samples per
    iteration. Keyword constraints narrow the space (see :class:`search.space.Constraints`).

    Raises NoPlanFitsError when no plan in the space fits in memory; the message gives
    the leanest plan's memory per device type and what would make one fit."""
    if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch < 1:
        raise ConfigError("global_batch", f"must be a positive integer, got {global_batch!r}")
    c = Constraints.build(**constraints)
    engine = c.engine()
    if engine.name != "autoplan":
        # The engine trains in the dtype the devices have (fp16 where a device lacks bf16,
        # fp32 where the engine has no fp16): plan and estimate in that dtype.
        dtype = engine.dtype_for(cluster, model.dtype)
        if dtype != model.dtype and model.config is not None:
            from autoplan.models import from_config
            model = from_config(model.config, dtype)
        refusal = model_violation(model, engine)
        if refusal is not None:
            raise refusal
    return _Search(model, cluster, global_batch, c).run()


def model_violation(model: ModelSpec, engine) -> ConfigError | None:
    """Why ``engine`` cannot train ``model`` at all (whatever the plan), or None."""
    from autoplan.engines import violation
    from autoplan.plan import Stage
    one = Plan(groups=(DeviceGroup(ranks=(0,), tp=1),), stages=(Stage(0, model.num_layers, 0),),
               micro_batch=1, num_micro_batches=1, dtype=model.dtype, model=model.name, seq_len=model.seq_len)
    err = violation(one, engine, model)
    return err if err is not None and err.field == "model" else None


PLACEMENT_MICRO_BATCHES = 2
"""Micro-batch sizes (the smallest ones) CP-SAT places device groups for, per dp."""
REFINE_ACTIONS = 256
"""Refine splits by local search only for programs this short (a few dozen simulations
of at most this many actions each): there the fill and drain, not the period the DP
balances, make much of the time."""
REFINE_WINDOW = 1.1
"""Refine a split only when its time is within this factor of the shortlist's worst (or the
shortlist is not full): refining rarely gains more than that."""


class _Search:
    def __init__(self, model: ModelSpec, cluster: Cluster, global_batch: int, c: Constraints):
        self.model, self.cluster, self.gb, self.c = model, cluster, global_batch, c
        self.dtype = model.dtype
        self.options = c.estimate_options()
        self.tables = Tables(model, cluster, self.dtype, self.options)
        self.splitter = Splitter(self.tables)
        self.stats = SearchStats()
        self.progress = Progress(c.progress)
        self.L = model.num_layers
        self.modes = c.recompute
        self.bounds = Bounds(self.tables, self.modes, global_batch)
        self.refine_left = c.refine_evaluations
        self.engine = c.engine()
        self.restricted = self.engine.name != "autoplan"

    # ------------------------------------------------------------ options
    def tp_options(self) -> list[int]:
        gpn = max(g.gpus_per_node for g in self.cluster.groups)
        allowed = self.model.tp_degrees(gpn)
        return [t for t in allowed if self.c.tp is None or t in self.c.tp]

    def dp_options(self) -> list[int]:
        n = self.cluster.num_gpus
        return [d for d in divisors(self.gb) if d <= n and (self.c.dp is None or d in self.c.dp)]

    def ep_options(self, dp: int) -> list[int]:
        """Expert-parallel degrees for dp replicas: divisors of dp that divide the model's
        experts (just 1 for a dense model)."""
        experts = self.model.num_experts
        return [e for e in divisors(dp) if (e == 1 or (experts and experts % e == 0))
                and (self.c.ep is None or e in self.c.ep)]

    def with_ep(self, sk: Skeleton) -> list[Skeleton]:
        """The skeleton under every expert-parallel degree its data parallelism allows."""
        return [Skeleton(groups=sk.groups, kinds=tuple(replace(k, ep=e) for k in sk.kinds))
                for e in self.ep_options(sk.dp)]

    def pp_options(self) -> list[int]:
        if self.c.pp is not None:
            return [p for p in self.c.pp if p <= self.L]
        return list(range(1, self.L + 1))

    def mb_options(self, dp: int) -> list[int]:
        per_replica = self.gb // dp
        if self.c.micro_batch is not None:
            return [b for b in self.c.micro_batch if per_replica % b == 0]
        return [b for b in divisors(per_replica) if b <= self.c.max_micro_batch]

    def schedules(self, pp: int) -> list[str]:
        if pp == 1:
            # One stage is plain gradient accumulation: there is no pipeline to fill, so
            # one schedule stands for all of them (1F1B: one micro-batch in flight; GPipe
            # would only hold more, and a "zero-bubble" or "interleaved" label on a
            # single stage would mislead whoever reads the plan).
            flat = [s for s in self.c.schedules if s != "interleaved-1f1b"]
            return ["1f1b"] if "1f1b" in flat else flat[:1]
        return list(self.c.schedules)

    def settings(self, sk: Skeleton):
        P, dp = sk.pp, sk.dp
        any_tp = any(k.tp > 1 for k in sk.kinds)
        # Settings that change nothing are tried once: ZeRO without data parallelism,
        # sequence parallelism without tensor parallelism.
        sps = self.c.sequence_parallel if any_tp else (min(self.c.sequence_parallel),)
        zeros = self.c.zero if dp > 1 else (min(self.c.zero),)
        # ZeRO 0-2 share a time bound (they differ in memory and in the gradient
        # reduction only); ZeRO-3 adds gathers to every micro-batch.
        low = tuple(z for z in zeros if z < 3 or dp == 1)
        z3 = dp > 1 and 3 in zeros
        for b, m, sched, v in self._pipelinings(P, dp):
            for sp in sps:
                base = Setting(b, m, sched, v, 0, sp)
                ok_low = tuple(z for z in low if self._runs_on_target(sk, replace(base, zero=z)))
                if ok_low:
                    yield replace(base, zero=ok_low[-1]), ok_low
                if z3 and self._runs_on_target(sk, replace(base, zero=3)):
                    yield replace(base, zero=3), (3,)

    def _runs_on_target(self, sk: Skeleton, st: Setting) -> bool:
        """The target engine can run this mesh and setting (the split and recomputation are
        decided later, under the engine's rules for those); counts what it cannot."""
        if not self.restricted:
            return True
        from autoplan.engines import partition_uniform, violation
        S = sk.pp * st.virtual_stages
        if S > self.L:
            return True   # no split exists; the splitter says so
        cuts = partition_uniform(self.L, S)
        probe = Candidate(sk, st, tuple(zip(cuts, cuts[1:])), (self.modes[0],) * S).to_plan(self.model, self.dtype)
        err = violation(probe, self.engine, self.model, self.cluster)
        if err is None or err.field.startswith("stages"):
            return True
        self.stats.excluded_by_target += 1
        return False

    def _pipelinings(self, P: int, dp: int):
        """(micro-batch, micro-batches, schedule, virtual stages) a pipeline of depth P
        with dp replicas may run."""
        for b in self.mb_options(dp):
            m = self.gb // (dp * b)
            for sched in self.schedules(P):
                if sched != "interleaved-1f1b":
                    yield b, m, sched, 1
                elif P > 1 and m % P == 0:
                    vs = self.c.virtual_stages or range(2, self.c.max_virtual_stages + 1)
                    for v in vs:
                        if v >= 2 and P * v <= self.L:
                            yield b, m, sched, v

    # --------------------------------------------------------- skeletons
    def homogeneous_skeletons(self) -> list[Skeleton]:
        ng = self.cluster.groups[0]
        n = self.cluster.num_gpus
        out = []
        for tp in self.tp_options():
            if ng.gpus_per_node % tp:
                continue
            for dp in self.dp_options():
                for pp in self.pp_options():
                    used = tp * dp * pp
                    if used > n or (self.c.use_all_gpus and used != n):
                        continue
                    per = tp * dp
                    groups = tuple(DeviceGroup(ranks=tuple(range(p * per, (p + 1) * per)), tp=tp)
                                   for p in range(pp))
                    out += self.with_ep(Skeleton(groups=groups, kinds=(Kind(0, tp),) * pp))
        return out

    def heterogeneous_skeletons(self, pstats: PlacementStats) -> list[Skeleton]:
        seen: dict[tuple, Skeleton] = {}
        # The sequence of device groups depends on the micro-batch only through memory:
        # placing for the two smallest sizes covers the ones that fit best; the DP then
        # tries every micro-batch size on every sequence.
        keys = [(dp, b) for dp in self.dp_options() for b in self.mb_options(dp)[:PLACEMENT_MICRO_BATCHES]]
        self.progress.phase("placement", len(keys))
        max_pp = max(self.pp_options()) if self.pp_options() else 0
        # An engine with one tensor-parallel size per job gets pipelines of one degree each.
        tp_sets = [[t] for t in self.tp_options()] if self.engine.uniform_tp and self.restricted \
            else [self.tp_options()]
        for dp, b in keys:
            self.progress.step()
            found = []
            for tps in tp_sets:
                kinds = pool_kinds(self.tables, dp, tps)
                if not kinds:
                    continue
                found += place(self.tables, dp=dp, micro_batch=b, num_micro_batches=self.gb // (dp * b),
                               sequence_parallel=True in self.c.sequence_parallel, kinds=kinds,
                               zeros=list(self.c.zero), modes=list(self.modes),
                               max_stages=min(self.c.max_stages, max_pp), use_all_gpus=self.c.use_all_gpus,
                               alternatives=self.c.placement_alternatives,
                               det_time_limit=self.c.placement_time_limit, seed=self.c.seed, stats=pstats)
            for sk in found:
                if self.c.pp is not None and sk.pp not in self.c.pp:
                    continue
                for variant in self.with_ep(sk):
                    seen.setdefault((variant.groups, variant.kinds), variant)
        return list(seen.values())

    # ------------------------------------------------------------- bounds
    def memory_bound_ok(self, sk: Skeleton, st: Setting) -> bool:
        """False when even a perfect spread of states and activations cannot fit (one
        device kind only; mixed pipelines are sized by the placement model)."""
        if len(set(sk.kinds)) != 1:
            return True
        kind = sk.kinds[0]
        summ = self.bounds.summary(kind, st.micro_batch, st.sequence_parallel)
        params, act = summ.params, summ.act_lean
        states = self.tables.state_bytes(params, 0.0, sk.dp, st.zero)
        P, m = sk.pp, st.num_micro_batches
        if st.virtual_stages == 1:
            # GPipe holds every micro-batch; 1F1B holds pp - g on rank g, and zero-bubble
            # holds at least that many (it releases at the later weight-gradient pass).
            counts = [m] * P if st.schedule == "gpipe" else [min(P - g, m) for g in range(P)]
            need = max(states / P, act / sum(1.0 / n for n in counts),
                       (states + min(counts) * act) / P)
        else:
            need = states / P
        cap = self.tables.capacity(kind.pool)
        return self.tables.fixed_bytes(kind.pool) + need <= cap

    # ---------------------------------------------------------------- run
    def run(self) -> SearchResult:
        t_start = time.perf_counter()
        stats = self.stats
        try:
            while True:
                t0 = time.perf_counter()
                if len(self.cluster.groups) == 1:
                    skeletons = self.homogeneous_skeletons()
                else:
                    stats.placement = PlacementStats()
                    skeletons = self.heterogeneous_skeletons(stats.placement)
                stats.skeletons = len(skeletons)
                stats.phase_s["placement"] = time.perf_counter() - t0

                t0 = time.perf_counter()
                short = self._best_first(skeletons)
                if short or self.tables.margin == 0:
                    break
                # Nothing fits with the safety margin free: look again for plans that fit
                # at all (they come out marked tight).
                self.tables.margin = 0.0
                stats.tight_fallback = True
            stats.phase_s["split"] = time.perf_counter() - t0 - stats.phase_s.get("bounds", 0.0)
            stats.splits = self.splitter.runs
            stats.shortlisted = len(short)
            if not short:
                raise NoPlanFitsError(self._no_fit_message(skeletons))

            t0 = time.perf_counter()
            ranked = self._estimate(short)
            stats.phase_s["estimate"] = time.perf_counter() - t0
            if not ranked:
                raise NoPlanFitsError(self._no_fit_message(skeletons))
        finally:
            self.progress.close()
        stats.total_s = time.perf_counter() - t_start
        return SearchResult(ranked=ranked, stats=stats, cluster=self.cluster, model_name=self.model.name,
                            target=self.engine.name, stack=self.options.stack.name,
                            global_batch=self.gb)

    def _count(self, sk: Skeleton) -> int:
        """Candidates of a skeleton (what settings() yields, times its ZeRO stages)."""
        P, dp = sk.pp, sk.dp
        n_sp = len(self.c.sequence_parallel) if any(k.tp > 1 for k in sk.kinds) else 1
        n_zero = len(self.c.zero) if dp > 1 else 1
        return sum(1 for _ in self._pipelinings(P, dp)) * n_sp * n_zero

    def _best_first(self, skeletons: list[Skeleton]) -> list[tuple]:
        """Branch and bound over (skeleton, setting) in increasing order of the time bound.

        Skeletons enter with a bound valid for all their settings (the whole model's work
        spread over the groups, at the most efficient micro-batch); a skeleton's settings
        are only enumerated and bounded once that bound is the smallest left, so meshes
        that cannot beat the shortlist are never expanded. Each candidate then gets its
        split from the DP, with a period limit derived from the current shortlist."""
        keep = self.c.max_estimates
        stats = self.stats
        t_bounds = time.perf_counter()
        order = sorted((self.bounds.skeleton_bound(si, sk, self.mb_options(sk.dp), self.c.sequence_parallel), si)
                       for si, sk in enumerate(skeletons))
        sizes = [self._count(sk) for sk in skeletons]
        stats.candidates = sum(sizes)
        bounds_s = time.perf_counter() - t_bounds
        pending: list[tuple] = []     # (bound, counter, skeleton, setting, zeros)
        shortlist: list[tuple] = []   # (-time, -order, candidate): the worst on top
        counter = 0
        next_sk = 0
        examined = 0
        self.progress.phase("split", stats.candidates)

        def threshold() -> float:
            return -shortlist[0][0] if len(shortlist) >= keep else INF

        while True:
            sk_bound = order[next_sk][0] if next_sk < len(order) else INF
            cfg_bound = pending[0][0] if pending else INF
            if min(sk_bound, cfg_bound) >= threshold() or min(sk_bound, cfg_bound) == INF:
                break
            if sk_bound <= cfg_bound:
                # Expand the skeleton: bound each of its settings.
                t = time.perf_counter()
                si = order[next_sk][1]
                next_sk += 1
                sk = skeletons[si]
                for st, zeros in self.settings(sk):
                    bound = self.bounds.time_bound(si, sk, st)
                    if bound == INF:
                        stats.pruned_memory_bound += len(zeros)
                        self.progress.step(len(zeros))
                        continue
                    heapq.heappush(pending, (bound, counter, si, st, zeros))
                    counter += 1
                bounds_s += time.perf_counter() - t
                continue
            bound, cnt, si, st0, zeros = heapq.heappop(pending)
            sk = skeletons[si]
            for zi, z in enumerate(zeros):
                examined += 1
                self.progress.step()
                st = replace(st0, zero=z)
                if z != zeros[-1] and not self.memory_bound_ok(sk, st):
                    stats.pruned_memory_bound += 1
                    continue
                # No stage may be slower than what could still beat the shortlist.
                limit = INF
                if len(shortlist) >= keep:
                    m = st.num_micro_batches
                    denom = m if st.schedule == "zero-bubble" else m - 1
                    limit = threshold() / denom if denom > 0 else INF
                best = self._split(sk, st, limit, threshold())
                if best is None:
                    stats.pruned_no_split += 1
                    continue
                split, analysis = best
                cand = Candidate(sk, st, split.bounds, split.recompute, analysis)
                item = (-analysis.time_s, -(cnt * 4 + zi), cand)
                if len(shortlist) < keep:
                    heapq.heappush(shortlist, item)
                elif item > shortlist[0]:
                    heapq.heapreplace(shortlist, item)
        stats.pruned_time_bound = stats.candidates - examined - stats.pruned_memory_bound
        stats.phase_s["bounds"] = bounds_s
        return sorted(((-t, -o, cand) for t, o, cand in shortlist), key=lambda x: (x[0], x[1]))

    def _split(self, sk: Skeleton, st: Setting, limit: float, threshold: float = INF):
        """(split, analysis) of the best fitting split the target engine can run, or None:
        engines with one recomputation setting get the best split per mode, and an engine
        that fixes the split (DeepSpeed's uniform partition) gets only that split."""
        e = self.engine
        if not self.restricted:
            return self._split_modes(sk, st, limit, threshold, self.modes)
        S = sk.pp * st.virtual_stages
        best = None
        for mode in (self.modes if e.uniform_recompute else (None,)):
            modes = (mode,) if mode is not None else self.modes
            if e.split == "uniform-units" and sk.pp > 1:
                from autoplan.engines import partition_uniform
                cuts = partition_uniform(self.L, S)
                bounds = tuple(zip(cuts, cuts[1:]))
                analysis, _ = analyze(self.tables, sk, st, bounds, modes * S)
                found = (Split(bounds=bounds, recompute=modes * S, period=0.0, total=0.0), analysis) \
                    if analysis.fits else None
            else:
                found = self._split_modes(sk, st, limit, threshold, modes)
            if found is not None and (best is None or found[1].time_s < best[1].time_s):
                best = found
        return best

    def _split_modes(self, sk: Skeleton, st: Setting, limit: float, threshold: float, modes: tuple[str, ...]):
        """(split, analysis) of the best fitting split found with per-stage recompute from
        ``modes``, or None. Interleaved chunks share their group's memory, so their DP works
        on per-chunk targets and the exact joint peak decides; the group-balanced split
        competes with the DP's."""
        if st.virtual_stages == 1:
            tries = [lambda: self.splitter.split(sk, st, modes, period_limit=limit)]
        else:
            tries = [lambda: self.splitter.split(sk, st, modes, period_limit=limit, joint=True),
                     lambda: self.splitter.balanced_interleave(sk, st, modes)]
        best = None
        for attempt in (tries, [lambda: self.splitter.split(sk, st, modes, period_limit=limit)]):
            for make in attempt:
                split = make()
                if split is None:
                    continue
                analysis, _ = analyze(self.tables, sk, st, split.bounds, split.recompute)
                if analysis.fits and (best is None or analysis.time_s < best[1].time_s):
                    best = (split, analysis)
            if best is not None or st.virtual_stages == 1:
                break
        if best is None and st.virtual_stages > 1:
            # Chunks share one memory and the DPs' per-chunk budgets are conservative: the
            # leanest split (balanced for memory instead of time) may still fit exactly.
            for joint in (True, False):
                split = self.splitter.split(sk, st, modes, objective="memory", joint=joint)
                if split is not None:
                    analysis, _ = analyze(self.tables, sk, st, split.bounds, split.recompute)
                    if analysis.fits:
                        best = (split, analysis)
                        break
        if best is not None and simulated(st, sk.pp) and program_actions(st, sk.pp) <= REFINE_ACTIONS \
                and self.refine_left > 0 and best[1].time_s < REFINE_WINDOW * threshold:
            best = self._refine(sk, st, *best, modes=modes)
        return best

    def _refine(self, sk: Skeleton, st: Setting, split: Split, analysis, budget: int = 200,
                modes: tuple[str, ...] | None = None):
        """Local search around the DP's split for short programs, which are timed by exact
        simulation: there the fill and drain, which the DP's period-first objective only
        approximates, decide. Moves: shift a run of consecutive stage boundaries by one
        unit (one boundary, or several together, which moves a unit across stages), or
        change one stage's recompute mode; take the first improving move, repeat
        (deterministic)."""
        modes = modes or modes
        bounds, rec = list(split.bounds), list(split.recompute)
        best_t = analysis.time_s
        tried = 0
        improved = True
        while improved and tried < budget and self.refine_left > 0:
            improved = False
            moves = []
            cuts = [b for _, b in bounds[:-1]]
            for j in range(len(cuts)):
                for k in range(j, len(cuts)):
                    for d in (-1, 1):
                        moves.append(("shift", (j, k), d))
            # A unit crossing a boundary can change what the two stages must recompute.
            for j in range(len(cuts)):
                for d in (-1, 1):
                    for m1 in modes:
                        for m2 in modes:
                            if (m1, m2) != (rec[j], rec[j + 1]):
                                moves.append(("shift+modes", (j, m1, m2), d))
            for j in range(len(bounds)):
                for mode in modes:
                    if mode != rec[j]:
                        moves.append(("mode", j, mode))
            for mode in modes:
                if any(r != mode for r in rec):
                    moves.append(("all", None, mode))
            for kind, j, arg in moves:
                nb, nr = list(bounds), list(rec)
                if kind == "shift+modes":
                    jj, m1, m2 = j
                    nr[jj], nr[jj + 1] = m1, m2
                    j = (jj, jj)
                if kind in ("shift", "shift+modes"):
                    new_cuts = [c + arg if j[0] <= i <= j[1] else c for i, c in enumerate(cuts)]
                    edges = [0] + new_cuts + [bounds[-1][1]]
                    if any(b <= a for a, b in zip(edges, edges[1:])):
                        continue
                    nb = [(edges[i], edges[i + 1]) for i in range(len(bounds))]
                elif kind == "all":
                    nr = [arg] * len(rec)
                else:
                    nr[j] = arg
                tried += 1
                self.refine_left -= 1
                a, _ = analyze(self.tables, sk, st, nb, nr)
                if a.fits and a.time_s < best_t * (1 - 1e-12):
                    bounds, rec, best_t, analysis = nb, nr, a.time_s, a
                    improved = True
                    break
                if tried >= budget or self.refine_left <= 0:
                    break
        return Split(bounds=tuple(bounds), recompute=tuple(rec), period=split.period, total=split.total), analysis

    def _estimate(self, short: list[tuple]) -> list[RankedPlan]:
        budget = self.c.estimate_actions
        used = 0
        done = []
        self.progress.phase("estimate", len(short))
        for i, (t, order, cand) in enumerate(short):
            st = cand.setting
            actions = cand.skeleton.pp * st.virtual_stages * st.num_micro_batches * (
                3 if st.schedule == "zero-bubble" else 2)
            if done and used + actions > budget:
                break
            used += actions
            plan = cand.to_plan(self.model, self.dtype)
            if self.restricted:
                from autoplan.engines import violation
                if violation(plan, self.engine, self.model, self.cluster) is not None:
                    self.stats.excluded_by_target += 1
                    continue
            est = full_estimate(self.model, self.cluster, plan, self.options)
            self.stats.estimates += 1
            self.progress.step()
            if not est.fits:
                self.stats.estimate_fit_mismatch += 1
                continue
            done.append((est.iteration_time_s, i, RankedPlan(rank=0, plan=plan, estimate=est, predicted_s=t,
                                                             gpus_used=plan.num_gpus)))
        # Plans with room first; a tight plan (within the memory margin) ranks after them.
        done.sort(key=lambda x: (x[2].estimate.tight, x[0], x[1]))
        out = []
        for r, (_, _, rp) in enumerate(done, 1):
            rp.rank = r
            out.append(rp)
        return out

    # ------------------------------------------------------- no plan fits
    def _lean_skeletons(self, skeletons: list[Skeleton]) -> list[Skeleton]:
        if len(self.cluster.groups) == 1:
            return skeletons or self.homogeneous_skeletons()
        # Mixed clusters: every node group, its largest tp, as many device groups as it
        # holds (data parallel 1), roomiest devices first (they take the most activations).
        out = list(skeletons)
        tps = self.tp_options()
        for dp in self.dp_options()[:3]:
            seq = []
            order = sorted(range(len(self.cluster.groups)),
                           key=lambda k: (-self.cluster.groups[k].device.memory_bytes, k))
            for k in order:
                ng = self.cluster.groups[k]
                fit = [t for t in tps if ng.gpus_per_node % t == 0 and dp * t <= ng.num_gpus]
                if not fit:
                    continue
                t = max(fit)
                seq += [Kind(k, t)] * (ng.num_gpus // (dp * t))
            seq = seq[:self.L]
            sk = allocate(self.tables, dp, seq) if seq else None
            if sk is not None:
                out.append(sk)
        return out

    def _no_fit_message(self, skeletons: list[Skeleton]) -> str:
        c = self.c
        best = None
        for sk in self._lean_skeletons(skeletons):
            dp = sk.dp
            b = min(self.mb_options(dp) or [1])
            sched = self.schedules(sk.pp)
            sched = [s for s in sched if s != "interleaved-1f1b"] or sched
            if not sched:
                continue
            st = Setting(b, self.gb // (dp * b), "1f1b" if "1f1b" in sched else sched[0], 1,
                         max(c.zero) if dp > 1 else min(c.zero), True in c.sequence_parallel)
            split = self.splitter.split(sk, st, (self.modes[-1],), objective="memory")
            if split is None:
                continue
            if best is None or split.period < best[0]:
                best = (split.period, sk, st, split)
        total_mem = sum(g.device.memory_bytes * g.num_gpus for g in self.cluster.groups)
        lines = [f"No plan fits in memory: {self.model.name} (seq {self.model.seq_len}, global batch {self.gb}) "
                 f"on {self.cluster.num_gpus} GPUs ({total_mem / GiB:,.0f} GiB in all)."]
        fixes = []
        if best is not None:
            _, sk, st, split = best
            analysis, figs = analyze(self.tables, sk, st, split.bounds, split.recompute)
            cand = Candidate(sk, st, split.bounds, split.recompute, analysis)
            plan = cand.to_plan(self.model, self.dtype)
            per_type: dict[str, tuple[float, float]] = {}
            for g, k in enumerate(sk.kinds):
                dev = self.cluster.groups[k.pool].device
                prev = per_type.get(dev.name, (0.0, dev.memory_bytes))
                per_type[dev.name] = (max(prev[0], analysis.memory[g]), dev.memory_bytes)
            needs = "; ".join(f"{used / GiB:.1f} GiB per {name} GPU, which has {cap / GiB:.1f} GiB"
                              for name, (used, cap) in per_type.items())
            lines.append(f"The leanest plan in the search space ({plan.describe()}) needs {needs}.")
            act = sum(f.activation for f in figs)
            states = sum(f.params for f in figs)
            ratio = max(u / cap for u, cap in per_type.values())
            fixes.append(f"more GPUs (about {ratio:.1f}x the memory in all)")
            if "full" not in self.modes:
                fixes.append("allow full recomputation (recompute='full')")
            if 3 not in c.zero:
                fixes.append("allow ZeRO-3 (zero=3), which shards parameters too")
            if act > 0 and states >= 0:
                fixes.append(f"a shorter sequence than {self.model.seq_len} tokens (activations grow with it)")
            if c.micro_batch is not None and min(c.micro_batch) > 1:
                fixes.append("micro-batch 1")
        else:
            lines.append("Not even one layer fits on the devices under any setting in the search space.")
            fixes.append("GPUs with more memory")
            fixes.append("a shorter sequence")
        if self.restricted:
            lines.append(f"Only plans {self.engine.title} {self.engine.version} can run were searched "
                         "(search --for autoplan searches them all).")
        lines.append("To make one fit, try " + ", or ".join(fixes) + ".")
        return " ".join(lines)
