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

import contextlib
import gc
import heapq
import itertools
import time
from dataclasses import replace

import numpy as np

from autoplan.cluster import Cluster
from autoplan.errors import ConfigError, NoPlanFitsError
from autoplan.limits import MAX_GLOBAL_BATCH, MAX_MICRO_BATCHES, MAX_SCHEDULE_SLOTS
from autoplan.models.spec import ModelSpec
from autoplan.plan import DeviceGroup, Plan, Stage, even_split
from autoplan.units import GiB
from costmodel import estimate as full_estimate
from costmodel.host import device_budget
from search.bounds import Bounds
from search.evaluate import (Analysis, Candidate, Setting, Skeleton, analyze, busy_bound, fits_memory,
                             host_time, program_actions, simulated, split_host_time, stage_figures,
                             work_floor)
from search.inflight import inflight
from search.placement import PlacementStats, allocate, pool_kinds, sizings
from search.progress import Progress
from search.result import RankedPlan, SearchResult, SearchStats
from search.space import Constraints, divisors
from search.split import INF, HostAwareSplitter, Split, Splitter
from search.tables import RECOMPUTES, Kind, Tables


def search(model: ModelSpec, cluster: Cluster, global_batch: int, **constraints) -> SearchResult:
    """Best plans for training ``model`` on ``cluster`` with ``global_batch`` samples per
    iteration. Keyword constraints narrow the space (see :class:`search.space.Constraints`).

    Raises NoPlanFitsError when no plan in the space fits in memory; the message gives
    the leanest plan's memory per device type and what would make one fit."""
    if not isinstance(global_batch, int) or isinstance(global_batch, bool) or not 1 <= global_batch <= MAX_GLOBAL_BATCH:
        raise ConfigError("global_batch", f"must be an integer in 1..{MAX_GLOBAL_BATCH:,}, got {global_batch!r}")
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
    if c.tp is not None:
        # An impossible degree is a mistake to name, not a search that finds nothing.
        allowed = model.tp_degrees(max(c.tp))
        bad = [t for t in c.tp if t not in allowed]
        if bad:
            what = (f"the model's {model.heads} attention heads ({model.kv_heads} key/value heads)"
                    if model.tp_shardable else f"{model.name} (its layers are not tensor-parallel)")
            raise ConfigError("tp", f"{bad[0]} does not divide {what}", f"allowed degrees: {allowed}")
    with _fewer_collections():
        return _Search(model, cluster, global_batch, c).run()


def _refinable(st: Setting, pp: int) -> bool:
    """Whether splits of this shape are refined by local search (short simulated programs)."""
    return simulated(st, pp) and program_actions(st, pp) <= REFINE_ACTIONS


GC_ALLOCATIONS = 100_000
"""Allocations between the garbage collector's young-generation passes during a search
(CPython's default is 700)."""


@contextlib.contextmanager
def _fewer_collections():
    """Let the cyclic garbage collector run less often while searching. The search makes
    millions of short-lived, acyclic objects (tuples, small arrays, simulated timelines)
    beside long-lived caches; at the default threshold the collector's passes over those
    caches took 10-20% of a search's CPU time. Reference counting still frees everything
    at once, and the threshold is restored afterwards."""
    old = gc.get_threshold()
    gc.set_threshold(max(old[0], GC_ALLOCATIONS), *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)


def model_violation(model: ModelSpec, engine) -> ConfigError | None:
    """Why ``engine`` cannot train ``model`` at all (whatever the plan), or None."""
    from autoplan.engines import violation
    one = Plan(groups=(DeviceGroup(ranks=(0,), tp=1),), stages=(Stage(0, model.num_layers, 0),),
               micro_batch=1, num_micro_batches=1, dtype=model.dtype, model=model.name, seq_len=model.seq_len)
    err = violation(one, engine, model)
    return err if err is not None and err.field == "model" else None


PLACEMENT_MICRO_BATCHES = 1
"""Micro-batch sizes (the smallest ones) CP-SAT places device groups for, per dp. The
smallest needs the least memory, so its pipelines are the ones most likely to fit, and
the DP tries every size on them; placing for the second size too doubled the solves and
the pipelines to bound, and left the best plan of the benchmark's three-type clusters
(64 to 16,384 GPUs) the same."""
REFINE_ACTIONS = 256
"""Refine splits by local search only for programs this short (a few dozen simulations
of at most this many actions each): there the fill and drain, not the period the DP
balances, make much of the time."""
ESTIMATE_AT_LEAST = 5
"""Shortlisted plans always given the full cost model (a table's worth)."""
ESTIMATE_WINDOW = 1.05
"""Beyond those, only plans the fast model puts within this factor of the best full
estimate are given the full cost model."""
ANCHOR_ACTIONS = 4096
"""Give an incumbent the full model during the loop (to anchor the estimate window, see
_estimate_window) only when its program has at most this many actions."""
ANCHOR_GAIN = 0.93
"""... and only when the window could lower the shortlist's threshold below this share of
it (the search's results do not depend on it; where the shortlist is nearly as tight, a
full estimate costs more than the splits it saves)."""
HOST_NEGLIGIBLE = 0.25
"""Where the most a step's hosts could take is under this share of the bar a split must
beat, device-only floors are held against the bar itself (the host would lower it by under
1e-5 of it, ``costmodel.host``): the exact host time of every split is not worth computing."""
REFINE_WINDOW = 1.1
"""Refine a split only when its time is within this factor of the shortlist's worst (or the
shortlist is not full): refining rarely gains more than that."""
REFINE_MOVES = 200
"""Moves the refinement of one split may try."""


def _actions(sk: Skeleton, st: Setting) -> int:
    """Actions in the program of a candidate (what its full estimate simulates)."""
    return sk.pp * st.virtual_stages * st.num_micro_batches * (3 if st.schedule == "zero-bubble" else 2)


def _fifth_fastest(shortlist: list[tuple]) -> float:
    """The ESTIMATE_AT_LEAST-th fastest time in the shortlist (INF while it holds fewer);
    its entries are (-time, -order, candidate)."""
    if len(shortlist) < ESTIMATE_AT_LEAST:
        return INF
    return -heapq.nlargest(ESTIMATE_AT_LEAST, shortlist)[-1][0]


def _estimate_window(fifth_s: float, anchor_s: float, anchor_fast_s: float) -> float:
    """A fast-model time from which no candidate can reach the estimate phase's results,
    so the loop need not examine it (INF: none known yet). That phase gives the full
    model to the ESTIMATE_AT_LEAST fastest candidates, and past them stops at the first
    one the fast model puts beyond ESTIMATE_WINDOW times the least full estimate so far.

    ``fifth_s``: the shortlist's ESTIMATE_AT_LEAST-th fastest time (_fifth_fastest);
    ``anchor_s``: the full estimate of an incumbent that phase would keep (one whose
    split no refinement changes), ``anchor_fast_s`` its fast-model time. A candidate at
    or beyond all of ESTIMATE_WINDOW x anchor_s, anchor_fast_s and fifth_s is not among
    the fastest few, and comes after the
    anchor: if the phase reaches the anchor, the least full estimate is at most anchor_s
    and the phase stops before the candidate; if it stops earlier, it stops before it too.
    So the shortlist keeps every plan the phase would rank, as a full shortlist does,
    without waiting for max_estimates plans to fill it: the early plans are slow ones
    (the loop takes candidates by lower bound), and a shortlist of them bounds little."""
    if anchor_s == INF or fifth_s == INF:
        return INF
    # (Just above: the loop drops bounds at or above the threshold, and a candidate tied
    # with one of these times could still be ranked.)
    return float(np.nextafter(max(fifth_s, ESTIMATE_WINDOW * anchor_s, anchor_fast_s), INF))


