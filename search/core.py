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
from dataclasses import dataclass

from autoplan.cluster import Cluster
from autoplan.errors import ConfigError, NoPlanFitsError
from autoplan.models.spec import ModelSpec
from autoplan.plan import DeviceGroup
from autoplan.units import GiB
from costmodel import estimate as full_estimate
from search.evaluate import Candidate, Setting, Skeleton, analyze
from search.inflight import inflight
from search.placement import PlacementStats, allocate, place, pool_kinds
from search.progress import Progress
from search.result import RankedPlan, SearchResult, SearchStats
from search.space import Constraints, divisors
from search.split import Splitter
from search.tables import DYNAMIC_FACTOR, OVERHEAD, RECOMPUTES, Kind, Tables


def search(model: ModelSpec, cluster: Cluster, global_batch: int, **constraints) -> SearchResult:
    """Best plans for training ``model`` on ``cluster`` with ``global_batch`` samples per
    iteration. Keyword constraints narrow the space (see :class:`search.space.Constraints`).

    Raises NoPlanFitsError when no plan in the space fits in memory; the message gives
    the leanest plan's memory per device type and what would make one fit."""
    if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch < 1:
        raise ConfigError("global_batch", f"must be a positive integer, got {global_batch!r}")
    c = Constraints.build(**constraints)
    return _Search(model, cluster, global_batch, c).run()


@dataclass(order=True)
class _Config:
    bound: float
    order: int
    skeleton: int
    setting: Setting


