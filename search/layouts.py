"""Operator-level layout search: CP-SAT chooses every operator's layout on the tensor-parallel ranks.

For one distinct unit (a captured graph, :mod:`autoplan.models.graph`) and a degree t,
each operator picks one of DTensor's strategies (:mod:`autoplan.models.strategies`), each
parameter a placement, and the model pays for

* compute: every operator's forward and backward at its shard shapes
  (:mod:`costmodel.operators`: measured per-operator profiles or the roofline);
* data dependencies: wherever a producer's placement differs from what a consumer needs,
  DTensor's redistribution of the tensor in the forward and of its gradient in the backward
  (:mod:`costmodel.redistribute`, on the group's actual links). One redistribution per
  (tensor, placement) serves every consumer that needs it, as the runtime caches it;
* memory per rank: parameter states (weights, gradients, optimizer) at their placements,
  and the activations autograd keeps, counted once per (tensor, placement).

Objective: seconds per micro-batch (+ ``memory_weight`` x bytes); optional hard cap on the
unit's bytes per rank. The unit's input and output placements are fixed per solve (CP-SAT
assumptions on one model), giving a table ``cost[in][out]`` per distinct unit; a chain
dynamic program over the model's units then picks the boundary placements. Identical blocks
share one table, so a 100-block transformer costs three small models (embedding, block,
head), not a hundred.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

from ortools.sat.python import cp_model

from autoplan.cluster import Cluster
from autoplan.errors import ConfigError
from autoplan.layouts import (Layouts, OpLayout, UnitLayout, backward_target, grad_placement,
                              redistribute_kind)
from autoplan.models.graph import ModelGraph, TensorInfo, UnitGraph
from autoplan.models.opmeasure import OpCost, op_cost, op_key
from autoplan.models.opview import resolve
from autoplan.models.strategies import Strategy, node_strategies, tensor_choices
from costmodel.comm import collective_time
from costmodel.operators import OperatorProfileSource, op_timing
from costmodel.redistribute import redistribute_time

NS = 1e9
"""CP-SAT works in integers: seconds are scaled to nanoseconds..."""
KIB = 1024.0
"""... and bytes to KiB."""


@dataclass(frozen=True)
class LayoutSettings:
    """What one operator-level layout solve optimises for."""

    degree: int
    """Tensor-parallel ranks the operators are laid out on."""
    micro_batch: int = 1
    """Samples per micro-batch (communication and compute scale with it)."""
    inflight: float = 1.0
    """Micro-batches whose activations are alive at once on a rank (1F1B on the first
    stage holds up to pp of them)."""
    state_bytes_per_param: float | None = None
    """Bytes per parameter element kept per rank (weights + gradients + optimizer states);
    None: what the stack keeps without ZeRO (``Stack.state_bytes_per_param(1, 0)``)."""
    stack: object = None
    """The training stack (a Stack or its name; None: 'autoplan'): parameter-state bytes and
    the fused attention kernel's efficiency."""
    memory_cap_bytes: float | None = None
    """Largest bytes per rank one unit may take (None: no cap)."""
    memory_weight: float = 0.0
    """Seconds one byte per rank is worth in the objective (0: time only)."""
    time_limit_s: float = 20.0
    """CP-SAT time limit per solve."""

    def resolved_stack(self):
        from autoplan.stacks import get_stack
        return get_stack(self.stack)

    def state_bytes(self, dtype: str) -> float:
        if self.state_bytes_per_param is not None:
            return self.state_bytes_per_param
        return self.resolved_stack().state_bytes_per_param(1, 0)


@dataclass(frozen=True)
class Collective:
    """One redistribution the solution implies."""

    tensor: str
    """Producing node of the tensor."""
    src: str
    dst: str
    kind: str
    """'all_reduce', 'all_gather', 'reduce_scatter' or 'all_to_all'."""
    nbytes: float
    """Full size of the tensor per sample (batch_scaled) or in total."""
    batch_scaled: bool
    phase: str
    """'forward' or 'backward'."""


