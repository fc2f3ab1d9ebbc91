"""Placement of device groups on pipeline stages for heterogeneous clusters (CP-SAT).

On a cluster of several node groups the pipeline is a sequence of device groups, each
drawn from one node group with its own tensor-parallel degree. Which node groups serve
which pipeline positions, how many positions each gets, and in which order, is a
combinatorial choice: faster devices should take more layers, devices with more memory
should sit early (under 1F1B the first stage holds ``pp`` micro-batches of activations,
the last one), and every change of node group along the pipeline is a hop over the
slower network. This module states that choice as a small integer program and lets
OR-Tools CP-SAT solve it:

* slots ``i = 0 .. S-1`` counted from the *end* of the pipeline (so slot ``i`` holds
  ``min(i + 1, m)`` micro-batches under 1F1B whatever the pipeline's length); slot
  ``i`` is active with one device kind (node group, tp) or empty, active slots form a
  prefix, slot 0 (the last stage, with the head) is always active;
* integer ``y[i, kind, mode]``: transformer-body units on slot ``i`` under recompute
  ``mode``; the embedding goes to the first active slot, the head to slot 0;
* each node group lends at most its GPUs (``dp * tp`` per device group);
* each slot's memory (model states under the chosen ZeRO stage, in-flight activations,
  the largest transient) fits its device;
* objective: ``(m - 1) * period + sum of stage times + hop costs`` (the 1F1B closed form).

Solves are deterministic (one worker, fixed seed, a *deterministic* time limit). The
layer counts it picks are only a sketch: the DP of :mod:`search.split` re-splits the
model exactly for every schedule and setting on the device-group sequence found here.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

from autoplan.plan import DeviceGroup
from costmodel.efficiency import default_efficiency
from search.evaluate import Skeleton
from search.tables import RECOMPUTES, Kind, Tables

INF = float("inf")


@dataclass
class PlacementStats:
    """What the CP-SAT stage did."""

    solves: int = 0
    """CP-SAT solves run."""
    optimal: int = 0
    """Solves proven optimal within the limit."""
    infeasible: int = 0
    """Solves that proved nothing fits."""
    skeletons: int = 0
    """Distinct device-group sequences produced."""
    enumerated: int = 0
    """Sequences enumerated exhaustively instead (small clusters: CP-SAT not needed)."""
    skipped: int = 0
    """(dp, micro-batch) pairs not placed: no pipeline of them could hold the model."""
    floored: int = 0
    """Models not solved: their objective's floor (``Proposals.floor_s``) was beyond
    ``placement_alternatives_within`` of the best optimum of their ZeRO sizing."""
    wall_s: float = 0.0
    """Seconds in CP-SAT."""


def pool_kinds(tables: Tables, dp: int, tp_allowed: list[int], pools: list[int] | None = None) -> list[Kind]:
    """Device kinds a pipeline group may be: tensor-parallel degrees dividing the node
    (so each replica's tp ranks share a node) and leaving room for dp replicas."""
    cluster = tables.cluster
    out = []
    for k, ng in enumerate(cluster.groups):
        if pools is not None and k not in pools:
            continue
        for t in tp_allowed:
            if ng.gpus_per_node % t == 0 and dp * t <= ng.num_gpus:
                out.append(Kind(k, t))
    return out


def allocate(tables: Tables, dp: int, kinds: list[Kind]) -> Skeleton | None:
    """Ranks for a device-kind sequence: each node group hands out consecutive blocks of
    ``dp * tp`` ranks in pipeline order (neighbouring stages land on the same or adjacent
    nodes), each block aligned to its tp so no tensor-parallel group straddles a node."""
    cluster = tables.cluster
    offset = {k: 0 for k in range(len(cluster.groups))}
    groups = []
    for kind in kinds:
        start = -(-offset[kind.pool] // kind.tp) * kind.tp
        size = dp * kind.tp
        if start + size > cluster.groups[kind.pool].num_gpus:
            return None
        first = cluster.group_ranks(kind.pool).start
        groups.append(DeviceGroup(ranks=tuple(range(first + start, first + start + size)), tp=kind.tp))
        offset[kind.pool] = start + size
    return Skeleton(groups=tuple(groups), kinds=tuple(kinds))


def _ends(model) -> tuple[int, int]:
    kinds = [l.kind for l in model.layers]
    lead = 1 if kinds and kinds[0] == "embedding" else 0
    tail = 1 if len(kinds) - lead > 0 and kinds[-1] == "head" else 0
    return lead, tail


def place(tables: Tables, *, dp: int, micro_batch: int, num_micro_batches: int, sequence_parallel: bool,
          kinds: list[Kind], zeros: list[int], modes: list[str], max_stages: int, use_all_gpus: bool,
          alternatives: int, det_time_limit: float, seed: int, stats: PlacementStats,
          orders: int = 2) -> "list[Proposals]":
    """CP-SAT's proposals for one (dp, micro-batch), each with its optimum solved (empty
    where nothing is proposed); ``Proposals.more`` adds up to ``alternatives - 1``
    next-best distinct sequences (each excluded by a no-good cut).

    Sized with the leanest ZeRO stage short of 3 (ZeRO 0-2 cost the same time here) and,
    where data parallelism allows it, with ZeRO-3, which fits more per device but gathers
    parameters every micro-batch. Both are needed: CP-SAT's memory model is coarser than
    the DP's, so the shallower pipelines the ZeRO-3 sizing proposes often fit under ZeRO-1
    or 2 as well (on the benchmark's 16,384-GPU three-type cluster the best plan, ZeRO-2 on
    6 stages, is proposed only by the ZeRO-3 sizing; without it the best found was 39%
    slower)."""
    models = sizings(tables, dp=dp, micro_batch=micro_batch, num_micro_batches=num_micro_batches,
                     sequence_parallel=sequence_parallel, kinds=kinds, zeros=zeros, modes=modes,
                     max_stages=max_stages, use_all_gpus=use_all_gpus, alternatives=alternatives,
                     det_time_limit=det_time_limit, seed=seed, stats=stats, orders=orders)
    return [props for props in models if props.first()]


def sizings(tables: Tables, *, dp: int, micro_batch: int, num_micro_batches: int, sequence_parallel: bool,
            kinds: list[Kind], zeros: list[int], modes: list[str], max_stages: int, use_all_gpus: bool,
            alternatives: int, det_time_limit: float, seed: int, stats: PlacementStats,
            orders: int = 2) -> "list[Proposals]":
    """The models ``place`` solves for one (dp, micro-batch), one per ZeRO sizing, none
    solved yet (each knows its objective's floor, so a caller can solve the promising
    ones first and leave the hopeless unsolved)."""
    lean = [z for z in zeros if z < 3 or dp == 1]
    tries = ([max(lean)] if lean else []) + ([3] if 3 in zeros and dp > 1 else [])
    return [Proposals(tables, dp=dp, micro_batch=micro_batch, num_micro_batches=num_micro_batches,
                      sequence_parallel=sequence_parallel, kinds=kinds, zero=z, modes=modes,
                      max_stages=max_stages, use_all_gpus=use_all_gpus, alternatives=alternatives,
                      det_time_limit=det_time_limit, seed=seed, stats=stats, orders=orders)
            for z in tries]


class Proposals:
    """The CP-SAT model of one (dp, micro-batch, ZeRO stage) and the device-group
    sequences its solutions gave so far, best first."""

    def __init__(self, tables: Tables, **kw):
        self.found: list[Skeleton] = []
        """Distinct sequences proposed so far, in the order found."""
        self.estimate_s: float | None = None
        """The optimum's objective in seconds (the model's coarse 1F1B closed form: a way
        to compare data-parallel degrees, not a bound); None before it is solved."""
        self.zero: int = kw["zero"]
        """The ZeRO stage the model was sized for."""
        self._left = max(1, kw.pop("alternatives"))
        floor_s, self._solve = _model(tables, **kw, found=self.found)
        self.floor_s: float = floor_s
        """No solution's objective (seconds) is below it, infinite where the model has none
        (``_objective_floor``); known before any solve."""

    def first(self) -> bool:
        """Solve for the optimum; whether anything was proposed. (Until a sequence is
        allocated: a solution whose groups the pools cannot lay out proposes nothing, and
        the next-best may.)"""
        while not self.found and self.solve():
            pass
        return bool(self.found)

    def solve(self) -> bool:
        """Solve once more (the next-best set of runs); False when nothing is left."""
        if self._left <= 0 or self._solve is None:
            return False
        self._left -= 1
        value = self._solve()
        if value is None:
            self._left = 0
            return False
        if self.estimate_s is None:
            self.estimate_s = value
        return True

    def more(self) -> list[Skeleton]:
        """Every sequence the alternatives allowed, solving what is left."""
        while self.solve():
            pass
        return self.found


def _model(tables: Tables, *, dp: int, micro_batch: int, num_micro_batches: int, sequence_parallel: bool,
           kinds: list[Kind], zero: int, modes: list[str], max_stages: int, use_all_gpus: bool,
           det_time_limit: float, seed: int, stats: PlacementStats, orders: int, found: list[Skeleton]):
    """The CP-SAT model of one (dp, micro-batch, ZeRO stage): the floor of its objective
    in seconds (``_objective_floor``) and a function that solves it once (building it on
    the first call), adds the sequences of the solution to ``found``, cuts that solution
    off and returns its objective in seconds (None: infeasible or no solution in time);
    (inf, None) when there is nothing to place."""
    model, cluster = tables.model, tables.cluster
    L = model.num_layers
    lead, tail = _ends(model)
    nb = L - lead - tail
    if nb < 1 or not kinds:
        return INF, None
    m, b = num_micro_batches, micro_batch
    stack = tables.stack
    w = stack.gathered_weights_bytes_per_param
    qs = [RECOMPUTES.index(x) for x in modes]
    body = slice(lead, L - tail)
    z3 = zero >= 3 and dp > 1
    per_param = stack.state_bytes_per_param(dp, zero)
    pools = sorted({kd.pool for kd in kinds})

    # ---- per-kind coefficients (averages over the body's units; the DP is exact later)
    K = range(len(kinds))
    T, A = {}, {}
    E, H, Ae, Ah, SB, SE, SH, TR, TRH, cap, N, OPT = ({} for _ in range(12))
    for gi, kind in enumerate(kinds):
        t = tables.table(kind, b, sequence_parallel)
        extra = 0.0
        if z3:
            # ZeRO-3 gathers every unit's parameters and scatters its gradients per
            # micro-batch over the node group's network (a sketch of the per-stage cost).
            ng = cluster.groups[kind.pool]
            nic = cluster.nic(kind.pool).bandwidth * default_efficiency(ng.device.name).network
            extra = float(t.params[body].mean()) * (w + stack.grad_reduce_bytes_per_param) / nic
        for q in qs:
            unit = t.forward + t.backward_input[q] + t.backward_weight
            T[gi, q] = float(unit[body].mean()) + extra
            A[gi, q] = float(t.activation[q][body].mean())
        unit0 = t.forward + t.backward_input[qs[0]] + t.backward_weight
        E[gi] = float(unit0[0]) if lead else 0.0
        H[gi] = float(unit0[L - 1]) if tail else 0.0
        Ae[gi] = float(t.activation[qs[-1]][0]) if lead else 0.0
        Ah[gi] = float(t.activation[qs[-1]][L - 1]) if tail else 0.0
        SB[gi] = float(t.params[body].mean()) * per_param
        # After the last backward a stage still steps its optimizer (on its ZeRO shard)
        # and exposes part of its gradient reduction: per body unit, on this kind.
        unit_params = float(t.params[body].mean())
        OPT[gi] = unit_params / (dp if zero >= 1 else 1) * tables.optimizer_rate(kind.pool)
        SE[gi] = float(t.params[0]) * per_param if lead else 0.0
        SH[gi] = float(t.params[L - 1]) * per_param if tail else 0.0
        # Transients (optimistic: the mode with the smaller one): the body's largest for
        # any stage, the head's (logits gradients) only on the last.
        z3w = 2 * float(t.params.max()) * w if z3 else 0.0
        TR[gi] = min(float(t.transient[q][body].max()) for q in qs) + z3w
        TRH[gi] = (min(float(t.transient[q][L - 1]) for q in qs) if tail else 0.0) + z3w
        cap[gi] = tables.capacity(kind.pool) - tables.fixed_bytes(kind.pool)
        N[gi] = min(cluster.groups[kind.pool].num_gpus // (dp * kind.tp), max_stages, nb)

    # Integer scaling: times to ~1e4 units for the whole body on the fastest kind, bytes
    # to ~1e5 per device (coarse on purpose: small coefficients keep CP-SAT fast, and
    # the DP re-splits exactly).
    t_scale = 1e4 / max(min(T[gi, qs[0]] for gi in K) * nb, 1e-12)
    m_scale = 1e5 / max(cap.values())

    def ti(x: float) -> int:
        return int(round(x * t_scale))

    def mi(x: float) -> int:
        return int(round(x * m_scale))

    S_max = min(max_stages, nb)
    floor = _objective_floor(kinds, qs, nb, m, S_max, N,
                             time={(g, q): ti(T[g, q]) for g in K for q in qs},
                             room={(g, q): mi(cap[g]) - mi(TR[g]) for g in K for q in qs},
                             per_unit={(g, q): mi(SB[g] + A[g, q]) for g in K for q in qs})
    if floor is None:
        return INF, None

    def build():
        # A hop between node groups crosses the slower NIC of the two; tp ranks send in parallel.
        out_bytes = b * float(max(l.output_bytes for l in model.layers))
        nics = [cluster.nic(k.pool) for k in kinds]
        hop = max(n.latency for n in nics) + out_bytes / min(k.tp for k in kinds) / (
            min(n.bandwidth for n in nics) * 0.85)

        mdl = cp_model.CpModel()
        u = {g: mdl.NewBoolVar(f"u{g}") for g in K}                     # kind g forms a run
        n = {g: mdl.NewIntVar(0, N[g], f"n{g}") for g in K}             # its device groups
        c = {g: mdl.NewIntVar(0, nb, f"c{g}") for g in K}               # body units per stage
        rho = {(g, q): mdl.NewBoolVar(f"rho{g}_{q}") for g in K for q in qs}
        bare = {}
        for g in K:
            mdl.Add(n[g] >= u[g])
            mdl.Add(n[g] <= N[g] * u[g])
            # A run holds body units, except a single first (last) stage may hold only
            # the embedding (head): that is how little a slow device can usefully take.
            bare[g] = mdl.NewBoolVar(f"bare{g}")
            mdl.Add(c[g] >= u[g] - bare[g])
            mdl.Add(c[g] <= nb * u[g])
            mdl.Add(sum(rho[g, q] for q in qs) == u[g])
        used = {}
        for k in pools:
            mine = [g for g in K if kinds[g].pool == k]
            used[k] = sum(u[g] for g in mine)
            mdl.Add(used[k] <= 1)      # one run, one tp per node group
            gpus = sum(n[g] * dp * kinds[g].tp for g in mine)
            if use_all_gpus:
                mdl.Add(gpus == cluster.groups[k].num_gpus)
        stages = sum(n.values())
        mdl.Add(stages >= 1)
        mdl.Add(stages <= S_max)
        # nc[g] = n[g] * c[g]: units the run holds; together they cover the body.
        nc = {}
        for g in K:
            nc[g] = mdl.NewIntVar(0, N[g] * nb, f"nc{g}")
            mdl.AddMultiplicationEquality(nc[g], [n[g], c[g]])
        mdl.Add(sum(nc.values()) >= nb)
        # Order of the runs: before[k, l] = node group k's run precedes l's.
        before = {}
        for k in pools:
            for l in pools:
                if k < l:
                    before[k, l] = mdl.NewBoolVar(f"b{k}_{l}")
                    before[l, k] = before[k, l].Not()
        for k in pools:
            for l in pools:
                for j in pools:
                    if len({k, l, j}) == 3:
                        mdl.AddBoolOr([before[k, l].Not(), before[l, j].Not(), before[k, j]])
        npool = {k: sum(n[g] for g in K if kinds[g].pool == k) for k in pools}
        # after[k]: stages behind node group k's run (they set its in-flight count).
        after = {}
        for k in pools:
            terms = []
            for l in pools:
                if l == k:
                    continue
                z = mdl.NewIntVar(0, S_max, f"a{k}_{l}")
                mdl.Add(z <= npool[l])
                mdl.Add(z <= S_max * before[k, l])
                mdl.Add(z >= npool[l] - S_max * (1 - before[k, l]))
                terms.append(z)
            after[k] = mdl.NewIntVar(0, S_max, f"after{k}")
            mdl.Add(after[k] == sum(terms))
        first, last = {}, {}
        for k in pools:
            # First run: every other used run comes after it; last: none does.
            first[k] = mdl.NewBoolVar(f"first{k}")
            last[k] = mdl.NewBoolVar(f"last{k}")
            mdl.Add(after[k] == stages - npool[k]).OnlyEnforceIf(first[k])
            mdl.Add(after[k] != stages - npool[k]).OnlyEnforceIf(first[k].Not())
            mdl.Add(after[k] == 0).OnlyEnforceIf(last[k])
            mdl.Add(after[k] >= 1).OnlyEnforceIf(last[k].Not())
        for g in K:
            k = kinds[g].pool
            mdl.Add(n[g] == 1).OnlyEnforceIf(bare[g])
            mdl.AddBoolOr([first[k], last[k]]).OnlyEnforceIf(bare[g])
        horizon = ti(max(T[g, q] for g in K for q in qs) * nb + max(E.values()) + max(H.values())) + 10
        tau = mdl.NewIntVar(0, horizon, "tau")
        big_t = horizon
        for g in K:
            k = kinds[g].pool
            # In flight at the run's front stage under 1F1B: the stages from there to the end.
            front = mdl.NewIntVar(0, S_max, f"front{g}")
            mdl.AddMinEquality(front, [after[k] + n[g], m])
            cf = mdl.NewIntVar(0, S_max * nb, f"cf{g}")
            mdl.AddMultiplicationEquality(cf, [c[g], front])
            for q in qs:
                on = [rho[g, q]]
                mdl.Add(tau >= ti(T[g, q]) * c[g] + ti(E[g]) * first[k] + ti(H[g]) * last[k]
                        - big_t * (1 - rho[g, q]))
                # The run's front stage (most in flight) and, for the last run, its last
                # stage (the head's logits) must fit.
                mdl.Add(mi(SB[g]) * c[g] + mi(A[g, q]) * cf + mi(SE[g]) * first[k] + mi(Ae[g]) * m * first[k]
                        + mi(TR[g]) <= mi(cap[g])).OnlyEnforceIf(on)
                mdl.Add(mi(SB[g] + A[g, q]) * c[g] + mi(SH[g] + Ah[g] + TRH[g]) * last[k] + mi(TR[g])
                        <= mi(cap[g])).OnlyEnforceIf(on)
        fill = sum(ti(T[g, qs[0]]) * nc[g] for g in K)
        hops = sum(used.values()) - 1
        # The iteration ends with the slowest stage's optimizer step.
        tail = mdl.NewIntVar(0, horizon, "tail")
        for g in K:
            mdl.Add(tail >= ti(OPT[g]) * c[g])
        objective = (m - 1) * tau + fill + 2 * ti(hop) * hops + tail
        mdl.Minimize(objective)

        def solve() -> float | None:
            solver = cp_model.CpSolver()
            solver.parameters.num_workers = 1
            solver.parameters.random_seed = seed
            solver.parameters.max_deterministic_time = det_time_limit
            # The models are small (a few dozen variables): CP-SAT's default cut
            # generation, probing and repeated presolve cost more than they prune here.
            # Without them the same optima are proven in 35-50% of the CPU time (every
            # model of the 128- to 16,384-GPU benchmark searches: same status and objective).
            solver.parameters.add_cg_cuts = False
            solver.parameters.add_mir_cuts = False
            solver.parameters.add_zero_half_cuts = False
            solver.parameters.add_clique_cuts = False
            solver.parameters.max_all_diff_cut_size = 0
            solver.parameters.cp_model_probing_level = 0
            solver.parameters.max_presolve_iterations = 1
            t0 = time.perf_counter()
            status = solver.Solve(mdl)
            stats.wall_s += time.perf_counter() - t0
            stats.solves += 1
            if status == cp_model.OPTIMAL:
                stats.optimal += 1
            if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
                if status == cp_model.INFEASIBLE:
                    stats.infeasible += 1
                return None
            before = len(found)
            runs = [(solver.Value(after[kinds[g].pool]), g) for g in K if solver.Value(u[g])]
            ordered = [g for _, g in sorted(runs, reverse=True)]
            # The model orders runs only through memory (in-flight counts) and sizes them by
            # averages; the DP judges orders exactly, so the reverse order is kept too (with
            # two node groups that is every order), and every order of up to ``orders`` runs
            # (an order whose groups cannot hold the model is pruned before any DP).
            if len(ordered) <= orders:
                ways = [ordered] + [list(o) for o in itertools.permutations(ordered) if list(o) != ordered]
            else:
                ways = [ordered, ordered[::-1]]
            for order in ways:
                seq = [kinds[g] for g in order for _ in range(solver.Value(n[g]))]
                sk = allocate(tables, dp, seq)
                if sk is not None and all(sk.groups != f.groups for f in found):
                    found.append(sk)
            # Not this same set of runs again: some kind switches on or off, or a count differs.
            sol = {g: solver.Value(n[g]) for g in K if solver.Value(u[g])}
            lits = [u[g] for g in K if g not in sol] + [u[g].Not() for g in sol]
            for g, count in sol.items():
                diff = mdl.NewBoolVar(f"d{g}_{count}")
                mdl.Add(n[g] != count).OnlyEnforceIf(diff)
                lits.append(diff)
            mdl.AddBoolOr(lits)
            if status == cp_model.OPTIMAL:
                # What is left was there when this optimum was proven: none of it is better,
                # so the next solve stops at the first solution that ties.
                mdl.Add(objective >= int(round(solver.ObjectiveValue())))
            stats.skeletons += len(found) - before
            return solver.ObjectiveValue() / t_scale

        return solve

    built = []

    def solve_lazily() -> float | None:
        if not built:
            built.append(build())
        return built[0]()

    return floor / t_scale, solve_lazily


def _objective_floor(kinds: list[Kind], qs: list[int], nb: int, m: int, S_max: int, N: dict,
                     time: dict, room: dict, per_unit: dict) -> float | None:
    """A lower bound on the placement model's objective, in its integer units, from a
    relaxation solved without CP-SAT (None: the model has no solution).

    Kept of the model: the objective is at least ``(m - 1) * tau + fill``; ``fill`` at least
    the body's units on the kind fastest per unit; a stage of kind ``g`` in mode ``q``
    holds at most ``room // per_unit`` units (its memory constraint less the non-negative
    terms) and at most ``tau // time`` (the period constraint); each node group serves at
    most one kind, ``n_g <= N_g`` stages, at most ``S_max`` in all, and the stages cover
    the body. Dropped (each only raises the optimum): the order, the in-flight
    activations, the embedding and head, hops, the optimizer tail, the GPU count. The
    least ``tau`` at which the stages can cover the body is found by bisection (coverage
    only grows with ``tau``)."""
    pools = sorted({kd.pool for kd in kinds})
    by_pool = [[g for g in range(len(kinds)) if kinds[g].pool == k] for k in pools]
    most = {(g, q): nb if per_unit[g, q] <= 0 else max(0, min(nb, room[g, q] // per_unit[g, q]))
            for g in range(len(kinds)) for q in qs}

    def units(g: int, tau: int) -> int:
        return max(min(most[g, q], nb if time[g, q] <= 0 else tau // time[g, q]) for q in qs)

    def covers(tau: int) -> bool:
        # The most units S_max stages can hold: per node group one kind (one that holds
        # fewer units on no more stages than another is never better), its stages filled
        # best first across the groups.
        options = []
        for gs in by_pool:
            held = [(units(g, tau), N[g]) for g in gs]
            options.append([h for h in held if not any(o != h and o[0] >= h[0] and o[1] >= h[1] for o in held)])
        for choice in itertools.product(*options):
            per = sorted(choice, reverse=True)
            left, held = S_max, 0
            for u, n in per:
                take = min(n, left)
                held += u * take
                left -= take
            if held >= nb:
                return True
        return False

    hi = max(time.values()) * nb + 1
    if not covers(hi):
        return None
    lo = 0
    while lo < hi:
        mid = (lo + hi) // 2
        if covers(mid):
            hi = mid
        else:
            lo = mid + 1
    fill = nb * min(time[g, qs[0]] for g in range(len(kinds)))
    return (m - 1) * lo + fill