class _Search:
    def __init__(self, model: ModelSpec, cluster: Cluster, global_batch: int, c: Constraints):
        self.model, self.cluster, self.gb, self.c = model, cluster, global_batch, c
        self.dtype = model.dtype
        self.tables = Tables(model, cluster, self.dtype, c.profiles)
        self.splitter = Splitter(self.tables)
        self.stats = SearchStats()
        self.progress = Progress(c.progress)
        self.L = model.num_layers
        self.modes = c.recompute
        self.q_fast = RECOMPUTES.index(self.modes[0])
        self.q_lean = RECOMPUTES.index(self.modes[-1])
        self._work: dict = {}

    # ------------------------------------------------------------ options
    def tp_options(self) -> list[int]:
        gpn = max(g.gpus_per_node for g in self.cluster.groups)
        allowed = self.model.tp_degrees(gpn)
        return [t for t in allowed if self.c.tp is None or t in self.c.tp]

    def dp_options(self) -> list[int]:
        n = self.cluster.num_gpus
        return [d for d in divisors(self.gb) if d <= n and (self.c.dp is None or d in self.c.dp)]

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
            # With one stage every schedule is the same program except GPipe (holds all
            # micro-batches) and zero-bubble (splits the backward for nothing): one is enough.
            for s in ("1f1b", "zero-bubble", "gpipe"):
                if s in self.c.schedules:
                    return [s]
            return []
        return list(self.c.schedules)

    def settings(self, sk: Skeleton):
        P, dp = sk.pp, sk.dp
        any_tp = any(k.tp > 1 for k in sk.kinds)
        # Settings that change nothing are tried once: ZeRO without data parallelism,
        # sequence parallelism without tensor parallelism.
        sps = self.c.sequence_parallel if any_tp else (min(self.c.sequence_parallel),)
        zeros = self.c.zero if dp > 1 else (min(self.c.zero),)
        for b in self.mb_options(dp):
            m = self.gb // (dp * b)
            for sched in self.schedules(P):
                if sched == "interleaved-1f1b":
                    if P == 1 or m % P:
                        continue
                    vs = self.c.virtual_stages or range(2, self.c.max_virtual_stages + 1)
                    vs = [v for v in vs if v >= 2 and P * v <= self.L]
                else:
                    vs = [1]
                for v in vs:
                    for z in zeros:
                        for sp in sps:
                            yield Setting(b, m, sched, v, z, sp)

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
                    out.append(Skeleton(groups=groups, kinds=(Kind(0, tp),) * pp))
        return out

    def heterogeneous_skeletons(self, pstats: PlacementStats) -> list[Skeleton]:
        seen: dict[tuple, Skeleton] = {}
        keys = [(dp, b) for dp in self.dp_options() for b in self.mb_options(dp)]
        self.progress.phase("placement", len(keys))
        max_pp = max(self.pp_options()) if self.pp_options() else 0
        for dp, b in keys:
            kinds = pool_kinds(self.tables, dp, self.tp_options())
            self.progress.step()
            if not kinds:
                continue
            found = place(self.tables, dp=dp, micro_batch=b, num_micro_batches=self.gb // (dp * b),
                          sequence_parallel=True in self.c.sequence_parallel, kinds=kinds,
                          zeros=list(self.c.zero), modes=list(self.modes),
                          max_stages=min(self.c.max_stages, max_pp), use_all_gpus=self.c.use_all_gpus,
                          alternatives=self.c.placement_alternatives,
                          det_time_limit=self.c.placement_time_limit, seed=self.c.seed, stats=pstats)
            for sk in found:
                if self.c.pp is not None and sk.pp not in self.c.pp:
                    continue
                key = (sk.groups, sk.kinds)
                seen.setdefault(key, sk)
        return list(seen.values())

    # ------------------------------------------------------------- bounds
    def _whole(self, kind: Kind, b: int, sp: bool, q: int) -> tuple[float, float, float]:
        """(work per micro-batch of the whole model, all parameters, activation bytes) on one kind."""
        key = (kind, b, sp and kind.tp > 1, q)
        hit = self._work.get(key)
        if hit is None:
            t = self.tables.table(kind, b, sp)
            L = self.L
            work = t.cum_forward[L] + t.cum_backward_input[q, L] + t.cum_backward_weight[L]
            hit = self._work[key] = (float(work), float(t.cum_params[L]), float(t.cum_activation[self.q_lean, L]))
        return hit

    def time_bound(self, sk: Skeleton, st: Setting) -> float:
        """Lower bound on the closed-form time of any split of ``sk`` under ``st``: the
        fastest allowed recompute, work spread in proportion to each group's speed."""
        works = [self._whole(k, st.micro_batch, st.sequence_parallel, self.q_fast)[0] for k in sk.kinds]
        period = 1.0 / sum(1.0 / w for w in works)
        total = min(works)
        m, v = st.num_micro_batches, st.virtual_stages
        if sk.pp == 1:
            return m * total
        if st.schedule == "gpipe":
            return total + (m - 1) * period
        if st.schedule == "zero-bubble":
            return m * period
        return (m - 1.0 / v) * period + total / v

    def memory_bound_ok(self, sk: Skeleton, st: Setting) -> bool:
        """False when even a perfect spread of states and activations cannot fit (one
        device kind only; mixed pipelines are sized by the placement model)."""
        if len(set(sk.kinds)) != 1:
            return True
        kind = sk.kinds[0]
        _, params, act = self._whole(kind, st.micro_batch, st.sequence_parallel, self.q_lean)
        states = self.tables.state_bytes(params, 0.0, sk.dp, st.zero)
        P = sk.pp
        fl = inflight(st.schedule, P, st.num_micro_batches, st.virtual_stages)
        if st.virtual_stages == 1:
            counts = [fl.per_chunk[g][0] for g in range(P)]
            need = max(states / P, act / sum(1.0 / n for n in counts),
                       (states + min(counts) * act) / P)
        else:
            need = states / P
        cap = self.cluster.groups[kind.pool].device.memory_bytes
        return OVERHEAD + DYNAMIC_FACTOR * need <= cap

    # ---------------------------------------------------------------- run
    def run(self) -> SearchResult:
        t_start = time.perf_counter()
        c, stats = self.c, self.stats
        try:
            t0 = time.perf_counter()
            if len(self.cluster.groups) == 1:
                skeletons = self.homogeneous_skeletons()
            else:
                stats.placement = PlacementStats()
                skeletons = self.heterogeneous_skeletons(stats.placement)
            stats.skeletons = len(skeletons)
            stats.phase_s["placement"] = time.perf_counter() - t0

            t0 = time.perf_counter()
            configs: list[_Config] = []
            self.progress.phase("enumerate", len(skeletons))
            for si, sk in enumerate(skeletons):
                for st in self.settings(sk):
                    stats.candidates += 1
                    if not self.memory_bound_ok(sk, st):
                        stats.pruned_memory_bound += 1
                        continue
                    configs.append(_Config(self.time_bound(sk, st), len(configs), si, st))
                self.progress.step()
            configs.sort()
            stats.phase_s["enumerate"] = time.perf_counter() - t0

            t0 = time.perf_counter()
            short = self._branch_and_bound(configs, skeletons)
            stats.phase_s["split"] = time.perf_counter() - t0
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
                            global_batch=self.gb)

    def _branch_and_bound(self, configs: list[_Config], skeletons: list[Skeleton]) -> list[tuple]:
        keep = self.c.max_estimates
        heap: list[tuple] = []       # (-time, -order, candidate): the worst on top
        self.progress.phase("split", len(configs))
        for i, cfg in enumerate(configs):
            if len(heap) >= keep and cfg.bound >= -heap[0][0]:
                self.stats.pruned_time_bound += len(configs) - i
                break
            self.progress.step()
            sk = skeletons[cfg.skeleton]
            split = self.splitter.split(sk, cfg.setting, self.modes)
            if split is None:
                self.stats.pruned_no_split += 1
                continue
            analysis, _ = analyze(self.tables, sk, cfg.setting, split.bounds, split.recompute)
            if not analysis.fits:
                # Interleaved chunks share one memory; the DP's per-chunk budget is a
                # sufficient split, the exact joint peak decides.
                self.stats.pruned_no_split += 1
                continue
            cand = Candidate(sk, cfg.setting, split.bounds, split.recompute, analysis)
            item = (-analysis.time_s, -cfg.order, cand)
            if len(heap) < keep:
                heapq.heappush(heap, item)
            elif item > heap[0]:
                heapq.heapreplace(heap, item)
        return sorted(((-t, -o, cand) for t, o, cand in heap), key=lambda x: (x[0], x[1]))

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
            est = full_estimate(self.model, self.cluster, plan, profiles=self.c.profiles)
            self.stats.estimates += 1
            self.progress.step()
            if not est.fits:
                self.stats.estimate_fit_mismatch += 1
                continue
            done.append((est.iteration_time_s, i, RankedPlan(rank=0, plan=plan, estimate=est, predicted_s=t,
                                                             gpus_used=plan.num_gpus)))
        done.sort(key=lambda x: (x[0], x[1]))
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
        lines.append("To make one fit, try " + ", or ".join(fixes) + ".")
        return " ".join(lines)