@dataclass
class UnitSolution:
    """The layout of one distinct unit for one pair of boundary placements."""

    graph: int
    pin: str
    pout: str
    strategies: dict[str, Strategy]
    """Operator node -> chosen strategy (parameters and inputs included, as 1-output strategies)."""
    time_s: float
    """Seconds per micro-batch on one rank: compute + communication, forward + backward."""
    breakdown: dict[str, float]
    param_bytes: float
    """Parameter-state bytes per rank."""
    activation_bytes: float
    """Saved activation bytes per rank for ``inflight`` micro-batches."""
    collectives: list[Collective]
    optimal: bool

    @property
    def memory_bytes(self) -> float:
        return self.param_bytes + self.activation_bytes


class UnitProblem:
    """The CP-SAT model of one unit at one degree; solved once per boundary pair."""

    def __init__(self, graph: UnitGraph, graph_index: int, cluster: Cluster, groups: Sequence[Sequence[int]],
                 settings: LayoutSettings, dtype: str, profiles: OperatorProfileSource | None = None):
        self.g, self.index, self.settings, self.dtype = graph, graph_index, settings, dtype
        self.cluster, self.groups = cluster, [tuple(x) for x in groups]
        t, b = settings.degree, settings.micro_batch
        devices = {}
        for grp in self.groups:
            for r in grp:
                d = cluster.slots[r].device
                devices.setdefault(d.name, d)
        self.devices = list(devices.values())
        self.profiles = profiles
        self.choices: dict[str, list[Strategy]] = {}
        self.cost: dict[tuple[str, int], OpCost] = {}
        self.time: dict[tuple[str, int], tuple[float, float]] = {}
        self.requires_grad: dict[str, bool] = {}
        self.internal: dict[tuple[str, int], tuple[tuple[str, float], ...]] = {}
        self.measured = 0
        """Operator timings taken from a measured profile (the rest are roofline)."""
        boundary_in = graph.input_nodes[0]
        attention = settings.resolved_stack().attention
        for n in graph.nodes:
            if n.kind == "param":
                self.choices[n.name] = [Strategy((c,), ()) for c in tensor_choices(n.tensor_out, t)]
                self.requires_grad[n.name] = n.tensor_out.dtype.is_floating_point
            elif n.kind == "input":
                info = n.tensor_out
                opts = tensor_choices(info, t) if n.name == boundary_in else ["R"]
                self.choices[n.name] = [Strategy((c,), ()) for c in opts]
                self.requires_grad[n.name] = n.name == boundary_in and info.dtype.is_floating_point
            elif n.kind == "op":
                strategies = node_strategies(graph, n, t)
                self.choices[n.name] = strategies
                self.requires_grad[n.name] = any(self.requires_grad.get(resolve(graph, a)[0], False) for a in n.args)
                for k, s in enumerate(strategies):
                    c = op_cost(graph, n, s, t)
                    self.cost[(n.name, k)] = c
                    f = bwd = 0.0
                    for dev in self.devices:
                        tm = op_timing(dev, c, b, dtype, profiles, key=op_key(graph, n, s, t),
                                       attention=attention)
                        f, bwd = max(f, tm.forward), max(bwd, tm.backward)
                        self.measured += tm.source == "measured"
                    if not self.requires_grad[n.name]:
                        bwd = 0.0
                    self.time[(n.name, k)] = (f, bwd)
                    if s.collectives:
                        self.internal[(n.name, k)] = tuple(
                            (phase, max(collective_time(cluster, grp, nbytes * b, kind) for grp in self.groups))
                            for kind, nbytes, phase in s.collectives)
        # Tensors and who reads them (getitem resolved to the operator output it picks).
        self.readers: dict[tuple[str, int], list[tuple[str, int]]] = {}
        for n in graph.nodes:
            if n.kind == "op":
                for pos, ref in enumerate(n.args):
                    self.readers.setdefault(resolve(graph, ref), []).append((n.name, pos))
        out_node = graph.node(graph.output_node)
        self.out_tensor = resolve(graph, (out_node.name, 0)) if out_node.kind != "output" else None
        self.boundary_in = boundary_in

    # ------------------------------------------------------------------ helpers
    def info(self, tensor: tuple[str, int]) -> TensorInfo:
        return self.g.node(tensor[0]).outputs[tensor[1]]

    def root(self, tensor: tuple[str, int]) -> tuple[str, int]:
        info = self.info(tensor)
        return info.root if info is not None and info.root is not None else tensor

    def tensor_bytes(self, tensor: tuple[str, int]) -> tuple[float, bool]:
        """(bytes per micro-batch of the full tensor, whether it grows with the batch)."""
        info = self.info(tensor)
        scaled = bool(info.batch_dims)
        return info.nbytes * (self.settings.micro_batch if scaled else 1), scaled

    def comm(self, tensor: tuple[str, int], src: str, dst: str) -> float:
        nbytes, _ = self.tensor_bytes(tensor)
        return redistribute_time(self.cluster, self.groups, nbytes, src, dst)

    def produced(self, tensor: tuple[str, int]) -> dict[str, list[int]]:
        """Placement -> indices of the producer's strategies that leave the tensor in it."""
        name, j = tensor
        out: dict[str, list[int]] = {}
        for k, s in enumerate(self.choices[name]):
            p = s.outputs[j] if j < len(s.outputs) else None
            if p is not None:
                out.setdefault(p, []).append(k)
        return out

    def local_bytes(self, tensor: tuple[str, int], placement: str) -> float:
        info = self.info(tensor)
        per = info.nbytes * (self.settings.micro_batch if info.batch_dims else 1)
        return per / self.settings.degree if placement.startswith("S") else per

    # --------------------------------------------------------------------- model
    def build(self) -> None:
        s = self.settings
        t = s.degree
        m = cp_model.CpModel()
        self.model = m
        x: dict[tuple[str, int], cp_model.IntVar] = {}
        for name, strategies in self.choices.items():
            lits = [m.NewBoolVar(f"x[{name},{k}]") for k in range(len(strategies))]
            m.AddExactlyOne(lits)
            for k, lit in enumerate(lits):
                x[(name, k)] = lit
        self.x = x
        time_terms, mem_terms = [], []
        self.compute_terms = []
        for (name, k), (f, bwd) in self.time.items():
            c = int(round((f + bwd + sum(t for _, t in self.internal.get((name, k), ()))) * NS))
            if c:
                time_terms.append(c * x[(name, k)])
        # Boundary: the output requirement is a choice too (fixed per solve by assumption).
        out_choices = tensor_choices(self.info(self.out_tensor), t) if self.out_tensor else ["R"]
        if self.g.has_loss:
            out_choices = ["R"]
        self.out_req = {q: m.NewBoolVar(f"out[{q}]") for q in out_choices}
        m.AddExactlyOne(self.out_req.values())
        self.need, self.gneed, self.saved = {}, {}, {}
        tensors = set(self.readers) | ({self.out_tensor} if self.out_tensor else set())
        state = s.state_bytes(self.dtype)
        act_mult = s.inflight
        for tensor in sorted(tensors):
            producer, j = tensor
            prod_node = self.g.node(producer)
            made = self.produced(tensor)
            info = self.info(tensor)
            # What consumers need (forward) and what gradients they return (backward).
            req: dict[str, list] = {}
            greq: dict[str, list] = {}
            saves: dict[str, list] = {}
            for consumer, pos in self.readers.get(tensor, []):
                for k, st in enumerate(self.choices[consumer]):
                    q = st.inputs[pos]
                    if q is None:
                        continue
                    lit = x[(consumer, k)]
                    req.setdefault(q, []).append(lit)
                    if self.requires_grad.get(producer, False) and info.dtype.is_floating_point:
                        greq.setdefault(grad_placement(q, st.replicated), []).append(lit)
                    c = self.cost[(consumer, k)]
                    if pos < len(c.saved_inputs) and c.saved_inputs[pos] > 0 and prod_node.kind != "param":
                        saves.setdefault(q, []).append(lit)
            if tensor == self.out_tensor:
                for q, lit in self.out_req.items():
                    req.setdefault(q, []).append(lit)
                    if self.requires_grad.get(producer, False) and info.dtype.is_floating_point:
                        greq.setdefault(q, []).append(lit)
            if prod_node.kind == "op":
                for k, st in enumerate(self.choices[producer]):
                    c = self.cost[(producer, k)]
                    if j < len(c.saved_outputs) and c.saved_outputs[j] > 0 and st.outputs[j] is not None:
                        saves.setdefault(st.outputs[j], []).append(x[(producer, k)])
            zlit = self._placement_literals(producer, j, made)
            for q, lits in req.items():
                need = m.NewBoolVar(f"need[{producer},{j},{q}]")
                for lit in lits:
                    m.AddImplication(lit, need)
                self.need[(tensor, q)] = need
                for p in made:
                    cst = int(round(self.comm(tensor, p, q) * NS)) if p != q else 0
                    if cst:
                        pair = m.NewBoolVar(f"cf[{producer},{j},{p},{q}]")
                        m.AddBoolOr([zlit[p].Not(), need.Not(), pair])
                        time_terms.append(cst * pair)
            for g, lits in greq.items():
                gneed = m.NewBoolVar(f"grad[{producer},{j},{g}]")
                for lit in lits:
                    m.AddImplication(lit, gneed)
                self.gneed[(tensor, g)] = gneed
                # For a parameter this is the reduction of its gradient when a sharded
                # operator read it replicated (sequence-parallel norms, for example).
                for p in made:
                    cst = int(round(self.comm(tensor, g, backward_target(p)) * NS))
                    if cst:
                        pair = m.NewBoolVar(f"cb[{producer},{j},{p},{g}]")
                        m.AddBoolOr([zlit[p].Not(), gneed.Not(), pair])
                        time_terms.append(cst * pair)
            for q, lits in saves.items():
                # One storage per (base tensor, kind of placement): a view saved sharded
                # along another dimension than its base was produced in is the same shard.
                key = (self.root(tensor), q[0])
                sv = self.saved.get(key)
                if sv is None:
                    kib = int(math.ceil(self.local_bytes(key[0], q) * act_mult / KIB))
                    if not kib:
                        continue
                    sv = m.NewBoolVar(f"saved[{key[0][0]},{key[0][1]},{q[0]}]")
                    self.saved[key] = sv
                    mem_terms.append(kib * sv)
                for lit in lits:
                    m.AddImplication(lit, sv)
        for (name, k), c in self.cost.items():
            if c.saved_internal > 0:
                kib = int(math.ceil(c.saved_internal * s.micro_batch * act_mult / KIB))
                if kib:
                    mem_terms.append(kib * x[(name, k)])
        for n in self.g.nodes:
            if n.kind == "param" and n.tensor_out.dtype.is_floating_point:
                numel = n.tensor_out.nbytes / n.tensor_out.dtype.itemsize
                for k, st in enumerate(self.choices[n.name]):
                    f = t if st.outputs[0].startswith("S") else 1
                    kib = int(math.ceil(numel * state / f / KIB))
                    if kib:
                        mem_terms.append(kib * x[(n.name, k)])
        self.time_expr = sum(time_terms)
        self.mem_expr = sum(mem_terms)
        if s.memory_cap_bytes is not None:
            m.Add(self.mem_expr <= int(s.memory_cap_bytes / KIB))
        weight = s.memory_weight * KIB * NS   # ns per KiB
        if weight > 0:
            m.Minimize(self.time_expr + int(round(weight)) * self.mem_expr if weight >= 1
                       else self.time_expr * int(round(1 / weight)) + self.mem_expr)
        else:
            m.Minimize(self.time_expr)

    def _placement_literals(self, producer: str, j: int, made: dict[str, list[int]]) -> dict:
        """One literal per placement the tensor can be produced in, equal to 'the producer
        chose a strategy leaving it there' (a tighter model than sums in big-M rows)."""
        m, x = self.model, self.x
        out = {}
        for p, ks in made.items():
            lits = [x[(producer, k)] for k in ks]
            if len(lits) == 1:
                out[p] = lits[0]
                continue
            z = m.NewBoolVar(f"z[{producer},{j},{p}]")
            for lit in lits:
                m.AddImplication(lit, z)
            m.AddBoolOr([z.Not()] + lits)
            out[p] = z
        return out

    def boundary_choices(self) -> tuple[list[str], list[str]]:
        if not hasattr(self, "model"):
            self.build()
        pins = [s.outputs[0] for s in self.choices[self.boundary_in]]
        return pins, list(self.out_req)

    def solve(self, pin: str, pout: str) -> UnitSolution | None:
        if not hasattr(self, "model"):
            self.build()
        pin_k = [k for k, s in enumerate(self.choices[self.boundary_in]) if s.outputs[0] == pin]
        if not pin_k or pout not in self.out_req:
            return None
        # Fixing the boundary in a copy (rather than by assumptions) lets presolve use it.
        m = self.model.Clone()
        for lit in (self.x[(self.boundary_in, pin_k[0])], self.out_req[pout]):
            m.Add(m.GetBoolVarFromProtoIndex(lit.Index()) == 1)
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        solver.parameters.random_seed = 0
        # The model is a 0-1 program whose LP relaxation is nearly tight: a full
        # linearization proves optimality several times faster than the default.
        solver.parameters.linearization_level = 2
        solver.parameters.cp_model_probing_level = 0
        solver.parameters.max_time_in_seconds = self.settings.time_limit_s
        status = solver.Solve(m)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        chosen = {}
        for name, strategies in self.choices.items():
            for k in range(len(strategies)):
                if solver.Value(self.x[(name, k)]):
                    chosen[name] = strategies[k]
        return self._solution(solver, chosen, pin, pout, status == cp_model.OPTIMAL)

    def _solution(self, solver, chosen, pin, pout, optimal) -> UnitSolution:
        fwd = bwd = 0.0
        comm_f = comm_b = 0.0
        colls = []
        for name, st in chosen.items():
            k = self.choices[name].index(st)
            if (name, k) in self.time:
                f, b_ = self.time[(name, k)]
                fwd, bwd = fwd + f, bwd + b_
            for (phase, t_), (kind, nbytes, _) in zip(self.internal.get((name, k), ()), st.collectives):
                colls.append(Collective(name, st.inputs[0], st.outputs[0], kind, nbytes, True, phase))
                if phase == "forward":
                    comm_f += t_
                else:
                    comm_b += t_
        for (tensor, q), need in self.need.items():
            if not solver.Value(need):
                continue
            p = chosen[tensor[0]].outputs[tensor[1]]
            kind = redistribute_kind(p, q)
            if kind:
                nbytes, scaled = self.tensor_bytes(tensor)
                colls.append(Collective(tensor[0], p, q, kind, nbytes / (self.settings.micro_batch if scaled else 1),
                                        scaled, "forward"))
                comm_f += self.comm(tensor, p, q)
        for (tensor, g), gneed in self.gneed.items():
            if not solver.Value(gneed):
                continue
            p = backward_target(chosen[tensor[0]].outputs[tensor[1]])
            kind = redistribute_kind(g, p)
            if kind:
                nbytes, scaled = self.tensor_bytes(tensor)
                colls.append(Collective(tensor[0], g, p, kind, nbytes / (self.settings.micro_batch if scaled else 1),
                                        scaled, "backward"))
                comm_b += self.comm(tensor, g, p)
        state = self.settings.state_bytes(self.dtype)
        params = 0.0
        for n in self.g.nodes:
            if n.kind == "param" and n.tensor_out.dtype.is_floating_point:
                p = chosen[n.name].outputs[0]
                numel = n.tensor_out.nbytes / n.tensor_out.dtype.itemsize
                params += numel * state / (self.settings.degree if p.startswith("S") else 1)
        act = 0.0
        for (tensor, kind), sv in self.saved.items():
            if solver.Value(sv):
                act += self.local_bytes(tensor, kind) * self.settings.inflight
        for name, st in chosen.items():
            k = self.choices[name].index(st)
            c = self.cost.get((name, k))
            if c is not None:
                act += c.saved_internal * self.settings.micro_batch * self.settings.inflight
        return UnitSolution(graph=self.index, pin=pin, pout=pout, strategies=chosen,
                            time_s=fwd + bwd + comm_f + comm_b,
                            breakdown={"compute_forward": fwd, "compute_backward": bwd,
                                       "comm_forward": comm_f, "comm_backward": comm_b},
                            param_bytes=params, activation_bytes=act, collectives=colls, optimal=optimal)