class _Search:
    def __init__(self, model: ModelSpec, cluster: Cluster, global_batch: int, c: Constraints):
        self.model, self.cluster, self.gb, self.c = model, cluster, global_batch, c
        self.dtype = model.dtype
        self.options = c.estimate_options()
        self.tables = Tables(model, cluster, self.dtype, self.options)
        self.splitter = Splitter(self.tables)
        self.host_splitter = HostAwareSplitter(self.tables) if any(
            self.tables.host_costs(k).per_kernel_s for k in range(len(cluster.groups))) else None
        """Splits balanced for the hosts too, tried where a step waits on its hosts."""
        self.stats = SearchStats()
        self.progress = Progress(c.progress)
        self.L = model.num_layers
        self.modes = c.recompute
        self.bounds = Bounds(self.tables, self.modes, global_batch)
        self.refine_left = c.refine_evaluations
        self.engine = c.engine()
        self.restricted = self.engine.name != "autoplan"
        self.deadline: float | None = None
        """perf_counter() at which the caller's time limit runs out (None: no limit)."""
        self.unplaced_bound = INF
        """A lower bound for the pipelines placement did not get to (time limit)."""
        self.best_time = INF
        """Fast-model time of the best candidate so far."""
        self._full: dict = {}
        """id(candidate) -> (candidate, its full estimate or None where the estimate phase
        would skip it), for incumbents estimated during the loop (see _estimate_window)."""
        self._pipelining_counts: dict = {}
        self._ep_kinds: dict = {}
        self._memory_floors: dict = {}
        self._mode_rows = [RECOMPUTES.index(m) for m in self.modes]

    # ------------------------------------------------------------ options
    def tp_options(self) -> list[int]:
        gpn = max(g.gpus_per_node for g in self.cluster.groups)
        allowed = self.model.tp_degrees(gpn)
        return [t for t in allowed if self.c.tp is None or t in self.c.tp]

    def dp_options(self) -> list[int]:
        n = self.cluster.num_gpus
        return [d for d in divisors(self.gb) if d <= n and (self.c.dp is None or d in self.c.dp)]

    def ep_options(self, shards: int) -> list[int]:
        """Expert-parallel degrees over ``shards`` = dp x cp ranks: divisors of it that divide
        the model's experts (just 1 for a dense model)."""
        experts = self.model.num_experts
        return [e for e in divisors(shards) if (e == 1 or (experts and experts % e == 0))
                and (self.c.ep is None or e in self.c.ep)]

    def with_ep(self, sk: Skeleton) -> list[Skeleton]:
        """The skeleton under every expert-parallel degree its data parallelism allows."""
        out = []
        for e in self.ep_options(sk.shards):
            if all(k.ep == e for k in sk.kinds):
                out.append(sk)
                continue
            # (One Kind object per value: keys holding kinds then compare by identity.)
            kinds = tuple(self._kind_with_ep(k, e) for k in sk.kinds)
            out.append(Skeleton(groups=sk.groups, kinds=kinds))
        return out

    def _kind_with_ep(self, k: Kind, e: int) -> Kind:
        hit = self._ep_kinds.get((k, e))
        if hit is None:
            hit = self._ep_kinds[(k, e)] = replace(k, ep=e)
        return hit

    def cp_options(self, tp: int) -> list[tuple[int, str]]:
        """(cp, exchange) pairs for replicas of tensor-parallel degree ``tp``: cp = 1, and
        each degree the sequence splits into (2*cp zig-zag chunks for the ring exchanges on
        causal models) with parts of at least min_cp_tokens, for transformers; a2a also
        needs whole heads per rank, the rings fused attention (what their kernels run)."""
        out = [(1, "p2p")] if self.c.cp is None or 1 in self.c.cp else []
        m = self.model
        if not m.heads:
            return out
        causal = any(l.causal for l in m.layers)
        fused = any(l.attention_flops_fwd.total > 0 for l in m.layers)
        s, n = m.seq_len, self.cluster.num_gpus
        for cp in range(2, n // tp + 1):
            if self.c.cp is not None and cp not in self.c.cp:
                continue
            if self.c.cp is None and s // cp < self.c.min_cp_tokens:
                break
            for comm in self.c.cp_comm:
                ring = comm != "a2a"
                if s % (2 * cp if ring and causal else cp) or (ring and not fused):
                    continue
                if not ring and any(max(h // tp, 1) % cp for h in (m.heads, m.kv_heads or m.heads)):
                    continue
                out.append((cp, comm))
        return out

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

    def sequence_parallel(self, sk: Skeleton) -> tuple[bool, ...]:
        """Sequence-parallel settings worth trying (one without tensor parallelism)."""
        if any(k.tp > 1 for k in sk.kinds):
            return self.c.sequence_parallel
        return (min(self.c.sequence_parallel),)

    def zero_options(self, shards: int, pp: int = 1) -> tuple[int, ...]:
        """ZeRO stages worth trying over ``shards`` data x context ranks and ``pp`` pipeline
        stages (without any data ranks, ZeRO shards nothing: one stage stands for all).
        Under pipelining, the stages the stack runs the allowed ones at
        (``Stack.realized_zero``): a plan is labelled with what it runs."""
        if shards == 1:
            return (min(self.c.zero),)
        if pp > 1:
            return tuple(sorted({self.tables.stack.realized_zero(z, pp) for z in self.c.zero}))
        return self.c.zero

    def settings(self, sk: Skeleton, b: int, sp: bool):
        """(setting, ZeRO stages it stands for) of a skeleton at micro-batch ``b``."""
        P, dp, shards = sk.pp, sk.dp, sk.shards
        # Settings that change nothing are tried once: ZeRO without data (or context)
        # parallelism, sequence parallelism without tensor parallelism (see sequence_parallel()).
        zeros = self.zero_options(shards, P)
        # ZeRO 0-2 share a time bound (they differ in memory and in the gradient
        # reduction only); ZeRO-3 adds gathers to every micro-batch.
        low = tuple(z for z in zeros if z < 3 or shards == 1)
        z3 = shards > 1 and 3 in zeros
        for m, sched, v in self._pipelinings(P, dp, b):
            # (Settings built directly: dataclasses.replace costs several times more, and
            # this runs for every candidate of the space.)
            if self.restricted:
                ok_low = tuple(z for z in low if self._runs_on_target(sk, Setting(b, m, sched, v, z, sp)))
            else:
                ok_low = low
            if ok_low:
                yield Setting(b, m, sched, v, ok_low[-1], sp), ok_low
            if z3 and self._runs_on_target(sk, Setting(b, m, sched, v, 3, sp)):
                yield Setting(b, m, sched, v, 3, sp), (3,)

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

    def _pipelinings(self, P: int, dp: int, b: int):
        """(micro-batches, schedule, virtual stages) a pipeline of depth P with dp
        replicas may run at micro-batch b. A new per-setting degree (a choice that does not
        change the device groups) joins here, and in settings() / Setting."""
        m = self.gb // (dp * b)
        if m > MAX_MICRO_BATCHES:
            return   # a plan past the limits cannot be estimated or run
        for sched in self.schedules(P):
            if sched != "interleaved-1f1b":
                if P * m <= MAX_SCHEDULE_SLOTS:
                    yield m, sched, 1
            elif P > 1 and m % P == 0:
                vs = self.c.virtual_stages or range(2, self.c.max_virtual_stages + 1)
                for v in vs:
                    if v >= 2 and P * v <= self.L and P * v * m <= MAX_SCHEDULE_SLOTS:
                        yield m, sched, v

    # --------------------------------------------------------- skeletons
    def homogeneous_skeletons(self) -> list[Skeleton]:
        ng = self.cluster.groups[0]
        n = self.cluster.num_gpus
        out = []
        # Skeletons of one (tp, cp, dp) share their groups' objects (pipeline rank p holds the
        # same ranks whatever the depth): fewer objects, and caches keyed by group hit.
        made: dict[tuple[int, int, int, int], DeviceGroup] = {}
        for tp in self.tp_options():
            if ng.gpus_per_node % tp:
                continue
            for cp, comm in self.cp_options(tp):
                kind = Kind(0, tp, cp, comm)
                for dp in self.dp_options():
                    for pp in self.pp_options():
                        used = tp * cp * dp * pp
                        if used > n or (self.c.use_all_gpus and used != n):
                            continue
                        per = tp * cp * dp
                        groups = []
                        for p in range(pp):
                            g = made.get((tp, cp, dp, p))
                            if g is None:
                                g = made[(tp, cp, dp, p)] = DeviceGroup(
                                    ranks=tuple(range(p * per, (p + 1) * per)), tp=tp, cp=cp)
                            groups.append(g)
                        out += self.with_ep(Skeleton(groups=tuple(groups), kinds=(kind,) * pp))
        return out

    def heterogeneous_skeletons(self, pstats: PlacementStats) -> list[Skeleton]:
        """Pipelines of device groups on several node groups: all of them when the space
        holds few enough (``max_exhaustive_pipelines``), else CP-SAT's proposals."""
        options = {dp: self._runs(dp) for dp in self.dp_options()}
        if sum(_count_sequences(runs, self.max_pp()) for runs in options.values()) <= self.c.max_exhaustive_pipelines:
            out = []
            for dp, runs in options.items():
                for seq in _sequences(runs, self.max_pp()):
                    if self.c.pp is not None and len(seq) not in self.c.pp:
                        continue
                    if self.restricted and self.engine.uniform_tp and len({k.tp for k in seq}) > 1:
                        continue   # the engine runs one tensor-parallel degree per job
                    sk = allocate(self.tables, dp, seq)
                    if sk is not None:
                        out.append(sk)
            pstats.enumerated = len(out)
            pstats.skeletons = len(out)
            return out
        return self._placed_skeletons(pstats)

    def max_pp(self) -> int:
        """Longest pipeline on several node groups."""
        return min(self.c.max_stages, max(self.pp_options(), default=0))

    def _runs(self, dp: int) -> list[list[tuple[Kind, int]]]:
        """Per node group: the runs it may serve (device kind, how many groups in a row)."""
        out = []
        for k in range(len(self.cluster.groups)):
            kinds = pool_kinds(self.tables, dp, self.tp_options(), pools=[k])
            out.append([(kind, n) for kind in kinds
                        for n in range(1, min(self.cluster.groups[k].num_gpus // (dp * kind.tp), self.max_pp()) + 1)])
        return out

    def cluster_bound(self) -> float:
        """No plan beats every GPU of the cluster working at its best micro-batch and
        tensor-parallel degree on its share of the global batch."""
        rate = 0.0
        for k, ng in enumerate(self.cluster.groups):
            best = 0.0
            for t in self.tp_options():
                if ng.gpus_per_node % t:
                    continue
                for b in sorted({b for dp in self.dp_options() for b in self.mb_options(dp)}):
                    for sp in self.c.sequence_parallel:
                        best = max(best, b / self.bounds.summary(Kind(k, t), b, sp).work * (ng.num_gpus // t))
            rate += best
        return self.gb / rate if rate > 0 else INF

    def _placed_skeletons(self, pstats: PlacementStats) -> list[Skeleton]:
        # The sequence of device groups depends on the micro-batch only through memory:
        # placing for the smallest sizes (PLACEMENT_MICRO_BATCHES) covers the ones that
        # fit best; the DP then tries every micro-batch size on every sequence.
        keys = [(dp, b) for dp in self.dp_options() for b in self.mb_options(dp)[:PLACEMENT_MICRO_BATCHES]]
        # An engine with one tensor-parallel size per job gets pipelines of one degree each.
        tp_sets = [[t] for t in self.tp_options()] if self.engine.uniform_tp and self.restricted \
            else [self.tp_options()]
        models = []   # every model to solve, in the order of keys (the skeletons' order)
        for dp, b in keys:
            if not self.pools_can_hold(dp, self.mb_options(dp)[0]):
                # Not even at the smallest micro-batch (the pipelines placed here are tried
                # at every size): every one of them would be pruned by runs_cover().
                pstats.skipped += 1
                continue
            for tps in tp_sets:
                kinds = pool_kinds(self.tables, dp, tps)
                if kinds:
                    models += sizings(self.tables, dp=dp, micro_batch=b, num_micro_batches=self.gb // (dp * b),
                                      sequence_parallel=True in self.c.sequence_parallel, kinds=kinds,
                                      zeros=list(self.c.zero), modes=list(self.modes),
                                      max_stages=self.max_pp(), use_all_gpus=self.c.use_all_gpus,
                                      alternatives=self.c.placement_alternatives,
                                      det_time_limit=self.c.placement_time_limit, seed=self.c.seed, stats=pstats,
                                      orders=self.c.placement_orders)
        # The most promising models first (least floor of the objective; ties in key
        # order): a model whose floor is beyond placement_alternatives_within of the best
        # optimum of its ZeRO sizing so far is never solved (its optimum would be beyond
        # it too, like those of the degrees that get no alternatives below). On the
        # benchmark's three-type clusters that is a third to a half of the models.
        within = 1 + self.c.placement_alternatives_within
        self.progress.phase("placement", len(models))
        best: dict[int, float] = {}
        for props in sorted(models, key=lambda p: p.floor_s):
            self.progress.step()
            if props.floor_s > best.get(props.zero, INF) * within:
                pstats.floored += 1
                continue
            if best and self.out_of_time():
                # Pipelines never placed are bounded by the whole cluster's best rate.
                self.stats.stopped_at_time_limit = True
                self.unplaced_bound = self.cluster_bound()
                break
            if props.first():
                best[props.zero] = min(best.get(props.zero, INF), props.estimate_s)
        proposed = [props for props in models if props.found]
        # CP-SAT's next-best sequences only where its optimum is within
        # placement_alternatives_within of the best data-parallel degree's (by its own
        # closed form, which ranks the degrees' best plans closely on the benchmark's
        # clusters): elsewhere alternatives cost solves and DPs for plans that lose.
        # Degrees are compared within one ZeRO sizing: the ZeRO-3 objective carries the
        # parameter gathers, yet its shallower pipelines often win under ZeRO-1 or 2.
        out: dict[tuple, Skeleton] = {}
        for props in proposed:
            if (props.estimate_s <= best[props.zero] * (1 + self.c.placement_alternatives_within)
                    and not self.out_of_time()):
                props.more()
            for sk in props.found:
                if self.c.pp is not None and sk.pp not in self.c.pp:
                    continue
                for variant in self.with_ep(sk):
                    out.setdefault((variant.groups, variant.kinds), variant)
        return list(out.values())

    def pools_can_hold(self, dp: int, b: int) -> bool:
        """Whether pipelines of ``dp`` replicas at micro-batch ``b`` could hold the model at
        all: each node group serves one run of device groups of one tp, and no group holds
        more units than the additive part of its memory allows (``_least_units_bytes``
        with no activations, the fewest communicators, the leanest ZeRO stage and
        sequence-parallel setting allowed). A necessary condition for runs_cover()."""
        key = ("pools", dp, b, self.tables.margin)
        hit = self._memory_floors.get(key)
        if hit is not None:
            return hit
        units = 0
        for k, ng in enumerate(self.cluster.groups):
            most = 0
            for kind in pool_kinds(self.tables, dp, self.tp_options(), pools=[k]):
                one = allocate(self.tables, dp, [kind])
                if one is None:
                    continue
                room = self.tables.capacity(k) - self.tables.fixed_bytes(k, one.groups[0], 1, 1)
                per = 0
                for ep in self.ep_options(dp):
                    sk = Skeleton(groups=one.groups, kinds=(replace(kind, ep=ep),))
                    for zero in self.zero_options(dp):
                        for sp in self.sequence_parallel(sk):
                            least = self._least_units_bytes(sk, 0, Setting(b, 1, "1f1b", 1, zero, sp), 0)
                            per = max(per, int(np.searchsorted(least, room, side="right")))
                most = max(most, min(ng.num_gpus // (dp * kind.tp), self.max_pp()) * per)
            units += most
        hit = self._memory_floors[key] = units >= self.L
        return hit

    # ------------------------------------------------------------- bounds
    def memory_bound_ok(self, sk: Skeleton, st: Setting) -> bool:
        """False when even a perfect spread of states and activations cannot fit (one
        device kind only; mixed pipelines are judged by runs_cover() before this)."""
        if len(set(sk.kinds)) != 1:
            return True
        kind = sk.kinds[0]
        summ = self.bounds.summary(kind, st.micro_batch, st.sequence_parallel)
        params, act = summ.params, summ.act_lean
        states = self.tables.state_bytes(params, 0.0, sk.shards, st.zero)
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

    def runs_cover(self, sk: Skeleton, st: Setting) -> bool:
        """Whether the groups of ``sk`` could hold the whole model under ``st`` (a
        necessary condition for any split to fit, from the DP's own per-stage memory).

        One chunk per group: stage g must fit group g's memory at its in-flight count in
        the leanest recompute mode allowed, and a run fits wherever a longer run holding
        it fits; so taking the longest run that fits from where the previous stage ended,
        group after group, reaches at least as far as any split that fits. Interleaved
        groups hold several runs: there only the bytes that add up unit by unit (states,
        weight casts, the optimizer step's temporaries) are counted, for the units that
        need the least."""
        P, v = sk.pp, st.virtual_stages
        if v == 1:
            counts = inflight(st.schedule, P, st.num_micro_batches, 1).per_chunk
            reach = 0
            for g in range(P):
                pool = sk.kinds[g].pool
                room = self.tables.capacity(pool) - self.tables.fixed_bytes(pool, sk.groups[g], P, sk.ep)
                need = self._stage_need(sk, g, st, counts[g][0], reach)
                # need grows with the run's end: count the ends that fit.
                reach += int(np.searchsorted(need, room, side="right"))
                if reach >= self.L:
                    return True
            return False
        fl = inflight(st.schedule, P, st.num_micro_batches, v)
        units = 0
        for g in range(P):
            pool = sk.kinds[g].pool
            room = self.tables.capacity(pool) - self.tables.fixed_bytes(pool, sk.groups[g], P, sk.ep)
            # At its peak the group holds at least this many micro-batches of every chunk.
            held = max(min(vec) for vec in fl.peaks[g])
            units += int(np.searchsorted(self._least_units_bytes(sk, g, st, held), room, side="right"))
            if units >= self.L:
                return True
        return False

    def _covering_zeros(self, sk: Skeleton, st: Setting, zeros: tuple[int, ...]) -> tuple[int | None, ...]:
        """``zeros`` with each ZeRO stage under which the groups of ``sk`` cannot hold the
        model (:meth:`runs_cover`) replaced by None. From stage 0 to 2 every byte runs_cover
        counts only shrinks (each stage shards one more part of the states over the same
        ranks; nothing else it counts depends on the stage), so the stages below 3 that
        cover are those from the least that does, found by bisection; ZeRO-3 adds the
        gathered working set and is checked on its own."""
        low = sorted(z for z in zeros if z < 3)
        lo, hi = 0, len(low)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.runs_cover(sk, _with_zero(st, low[mid])):
                hi = mid
            else:
                lo = mid + 1
        ok = set(low[lo:])
        ok.update(z for z in zeros if z >= 3 and self.runs_cover(sk, _with_zero(st, z)))
        return tuple(z if z in ok else None for z in zeros)

    def _stage_need(self, sk: Skeleton, g: int, st: Setting, count: int, start: int) -> np.ndarray:
        """need[d]: bytes per GPU of stage [start, start + d + 1) on group g of ``sk`` holding
        ``count`` micro-batches in flight, in the leanest recompute mode allowed (the DP's
        memory). Only the one row is computed: a fresh row costs less than looking a whole
        matrix up, and the rows asked for seldom repeat."""
        base, act = self.splitter._mem_mats(sk, g, st)
        floor = self.splitter._step_mats(sk, g, st)
        qs = self._mode_rows
        row = np.maximum(base[qs, start, start + 1:] + count * act[qs, start, start + 1:],
                         floor[qs, start, start + 1:]).min(axis=0)
        # (Monotone in the end by construction; the running maximum only guards the
        # search against rounding.)
        return np.maximum.accumulate(row)

    def _least_units_bytes(self, sk: Skeleton, g: int, st: Setting, held: int) -> np.ndarray:
        """least[d]: a lower bound on the bytes per GPU of any d + 1 units (consecutive or
        not) on group g of ``sk`` holding at least ``held`` micro-batches of each: the parts
        of its memory that add up unit by unit (states, weight casts, activations; or
        states and the optimizer step's temporaries), smallest units first, plus the least
        transient any unit has."""
        group, kind = sk.groups[g], sk.kinds[g]
        shards = group.dp * group.cp
        key = ("units", kind, st.micro_batch, st.sequence_parallel and kind.tp > 1, shards, st.zero, held)
        hit = self._memory_floors.get(key)
        if hit is None:
            t, tb = self.tables.table(kind, st.micro_batch, st.sequence_parallel), self.tables
            qs = [RECOMPUTES.index(m) for m in self.modes]
            dyn = tb.dynamic_factor
            params, sharded, cast = (np.diff(x) for x in (t.cum_params, t.cum_zero_params, t.cum_cast_params))
            act = np.diff(t.cum_activation[qs], axis=1).min(axis=0)
            states = tb.state_bytes(params, 0.0, shards, st.zero, sharded)
            compute = np.cumsum(np.sort(states + dyn * (tb.cast_bytes(cast, shards, st.zero) + held * act))) \
                + dyn * float(t.transient[qs].min())
            step = np.cumsum(np.sort(states + dyn * tb.step_bytes(params, shards, st.zero, sharded)))
            hit = self._memory_floors[key] = np.maximum(compute, step)
        return hit

    # ---------------------------------------------------------------- run
    def run(self) -> SearchResult:
        t_start = time.perf_counter()
        if self.c.time_limit is not None:
            self.deadline = t_start + self.c.time_limit
        stats = self.stats
        if len(self.cluster.groups) > 1 and self.c.cp is not None and max(self.c.cp) > 1:
            raise ConfigError("cp", "context parallelism is searched on clusters of one device type only",
                              "drop the cp constraint, or search each node group on its own")
        try:
            if self._states_exceed_cluster():
                # However the states are sharded, they outgrow all the devices' memory.
                raise NoPlanFitsError(self._no_fit_message([]))
            mixed = len(self.cluster.groups) > 1
            t0 = time.perf_counter()
            if not mixed:
                skeletons = self.homogeneous_skeletons()
            else:
                stats.placement = PlacementStats()
                skeletons = self.heterogeneous_skeletons(stats.placement)
            stats.skeletons = len(skeletons)
            stats.phase_s["placement"] = time.perf_counter() - t0

            t0 = time.perf_counter()
            short = self._best_first(skeletons)
            if not short and self.tables.margin > 0 and not stats.stopped_at_time_limit:
                # Nothing fits with the safety margin free: look again for plans that fit
                # at all (they come out marked tight). The bounds' memory budgets change.
                self.tables.margin = 0.0
                stats.tight_fallback = True
                stats.pruned_memory_bound = stats.pruned_no_split = stats.pruned_split_bound = 0
                if not mixed:
                    self.bounds = Bounds(self.tables, self.modes, self.gb)
                    short = self._best_first(skeletons)
                else:
                    # The pipelines placed are kept (CP-SAT sizes runs by a coarse memory
                    # model, which the margin barely moves; the DP judges memory exactly
                    # under the new budgets), and the leanest pipelines, the likeliest to
                    # fit at all, are searched first: their plans bound the others'.
                    extra = self._new_lean(skeletons)
                    short = self._best_first_more(extra)
                    short = self._best_first_more(skeletons, seed=short)
                    skeletons = skeletons + extra
                    stats.skeletons = len(skeletons)
            if not short and not stats.stopped_at_time_limit and mixed:
                # CP-SAT sizes runs by a coarse memory model and may propose only pipelines
                # that miss by a little; before saying nothing fits, try the leanest ones
                # (every node group at its largest tp, roomiest first), as the no-fit
                # message would.
                extra = self._new_lean(skeletons)
                if extra:
                    short = self._best_first_more(extra)
                    skeletons = skeletons + extra
                    stats.skeletons = len(skeletons)
            stats.phase_s["split"] = time.perf_counter() - t0 - stats.phase_s.get("bounds", 0.0)
            stats.splits = self.splitter.runs + (self.host_splitter.runs if self.host_splitter else 0)
            stats.shortlisted = len(short)
            if not short and stats.stopped_at_time_limit:
                raise ConfigError("time_limit", f"{self.c.time_limit:g} s ran out before any plan that fits was found",
                                  "allow more seconds, or none")
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
                            global_batch=self.gb, notes=self.zero_notes())

    def zero_notes(self) -> tuple[str, ...]:
        """A line for the ZeRO stages asked for that the stack runs as a lower one under
        pipelining, where the space holds pipelines."""
        stack, pp = self.tables.stack, self.max_pp()
        if pp < 2:
            return ()
        higher = [z for z in self.c.zero if stack.realized_zero(z, pp) != z]
        if not higher:
            return ()
        runs = stack.realized_zero(max(higher), pp)
        stages = "/".join(str(z) for z in higher)
        return (f"stack {stack.name} runs ZeRO-{stages} with pipeline stages as ZeRO-{runs}: pipelined plans are "
                f"estimated and labelled zero={runs}",)

    def _new_lean(self, skeletons: list[Skeleton]) -> list[Skeleton]:
        """The leanest pipelines of a mixed cluster (``_lean_skeletons``) not among ``skeletons``."""
        known = {(sk.groups, sk.kinds) for sk in skeletons}
        return [sk for sk in self._lean_skeletons([]) if (sk.groups, sk.kinds) not in known]

    def _best_first_more(self, skeletons: list[Skeleton], seed: list[tuple] = ()) -> list[tuple]:
        """Another ``_best_first`` in the same search: its statistics add to the earlier ones'."""
        if not skeletons:
            return list(seed)
        stats = self.stats
        counts = ("candidates", "pruned_time_bound", "pruned_memory_bound", "pruned_no_split", "pruned_split_bound")
        before = {k: getattr(stats, k) for k in counts}
        stats.pruned_memory_bound = stats.pruned_no_split = stats.pruned_split_bound = 0
        self.bounds = Bounds(self.tables, self.modes, self.gb)   # (its caches are per list index)
        short = self._best_first(skeletons, seed)
        for k in counts:
            setattr(stats, k, getattr(stats, k) + before[k])
        return short

    def _count(self, sk: Skeleton) -> int:
        """Candidates of a skeleton (what settings() yields, times its ZeRO stages)."""
        n_zero = len(self.c.zero) if sk.shards > 1 else 1
        n_sp = len(self.sequence_parallel(sk))
        key = (sk.pp, sk.dp)
        n = self._pipelining_counts.get(key)
        if n is None:
            # Every skeleton of one depth and data-parallel degree has the same settings.
            n = self._pipelining_counts[key] = sum(1 for b in self.mb_options(sk.dp)
                                                   for _ in self._pipelinings(sk.pp, sk.dp, b))
        return n * n_sp * n_zero

    def _best_first(self, skeletons: list[Skeleton], seed: list[tuple] = ()) -> list[tuple]:
        """Branch and bound over (skeleton, setting) in increasing order of lower bounds.

        One heap holds items of three levels, each bounded below by a bound valid for
        everything it stands for: a skeleton (the whole model's work spread over its
        groups, at its best micro-batch), a skeleton at one micro-batch size and
        sequence-parallel setting, and a candidate (a complete setting, bounded by
        :meth:`Bounds.time_bound`). The smallest item is expanded (or, for a candidate,
        split by the DP and timed) until it cannot beat the shortlist, so what is never
        expanded is never enumerated. Ties are broken by insertion order, so the result
        does not depend on timing; only ``time_limit`` can stop the loop early, and then
        the heap's smallest bound says how far from optimal the incumbent may be.

        ``seed``: a shortlist an earlier call returned (on other skeletons), kept and
        beaten as if found here; its plans order before this call's on equal times."""
        keep = self.c.max_estimates
        stats = self.stats
        t_bounds = time.perf_counter()
        heap: list[tuple] = []   # (bound, counter, level, payload)
        counter = max((o // 4 + 1 for _, o, _ in seed), default=0)
        for si, sk in enumerate(skeletons):
            heap.append((self.bounds.skeleton_bound(si, sk, self.mb_options(sk.dp), self.sequence_parallel(sk)),
                         counter, 0, si))
            counter += 1
        heapq.heapify(heap)
        stats.candidates = sum(self._count(sk) for sk in skeletons)
        bounds_s = time.perf_counter() - t_bounds
        shortlist: list[tuple] = [(-t, -o, cand) for t, o, cand in seed]   # (-time, -order, candidate): the worst on top
        heapq.heapify(shortlist)
        examined = 0
        time_pruned = 0   # (ZeRO stages of a candidate pruned by their own time bound)
        unrefined: list[tuple] = []   # (items of short programs, refined once the loop is done)
        self.progress.phase("split", stats.candidates)

        window = [INF]   # (see _estimate_window; recomputed whenever the shortlist changes)
        anchor_s = anchor_fast_s = INF   # (least full estimate of an incumbent, its fast time)
        anchor_due = None     # (the latest incumbent that may anchor the window, not yet estimated)

        def threshold() -> float:
            worst = -shortlist[0][0] if len(shortlist) >= keep else INF
            return min(worst, window[0])

        while heap:
            bound, cnt, level, payload = heap[0]
            if bound >= threshold() or bound == INF:
                break
            if shortlist and self.out_of_time():
                # (Never before a first plan: the limit returns the best so far, not nothing.)
                stats.stopped_at_time_limit = True
                break
            heapq.heappop(heap)
            if level < 2:
                t = time.perf_counter()
                if level == 0:
                    # A skeleton: one item per micro-batch size and sequence-parallel setting.
                    sk = skeletons[payload]
                    for b in self.mb_options(sk.dp):
                        for sp in self.sequence_parallel(sk):
                            heapq.heappush(heap, (self.bounds.micro_batch_bound(payload, sk, b, sp), counter, 1,
                                                  (payload, b, sp, False)))
                            counter += 1
                else:
                    si, b, sp, refined = payload
                    sk = skeletons[si]
                    if not refined:
                        # Before bounding each setting: the item's bound with the pipeline's
                        # fill and sends, which rules most micro-batch sizes out at once.
                        pipelinings = list(self._pipelinings(sk.pp, sk.dp, b))
                        tight = self.bounds.item_bound(si, sk, b, sp, pipelinings,
                                                       max(self.zero_options(sk.shards, sk.pp)))
                        if bound < tight < INF:
                            heapq.heappush(heap, (tight, cnt, 1, (si, b, sp, True)))
                            bounds_s += time.perf_counter() - t
                            continue
                    for st, zeros in self.settings(sk, b, sp):
                        bound = self.bounds.time_bound(si, sk, st)
                        if bound == INF:
                            stats.pruned_memory_bound += len(zeros)
                            self.progress.step(len(zeros))
                            continue
                        heapq.heappush(heap, (bound, counter, 2, (si, st, zeros, False)))
                        counter += 1
                bounds_s += time.perf_counter() - t
                continue
            si, st0, zeros, tightened = payload
            sk = skeletons[si]
            if not tightened and len(set(sk.kinds)) > 1:
                # Before any DP on a mixed pipeline: drop the ZeRO stages under which its
                # groups cannot hold the model.
                # (Dropped stages leave a None, so the others keep their tie-breaking order.)
                covered = self._covering_zeros(sk, st0, zeros)
                dropped = sum(z is None for z in covered)
                if dropped:
                    stats.pruned_memory_bound += dropped
                    self.progress.step(dropped)
                    if dropped == len(zeros):
                        continue
                    zeros = covered
                    st0 = _with_zero(st0, [z for z in zeros if z is not None][-1])
            if not tightened:
                # Before any memory-aware work: every rank runs its m micro-batches one
                # after another, and some rank holds a stage at least as slow as the least
                # period any split can have (the memory-free split's, shared widely).
                t = time.perf_counter()
                free = self.splitter.free_period(sk, st0, self.modes)
                tight = max(bound, st0.num_micro_batches * free)
                if sk.pp > 1 and tight < threshold():
                    # And the busiest rank's memory-aware period, where it raises the floor:
                    # where memory forces recomputation the bound above is far too low, and
                    # the candidate would be split long before plans that beat it (the
                    # shortlist fills with them, and its threshold falls slowly). Under the
                    # item's most sharded ZeRO stage it holds for its every stage (states take
                    # the least). A mixed pipeline's is its own (not shared with other
                    # data-parallel degrees) and not sought where the memory-free split fits:
                    # then no split that fits has a smaller period.
                    if len(set(sk.kinds)) == 1 or not self.splitter.free_split_fits(sk, st0, self.modes):
                        floor = self.bounds.memory_period(sk, st0)
                        if floor > free:
                            tight = max(tight, self.bounds.time_bound(si, sk, st0, period_floor=floor))
                bounds_s += time.perf_counter() - t
                if tight > bound:
                    heapq.heappush(heap, (tight, cnt, 2, (si, st0, zeros, True)))
                    continue
            last = [z for z in zeros if z is not None][-1]
            for zi, z in enumerate(zeros):
                if z is None:
                    continue
                self.progress.step()
                st = st0 if z == st0.zero else Setting(st0.micro_batch, st0.num_micro_batches, st0.schedule,
                                                       st0.virtual_stages, z, st0.sequence_parallel)
                dp_beaten = False
                if len(shortlist) >= keep:
                    # Just before the split, the bound of this very ZeRO stage with the
                    # busiest rank's memory-aware period (Bounds.memory_period): a candidate
                    # it rules out is dropped, never reordered (the DP's period limit
                    # follows the shortlist, so the examination order is kept as it was).
                    t = time.perf_counter()
                    floor = self.splitter.free_period(sk, st, self.modes)
                    beaten = self.bounds.time_bound(si, sk, st, period_floor=floor) >= threshold()
                    if not beaten and len(set(sk.kinds)) == 1:
                        # (The bound only grows with the floor: the memory-aware period is
                        # worked out only where the memory-free one does not settle it. A
                        # mixed pipeline's, costlier and rarely decisive here, only ordered
                        # the candidate when it first came up.)
                        memory = self.bounds.memory_period(sk, st)
                        if memory > floor:
                            floor = memory
                            beaten = self.bounds.time_bound(si, sk, st, period_floor=floor) >= threshold()
                    if not beaten and self._dp_splits_bounded(sk, st):
                        # The DPs keep interleaved chunks within shares of their group's
                        # memory: a floor for their splits alone, tighter than the one above.
                        share = min(self.bounds.share_period(sk, st, *self.splitter.chunk_budgets(
                            sk, st, self.modes, joint)) for joint in (True, False))
                        dp_beaten = self.bounds.time_bound(si, sk, st, period_floor=max(floor, share)) >= threshold()
                        stats.skipped_chunk_dps += dp_beaten
                    bounds_s += time.perf_counter() - t
                    if beaten:
                        time_pruned += 1
                        continue
                examined += 1
                if z != last and not self.memory_bound_ok(sk, st):
                    stats.pruned_memory_bound += 1
                    continue
                # No stage may be slower than what could still beat the shortlist (its
                # device time, with the least the hosts can add).
                limit = INF
                if len(shortlist) >= keep:
                    m = st.num_micro_batches
                    denom = m if st.schedule == "zero-bubble" else m - 1
                    budget = device_budget(threshold(), self.bounds.host_floor(sk, m))
                    limit = budget / denom if denom > 0 else INF
                best = self._split(sk, st, limit, threshold(), dp_beaten)
                if best is None:
                    stats.pruned_no_split += 1
                    continue
                split, analysis = best
                cand = Candidate(sk, st, split.bounds, split.recompute, analysis)
                item = (-analysis.time_s, -(cnt * 4 + zi), cand)
                if not self.restricted and _refinable(st, sk.pp):
                    unrefined.append(item)
                if len(shortlist) < keep:
                    heapq.heappush(shortlist, item)
                elif item > shortlist[0]:
                    heapq.heapreplace(shortlist, item)
                else:
                    continue
                if analysis.time_s < self.best_time:
                    self.best_time = analysis.time_s
                    self.progress.incumbent(analysis.time_s)
                    # (A full estimate of a long program costs as much as dozens of splits,
                    # and an incumbent is often soon beaten: only short ones anchor.)
                    if (self.restricted or not _refinable(st, sk.pp)) and _actions(sk, st) <= ANCHOR_ACTIONS:
                        anchor_due = cand
                fifth = _fifth_fastest(shortlist)
                if anchor_due is not None and max(fifth, ESTIMATE_WINDOW * anchor_due.analysis.time_s) \
                        < ANCHOR_GAIN * threshold():
                    # (Estimated once the window may cut the threshold: not while the
                    # shortlist is short, nor where it is already tighter.)
                    est = self._full_estimate(anchor_due)
                    if est is not None and est.iteration_time_s < anchor_s:
                        anchor_s, anchor_fast_s = est.iteration_time_s, anchor_due.analysis.time_s
                    anchor_due = None
                window[0] = _estimate_window(fifth, anchor_s, anchor_fast_s)
        self._refine_late(unrefined, shortlist, keep, threshold)
        # What was left unexplored is bounded below by the heap's smallest item.
        best_time = -max(shortlist)[0] if shortlist else INF
        left = heap[0][0] if heap else INF
        stats.lower_bound_s = min(best_time, left, self.unplaced_bound)
        stats.optimality_gap = (best_time / stats.lower_bound_s - 1.0) if shortlist and stats.lower_bound_s > 0 \
            else (0.0 if shortlist else INF)
        if stats.stopped_at_time_limit:
            stats.unexplored = stats.candidates - examined - stats.pruned_memory_bound - time_pruned
        else:
            stats.pruned_time_bound = stats.candidates - examined - stats.pruned_memory_bound
        stats.phase_s["bounds"] = bounds_s
        return sorted(((-t, -o, cand) for t, o, cand in shortlist), key=lambda x: (x[0], x[1]))

    def _refine_late(self, unrefined: list[tuple], shortlist: list[tuple], keep: int, threshold) -> None:
        """Refine the splits of short programs once every candidate has been split, fastest
        first, those within REFINE_WINDOW of the loop's ``threshold`` as it then stands
        (the shortlist's worst, or the estimate window): the
        candidates split first are the ones with the least bounds, rarely the fastest, and
        refining them against the shortlist of that moment (loose, or not yet full) cost
        more than the rest of the search. Judged against the final shortlist instead, a
        split is refined only if refining could place it there by gaining less than the
        window; the loop's own pruning only gets looser for it (unrefined times are never
        below refined ones), so nothing it examined is lost. An improved candidate replaces
        its shortlist entry or, if it had been pushed out, competes for a place again."""
        for item in sorted(unrefined, key=lambda x: (-x[0], -x[1])):
            if self.refine_left <= 0:
                break
            worst = threshold()
            time_s, order, cand = -item[0], item[1], item[2]
            if not time_s < REFINE_WINDOW * worst:
                continue
            split = Split(bounds=cand.bounds, recompute=cand.recompute, period=0.0, total=0.0)
            better, analysis = self._refine(cand.skeleton, cand.setting, split, cand.analysis, modes=self.modes)
            if not analysis.time_s < time_s:
                continue
            kept = [x for x in shortlist if x[2] is not cand]
            if len(kept) < len(shortlist):
                shortlist[:] = kept
                heapq.heapify(shortlist)
            new = (-analysis.time_s, order, Candidate(cand.skeleton, cand.setting, better.bounds,
                                                      better.recompute, analysis))
            if len(shortlist) < keep:
                heapq.heappush(shortlist, new)
            elif new > shortlist[0]:
                heapq.heapreplace(shortlist, new)
            if analysis.time_s < self.best_time:
                self.best_time = analysis.time_s
                self.progress.incumbent(analysis.time_s)

    def out_of_time(self) -> bool:
        """Whether the caller's time limit has run out."""
        return self.deadline is not None and time.perf_counter() >= self.deadline

    def _split(self, sk: Skeleton, st: Setting, limit: float, threshold: float = INF, dp_beaten: bool = False):
        """(split, analysis) of the best fitting split the target engine can run, or None:
        engines with one recomputation setting get the best split per mode, and an engine
        that fixes the split (DeepSpeed's uniform partition) gets only that split.
        ``dp_beaten``: no split within the DPs' chunk budgets can beat ``threshold`` (see
        :meth:`_dp_splits_bounded`), so only the splits outside them are tried."""
        e = self.engine
        if not self.restricted:
            return self._split_modes(sk, st, limit, threshold, self.modes, dp_beaten)
        S = sk.pp * st.virtual_stages
        best = None
        for mode in (self.modes if e.uniform_recompute else (None,)):
            modes = (mode,) if mode is not None else self.modes
            if e.split == "uniform-units" and sk.pp > 1:
                from autoplan.engines import partition_uniform
                cuts = partition_uniform(self.L, S)
                bounds = tuple(zip(cuts, cuts[1:]))
                analysis, _ = analyze(self.tables, sk, st, bounds, modes * S, fitting_only=True)
                found = (Split(bounds=bounds, recompute=modes * S, period=0.0, total=0.0), analysis) \
                    if analysis.fits else None
            else:
                found = self._split_modes(sk, st, limit, threshold, modes)
            if found is not None and (best is None or found[1].time_s < best[1].time_s):
                best = found
        return best

    def _dp_splits_bounded(self, sk: Skeleton, st: Setting) -> bool:
        """Whether :meth:`_split_modes` on this interleaved candidate returns a split within
        the DPs' chunk budgets (``Splitter.chunk_budgets``) unless the even split or the
        leanest split beats it: so a bound on such splits that cannot beat the shortlist
        leaves only those two to try. Not where the refinement may run (short simulated
        programs): it starts from whichever split was found."""
        return st.virtual_stages > 1 and not self.restricted and not _refinable(st, sk.pp)

    def _split_modes(self, sk: Skeleton, st: Setting, limit: float, threshold: float, modes: tuple[str, ...],
                     dp_beaten: bool = False):
        """(split, analysis) of the best fitting split found with per-stage recompute from
        ``modes``, or None. Interleaved chunks share their group's memory, so their DP works
        on per-chunk targets and the exact joint peak decides; the group-balanced split
        competes with the DP's. A simulated split whose busiest rank alone cannot beat
        ``threshold``, or the best split found here so far, is not simulated; one whose
        ranks' compute alone cannot is not costed at all (of a closed-form one only
        whether it fits is asked, when that decides whether the leanest split is sought).
        ``dp_beaten`` (interleaved only): no split within the DPs' chunk budgets can beat
        ``threshold``; only the even split and, failing it, the leanest split are tried."""
        timed_splits: dict = {}
        known: dict = {}   # (stage figures, shared by every split tried here)
        best = None

        def timed(split, memory_first: bool = False):
            # (memory_first: the split is likely not to fit, so that is asked before its
            # stage figures are computed; simulated splits are pruned by time instead.)
            key = (split.bounds, split.recompute)
            if key in timed_splits:   # (the even interleaved split is checked before it is offered)
                return timed_splits[key]
            bar = threshold if best is None else min(threshold, best[1].time_s)
            # (The margin: the floor adds the same terms as the figures in another order. The
            # device-only floor against the whole bar: the hosts only lengthen a step.)
            hopeless = work_floor(self.tables, sk, st, split.bounds, split.recompute) > bar * (1 + 1e-9)
            if hopeless and sim:
                self.stats.pruned_split_bound += 1
                timed_splits[key] = None
                return None
            if hopeless or (memory_first and not sim):
                # Only whether it fits is asked first. A hopeless split matters only while
                # nothing here fits, as a fitting split (so the leanest split is not
                # sought), and is then ranked after any split that is timed.
                fits = (best is None or not hopeless) and fits_memory(self.tables, sk, st, split.bounds,
                                                                        split.recompute)
                if hopeless or not fits:
                    timed_splits[key] = Analysis(time_s=INF, memory=(), fits=fits)
                    return timed_splits[key]
            figs = stage_figures(self.tables, sk, st, split.bounds, split.recompute, known)
            if sim and self.bounds.host_ceiling(sk, st.num_micro_batches) > HOST_NEGLIGIBLE * bar:
                # What the device may take beside this split's hosts and still beat the bar.
                bar = device_budget(bar, host_time(self.tables, sk, st, figs))
            if sim and busy_bound(self.tables, sk, st, figs) >= bar:
                self.stats.pruned_split_bound += 1
                timed_splits[key] = None
                return None
            analysis, _ = analyze(self.tables, sk, st, split.bounds, split.recompute, figs=figs,
                                  fitting_only=True)
            timed_splits[key] = analysis
            return analysis

        leanest: dict = {}

        def lean(joint: bool):
            # The split of least largest memory-to-budget ratio (its ``period``) under the
            # DP's per-chunk budgets (joint or not) and ``limit``.
            if joint not in leanest:
                leanest[joint] = self.splitter.split(sk, st, modes, objective="memory", joint=joint,
                                                     period_limit=limit)
            return leanest[joint]

        def timed_dp(joint: bool):
            # (No leanest-split DP first to prove that nothing fits: most of the time
            # something does, and the time DP's own no-split test answers the rest.)
            return self.splitter.split(sk, st, modes, period_limit=limit, joint=joint)

        sim = simulated(st, sk.pp)
        if st.virtual_stages == 1:
            tries = [lambda: self.splitter.split(sk, st, modes, period_limit=limit)]
        elif dp_beaten:
            tries = [lambda: self._even_interleave(sk, st, modes, timed)]
        else:
            tries = [lambda: timed_dp(True),
                     lambda: self.splitter.balanced_interleave(sk, st, modes),
                     lambda: self._even_interleave(sk, st, modes, timed)]
        for attempt in (tries, [] if dp_beaten else [lambda: timed_dp(False)]):
            for make in attempt:
                split = make()
                if split is None:
                    continue
                analysis = timed(split)
                if analysis is not None and analysis.fits and (best is None or analysis.time_s < best[1].time_s):
                    best = (split, analysis)
            if best is not None or st.virtual_stages == 1:
                break
        if (best is not None and self.host_splitter is not None and sk.pp > 1
                and self.bounds.host_ceiling(sk, st.num_micro_batches) >= 0.5 * best[1].time_s
                and split_host_time(self.tables, sk, st, best[0].bounds, best[0].recompute) >= 0.5 * best[1].time_s):
            # A step that waits on its hosts is as slow as the group issuing the most
            # kernels: the split balanced for that too competes (costmodel.host).
            split = self.host_splitter.split(sk, st, modes)
            analysis = timed(split) if split is not None else None
            if analysis is not None and analysis.fits and analysis.time_s < best[1].time_s:
                best = (split, analysis)
        if best is None and st.virtual_stages > 1:
            # Chunks share one memory and the DPs' per-chunk budgets are conservative: the
            # leanest split (balanced for memory instead of time) may still fit exactly.
            for joint in (True, False):
                split = lean(joint)
                if split is not None:
                    analysis = timed(split)
                    if analysis is not None and analysis.fits:
                        best = (split, analysis)
                        break
        # (An unrestricted search refines once its loop is done, against the final
        # shortlist: see _refine_late.)
        if (self.restricted and best is not None and _refinable(st, sk.pp) and self.refine_left > 0
                and best[1].time_s < REFINE_WINDOW * threshold):
            best = self._refine(sk, st, *best, modes=modes, known=known)
        return best

    def _even_interleave(self, sk: Skeleton, st: Setting, modes: tuple[str, ...], timed) -> Split | None:
        """Megatron's even split with one recompute mode for every chunk, the least
        recomputation that fits by the exact check. The DPs give interleaved chunks
        conservative shares of their group's memory; a plan that fits only as a whole (the
        one ``Plan.uniform`` writes) would otherwise be lost."""
        S = sk.pp * st.virtual_stages
        try:
            bounds = tuple(even_split(self.model, S))
        except ConfigError:
            return None
        for i, mode in enumerate(modes):
            split = Split(bounds=bounds, recompute=(mode,) * S, period=0.0, total=0.0)
            # (Every mode but the leanest mostly does not fit: asked first, cheaply.)
            analysis = timed(split, memory_first=i < len(modes) - 1)
            if analysis is not None and analysis.fits:
                return split
        return None

    def _refine(self, sk: Skeleton, st: Setting, split: Split, analysis, budget: int = REFINE_MOVES,
                modes: tuple[str, ...] | None = None, known: dict | None = None):
        """Local search around the DP's split for short programs, which are timed by exact
        simulation: there the fill and drain, which the DP's period-first objective only
        approximates, decide. Moves: shift a run of consecutive stage boundaries by one
        unit (one boundary, or several together, which moves a unit across stages), or
        change one stage's recompute mode; take the first improving move, repeat
        (deterministic)."""
        modes = modes or self.modes
        known = {} if known is None else known   # (a move changes a stage or two: the rest are known)
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
                # Each rank runs its m micro-batches' work one after another, then its
                # optimizer step: a move that cannot beat the incumbent even so, or does
                # not fit, is not simulated.
                figs = stage_figures(self.tables, sk, st, nb, nr, known)
                if busy_bound(self.tables, sk, st, figs) >= best_t:
                    continue
                self.refine_left -= 1
                a, _ = analyze(self.tables, sk, st, nb, nr, figs=figs, fitting_only=True)
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
            actions = _actions(cand.skeleton, cand.setting)
            if done and (used + actions > budget or self.out_of_time()):
                break
            # Past the first few, a candidate the fast model puts well behind the best full
            # estimate so far cannot overtake it (the fast model is exact for short
            # programs and within a few percent for long ones).
            if len(done) >= ESTIMATE_AT_LEAST and t > ESTIMATE_WINDOW * min(d[0] for d in done):
                break
            used += actions
            hit = self._full.get(id(cand))
            plan, est, skipped = hit[1] if hit is not None and hit[0] is cand else self._plan_estimate(cand)
            self.progress.step()
            if skipped == "target":
                self.stats.excluded_by_target += 1
            elif skipped == "fit":
                self.stats.estimate_fit_mismatch += 1
            if est is None:
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

    def _plan_estimate(self, cand: Candidate) -> tuple:
        """(plan, full estimate, why skipped) of a candidate as the estimate phase ranks it:
        the estimate is None where that phase skips the plan, because the target engine
        cannot run it ("target") or the full model finds that it does not fit ("fit")."""
        plan = cand.to_plan(self.model, self.dtype)
        if self.restricted:
            from autoplan.engines import violation
            if violation(plan, self.engine, self.model, self.cluster) is not None:
                return plan, None, "target"
        est = full_estimate(self.model, self.cluster, plan, self.options)
        self.stats.estimates += 1
        return (plan, est, None) if est.fits else (plan, None, "fit")

    def _full_estimate(self, cand: Candidate):
        """The full estimate of an incumbent (None where the estimate phase would skip it),
        kept for that phase."""
        found = self._plan_estimate(cand)
        self._full[id(cand)] = (cand, found)
        return found[1]

    # ------------------------------------------------------- no plan fits
    def _lean_skeletons(self, skeletons: list[Skeleton]) -> list[Skeleton]:
        if len(self.cluster.groups) == 1:
            return skeletons or self.homogeneous_skeletons()
        # Mixed clusters: every node group, its largest tp, as many device groups as it
        # holds, for the three smallest data-parallel degrees.
        # Which node group goes first decides the in-flight counts each must hold: every
        # order on up to three node groups, else that one and its reverse.
        out = list(skeletons)
        tps = self.tp_options()
        roomy = sorted(range(len(self.cluster.groups)), key=lambda k: (-self.cluster.groups[k].device.memory_bytes, k))
        orders = list(itertools.permutations(roomy)) if len(roomy) <= 3 else [tuple(roomy), tuple(roomy[::-1])]
        for dp in self.dp_options()[:3]:
            for order in orders:
                seq = []
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

    def _memory_and_states(self) -> tuple[float, float]:
        """(every device's memory put together, the model's weights, gradients and
        optimizer states unsharded): however the states are sharded, they need the second."""
        total_mem = sum(g.device.memory_bytes * g.num_gpus for g in self.cluster.groups)
        return total_mem, float(self.tables.state_bytes(self.model.num_params, 0.0, 1, 0))

    def _states_exceed_cluster(self) -> bool:
        total_mem, states = self._memory_and_states()
        return states > total_mem

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
        total_mem, states = self._memory_and_states()
        lines = [f"No plan fits in memory: {self.model.name} (seq {self.model.seq_len}, global batch {self.gb}) "
                 f"on {self.cluster.num_gpus} GPUs ({total_mem / GiB:,.0f} GiB in all)."]
        if states > total_mem:
            lines.append(f"Its weights, gradients and optimizer states alone take {states / GiB:,.0f} GiB.")
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


def _with_zero(st: Setting, zero: int) -> Setting:
    return st if st.zero == zero else Setting(st.micro_batch, st.num_micro_batches, st.schedule, st.virtual_stages,
                                              zero, st.sequence_parallel)


def _count_sequences(runs: list[list], longest: int) -> int:
    """How many pipelines _sequences() yields at most: over every set of node groups used,
    the runs each may serve, in any order (the length limit is ignored: an upper bound)."""
    from math import factorial, prod
    total = 0
    for used in itertools.product((False, True), repeat=len(runs)):
        chosen = [len(r) for r, u in zip(runs, used) if u]
        if chosen:
            total += factorial(len(chosen)) * prod(chosen)
    return total


def _sequences(runs: list[list], longest: int):
    """Device-kind sequences: each node group serves at most one run of consecutive
    pipeline positions with one tensor-parallel degree, the runs in any order."""
    for used in itertools.product(*[[None] + r for r in runs]):
        chosen = [x for x in used if x is not None]
        if not chosen or sum(c for _, c in chosen) > longest:
            continue
        for order in itertools.permutations(chosen):
            yield [kind for kind, count in order for _ in range(count)]
