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

from dataclasses import dataclass

from ortools.sat.python import cp_model

from autoplan.plan import DeviceGroup
from costmodel.efficiency import default_efficiency
from costmodel.memory import GRAD_BYTES_PER_PARAM
from search.evaluate import Skeleton
from search.tables import DYNAMIC_FACTOR, OVERHEAD, RECOMPUTES, Kind, Tables


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
          alternatives: int, det_time_limit: float, seed: int, stats: PlacementStats) -> list[Skeleton]:
    """Device-group sequences for one (dp, micro-batch): the CP-SAT optimum and up to
    ``alternatives - 1`` next-best distinct sequences (each excluded by a no-good cut)."""
    import time
    model, cluster = tables.model, tables.cluster
    L = model.num_layers
    lead, tail = _ends(model)
    nb = L - lead - tail
    if nb < 1 or not kinds:
        return []
    m, b, w = num_micro_batches, micro_batch, tables.weight_bytes
    qs = [RECOMPUTES.index(x) for x in modes]
    body = slice(lead, L - tail)

    # ---- per-kind coefficients (averages over the body's units; the DP is exact later)
    K = range(len(kinds))
    T, E, H, Pb, Pe, Ph, A, Ae, Ah, TR, Z3W, cap = ({} for _ in range(12))
    for gi, kind in enumerate(kinds):
        t = tables.table(kind, b, sequence_parallel)
        for q in qs:
            unit = t.forward + t.backward_input[q] + t.backward_weight
            T[gi, q] = float(unit[body].mean())
            A[gi, q] = float(t.activation[q][body].mean())
            Ae[gi, q] = float(t.activation[q][0]) if lead else 0.0
            Ah[gi, q] = float(t.activation[q][L - 1]) if tail else 0.0
        unit0 = t.forward + t.backward_input[0] + t.backward_weight
        E[gi] = float(unit0[0]) if lead else 0.0
        H[gi] = float(unit0[L - 1]) if tail else 0.0
        Pb[gi] = float(t.params[body].mean())
        Pe[gi] = float(t.params[0]) if lead else 0.0
        Ph[gi] = float(t.params[L - 1]) if tail else 0.0
        TR[gi] = float(t.transient[qs].max())
        Z3W[gi] = 2 * float(t.params.max()) * w
        cap[gi] = (cluster.groups[kind.pool].device.memory_bytes - OVERHEAD) / DYNAMIC_FACTOR

    def state_per_param(z: int) -> float:
        return (w / (dp if z >= 3 else 1) + GRAD_BYTES_PER_PARAM / (dp if z >= 2 else 1)
                + 12.0 / (dp if z >= 1 else 1))

    # ZeRO-3 gathers per unit (a per-stage effect spread over its units: a sketch only).
    def z3_extra(gi: int, q: int) -> float:
        if dp <= 1:
            return 0.0
        dev = cluster.groups[kinds[gi].pool]
        nic = cluster.nic(kinds[gi].pool).bandwidth * default_efficiency(dev.device.name).network
        return Pb[gi] * (w + GRAD_BYTES_PER_PARAM) / nic

    # Integer scaling: times to ~1e5 units per body-on-the-fastest-kind, bytes to ~1e6 per device.
    t_scale = 1e5 / max(min(T[gi, qs[0]] for gi in K) * nb, 1e-12)
    m_scale = 1e6 / max(cap.values())
    S = max(1, min(max_stages, nb))

    def ti(x: float) -> int:
        return int(round(x * t_scale))

    def mi(x: float) -> int:
        return int(round(x * m_scale))

    # A hop between node groups crosses the slowest NIC of the two; tp ranks send in parallel.
    out_bytes = b * float(max(l.output_bytes for l in model.layers))
    nics = [cluster.nic(k.pool) for k in kinds]
    hop = max(n.latency for n in nics) + out_bytes / min(k.tp for k in kinds) / (
        min(n.bandwidth for n in nics) * 0.85)

    found: list[Skeleton] = []
    cuts: list[list] = []
    for _ in range(max(1, alternatives)):
        mdl = cp_model.CpModel()
        x = {(i, g): mdl.NewBoolVar(f"x{i}_{g}") for i in range(S) for g in K}
        r = {(i, q): mdl.NewBoolVar(f"r{i}_{q}") for i in range(S) for q in qs}
        y = {(i, g, q): mdl.NewIntVar(0, nb, f"y{i}_{g}_{q}") for i in range(S) for g in K for q in qs}
        act = [sum(x[i, g] for g in K) for i in range(S)]
        for i in range(S):
            mdl.Add(act[i] <= 1)
            if i + 1 < S:
                mdl.Add(act[i] >= act[i + 1])
            mdl.Add(sum(r[i, q] for q in qs) == act[i])
            for g in K:
                for q in qs:
                    mdl.Add(y[i, g, q] <= nb * x[i, g])
                    mdl.Add(y[i, g, q] <= nb * r[i, q])
            mdl.Add(sum(y[i, g, q] for g in K for q in qs) >= act[i])
        mdl.Add(act[0] == 1)
        mdl.Add(sum(y.values()) == nb)
        first = [act[i] - (act[i + 1] if i + 1 < S else 0) for i in range(S)]
        xf = {}
        for i in range(S):
            for g in K:
                v = mdl.NewBoolVar(f"f{i}_{g}")
                mdl.Add(v >= x[i, g] + first[i] - 1)
                mdl.Add(v <= x[i, g])
                mdl.AddImplication(v, x[i, g])
                xf[i, g] = v
                mdl.Add(v <= first[i])
        for k in range(len(cluster.groups)):
            use = sum(x[i, g] * dp * kinds[g].tp for i in range(S) for g in K if kinds[g].pool == k)
            if use_all_gpus:
                mdl.Add(use == cluster.groups[k].num_gpus)
            else:
                mdl.Add(use <= cluster.groups[k].num_gpus)
        zs = [z for z in zeros if dp > 1 or z == min(zeros)]
        zeta = {z: mdl.NewBoolVar(f"z{z}") for z in zs}
        mdl.AddExactlyOne(zeta.values())
        horizon = ti(max(T[g, q] for g in K for q in qs) * nb + max(E.values()) + max(H.values())) * 4 + 10
        tau = mdl.NewIntVar(0, horizon, "tau")
        tm = [mdl.NewIntVar(0, horizon, f"t{i}") for i in range(S)]
        big_t = horizon
        for i in range(S):
            n_i = min(i + 1, m)
            for z in zs:
                extra = {(g, q): (z3_extra(g, q) if z >= 3 else 0.0) for g in K for q in qs}
                time_expr = (sum(ti(T[g, q] + extra[g, q]) * y[i, g, q] for g in K for q in qs)
                             + sum(ti(E[g]) * xf[i, g] for g in K)
                             + (sum(ti(H[g]) * x[i, g] for g in K) if i == 0 else 0))
                mdl.Add(tm[i] >= time_expr - big_t * (1 - zeta[z]))
                spp = state_per_param(z)
                mem_expr = (sum(mi(Pb[g] * spp + n_i * A[g, q]) * y[i, g, q] for g in K for q in qs)
                            + sum(mi(Pe[g] * spp + n_i * Ae[g, 0]) * xf[i, g] for g in K)
                            + (sum(mi(Ph[g] * spp + n_i * Ah[g, 0]) * x[i, g] for g in K) if i == 0 else 0)
                            + sum(mi(TR[g] + (Z3W[g] if z >= 3 and dp > 1 else 0.0)) * x[i, g] for g in K))
                big_m = mi(max(cap.values())) * 4 + sum(mi(Pb[g] * spp + m * A[g, q]) * nb for g in K for q in qs)
                mdl.Add(mem_expr <= sum(mi(cap[g]) * x[i, g] for g in K) + big_m * (1 - zeta[z]))
            mdl.Add(tau >= tm[i])
        pools = sorted({kd.pool for kd in kinds})
        hops = []
        for i in range(S - 1):
            sw = mdl.NewBoolVar(f"sw{i}")
            for k in pools:
                here = sum(x[i, g] for g in K if kinds[g].pool == k)
                there = sum(x[i + 1, g] for g in K if kinds[g].pool == k)
                mdl.Add(sw >= here - there - (1 - act[i + 1]))
            hops.append(sw)
        mdl.Minimize((m - 1) * tau + sum(tm) + 2 * ti(hop) * sum(hops))
        for cut in cuts:
            mdl.AddBoolOr(cut)
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        solver.parameters.random_seed = seed
        solver.parameters.max_deterministic_time = det_time_limit
        t0 = time.perf_counter()
        status = solver.Solve(mdl)
        stats.wall_s += time.perf_counter() - t0
        stats.solves += 1
        if status == cp_model.OPTIMAL:
            stats.optimal += 1
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            if status == cp_model.INFEASIBLE:
                stats.infeasible += 1
            break
        seq = []
        for i in reversed(range(S)):
            for g in K:
                if solver.Value(x[i, g]):
                    seq.append(kinds[g])
        sk = allocate(tables, dp, seq)
        if sk is not None:
            found.append(sk)
        # Exclude this exact sequence of kinds and look for the next best.
        cuts.append([x[i, g].Not() if solver.Value(x[i, g]) else x[i, g] for i in range(S) for g in K])
    stats.skeletons += len(found)
    return found