# ----------------------------------------------------------------------------- chain
@dataclass
class ChainSolution:
    """Layouts of every unit of a model at one degree."""

    degree: int
    units: list[UnitSolution]
    """One solution per model unit (identical units share the object)."""
    time_s: float
    """Sum over units of seconds per micro-batch."""
    solve_s: float
    """Wall-clock seconds the search took (capture excluded)."""
    solves: int
    """CP-SAT solves run."""
    measured_ops: int = 0
    """(operator, strategy) timings that came from a measured operator profile."""
    tables: dict[int, dict[tuple[str, str], UnitSolution | None]] = field(default_factory=dict, repr=False)

    def layouts(self, model: ModelGraph) -> Layouts:
        groups: dict[int, list[int]] = {}
        keyed: dict[int, UnitSolution] = {}
        for i, u in enumerate(self.units):
            groups.setdefault(id(u), []).append(i)
            keyed[id(u)] = u
        out = []
        for key, idx in groups.items():
            u = keyed[key]
            g = model.graphs[u.graph]
            out.append(unit_layout(g, u, tuple(idx)))
        return Layouts(units=tuple(out), objective_s=self.time_s)


def unit_layout(graph: UnitGraph, sol: UnitSolution, units: tuple[int, ...], coshard: int = 1) -> UnitLayout:
    ops = []
    params = []
    for n in graph.nodes:
        st = sol.strategies.get(n.name)
        if n.kind == "param":
            params.append((n.param, st.outputs[0]))
        elif n.kind == "op":
            ops.append(OpLayout(node=n.name, op=n.op_name, inputs=st.inputs, outputs=st.outputs))
    return UnitLayout(units=units, signature=graph.signature, input=sol.pin, output=sol.pout,
                      params=tuple(params), ops=tuple(ops), coshard=coshard)


def solve_chain(model: ModelGraph, cluster: Cluster, groups: Sequence[Sequence[int]], settings: LayoutSettings,
                profiles: OperatorProfileSource | None = None, problems: dict | None = None) -> ChainSolution:
    """Layouts of every unit: one CP-SAT model per distinct unit, solved per boundary pair,
    then a dynamic program over the chain of units."""
    start = time.perf_counter()
    if settings.degree < 1:
        raise ConfigError("degree", f"must be >= 1, got {settings.degree}")
    problems = problems if problems is not None else {}
    tables: dict[int, dict[tuple[str, str], UnitSolution | None]] = {}
    solves = 0
    for gi, g in enumerate(model.graphs):
        prob = problems.get(gi)
        if prob is None:
            prob = UnitProblem(g, gi, cluster, groups, settings, model.dtype, profiles)
            problems[gi] = prob
        pins, pouts = prob.boundary_choices()
        table = {}
        for pin in pins:
            for pout in pouts:
                table[(pin, pout)] = prob.solve(pin, pout)
                solves += 1
        tables[gi] = table
    # Dynamic program over boundary placements along the chain.
    n = model.num_units
    first = tables[model.units[0]]
    best: dict[str, tuple[float, list]] = {}
    for (pin, pout), sol in first.items():
        if sol is not None and (pout not in best or sol.time_s < best[pout][0]):
            best[pout] = (sol.time_s, [sol])
    for i in range(1, n):
        table = tables[model.units[i]]
        nxt: dict[str, tuple[float, list]] = {}
        for (pin, pout), sol in table.items():
            if sol is None or pin not in best:
                continue
            total = best[pin][0] + sol.time_s
            if pout not in nxt or total < nxt[pout][0]:
                nxt[pout] = (total, best[pin][1] + [sol])
        best = nxt
        if not best:
            break
    if not best:
        raise ConfigError("memory_cap_bytes", f"no layout of every unit fits {settings.memory_cap_bytes:.3g} bytes "
                          f"per rank at degree {settings.degree}", "raise the cap or the degree")
    total, chain = min(best.values(), key=lambda v: v[0])
    return ChainSolution(degree=settings.degree, units=chain, time_s=total,
                         solve_s=time.perf_counter() - start, solves=solves, tables=tables,
                         measured_ops=sum(p.measured for p in problems.values()))
