"""Per-operator layouts: SuperScaler's model transformation and space-time scheduling as data.

A plan's tensor-parallel axis can be described operator by operator instead of by a
family's hand-written recipe. For every operator of a unit's captured graph (see
:mod:`autoplan.models.graph`) the layout says how each of its tensors lies on the
tensor-parallel ranks, in DTensor's vocabulary:

* ``"R"`` — Replicate: every rank holds the whole tensor (SuperScaler's *replicate*);
* ``"S<d>"`` — Shard(d): rank i holds the i-th slice along dimension d (*dimension split*);
* ``"P"`` — Partial(sum): every rank holds a full-size addend (*value split*).

Between a producer's output layout and a consumer's input layout the communication is
implied (DTensor ``redistribute`` semantics, :mod:`costmodel.redistribute`), so the data
dependencies never have to be written by hand.

Two scheduling choices ride on top:

* **co-shard** (``UnitLayout.coshard = k``): each rank runs its share of the unit as k
  sub-operators one after another (chunks of the micro-batch), each recomputed in the
  backward, so only one chunk's activations are live at a time;
* **interlaced** (``Layouts.interlaced``): the listed units (a large embedding or output
  head) are sharded over *every* rank of the pipeline and run by all of them, interlaced
  in time with the pipelined units, instead of sitting on the first or last stage.

This module is data only (no torch): it is part of :class:`autoplan.plan.Plan`'s JSON.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from autoplan.errors import ConfigError
from autoplan.fields import FieldReader, check_text
from autoplan.limits import MAX_MICRO_BATCH, MAX_OP_TENSORS, MAX_UNIT_OPS, MAX_UNIT_PARAMS, MAX_UNITS

_PLACEMENT = re.compile(r"^(R|P|S(0|[1-9][0-9]*))$")


def check_placement(value, where: str) -> str:
    """``value`` if it is a placement string ('R', 'P', 'S<dim>'), else a ConfigError."""
    if not isinstance(value, str) or not _PLACEMENT.match(value):
        raise ConfigError(where, f"{value!r} is not a placement",
                          "use 'R' (replicate), 'P' (partial sum) or 'S<dim>' (shard), e.g. 'S1'")
    return value


def shard_dim(placement: str) -> int | None:
    """The sharded dimension of 'S<d>', else None."""
    return int(placement[1:]) if placement.startswith("S") else None


def redistribute_kind(src: str, dst: str) -> str | None:
    """The collective DTensor's ``redistribute`` runs to turn ``src`` into ``dst`` (None: a
    local operation or nothing):

    ============  ==============  ==========================================
    src -> dst    collective      why
    ============  ==============  ==========================================
    R -> S, R->P  none            each rank keeps its slice / zeroes all but one
    S -> R        all-gather
    S(a) -> S(b)  all-to-all
    S -> P        all-gather      (then local, as R -> P)
    P -> R        all-reduce
    P -> S        reduce-scatter
    ============  ==============  ==========================================
    """
    if src == dst or src == "R":
        return None
    if src == "P":
        return "all_reduce" if dst == "R" else "reduce_scatter"
    if dst in ("R", "P"):
        return "all_gather"
    return "all_to_all"


def grad_placement(required: str, replicated_strategy: bool) -> str:
    """Placement of the gradient an operator returns for an input it read in ``required``.

    A sharded input gets a sharded gradient; a Partial input a replicated one; a replicated
    input read by an operator that splits its work (some other tensor sharded or partial)
    gets a Partial gradient (each rank's share of the sum), by an all-replicated one a
    replicated gradient."""
    if required.startswith("S"):
        return required
    if required == "P":
        return "R"
    return "R" if replicated_strategy else "P"


def backward_target(produced: str) -> str:
    """What a tensor produced in ``produced`` needs its gradient in: the backward of a
    redistribution runs the other way, and the gradient of a Partial tensor is Replicate."""
    return "R" if produced == "P" else produced


@dataclass(frozen=True)
class OpLayout:
    """The layout of one operator: what it requires of its inputs and what it produces."""

    node: str
    """Node name in the unit's captured graph (e.g. 'linear_3')."""
    op: str
    """The operator (e.g. 'aten.linear.default'); checked against the graph when run."""
    inputs: tuple[str | None, ...]
    """Placement each tensor argument is redistributed to before the operator runs, in the
    order of the operator's flattened tensor arguments (None: not a tensor that needs one)."""
    outputs: tuple[str | None, ...]
    """Placement of each tensor output (None for outputs that are not tensors)."""


@dataclass(frozen=True)
class UnitLayout:
    """Layouts of every operator of one distinct unit, shared by identical units."""

    units: tuple[int, ...]
    """Model units (indices into ModelSpec.layers) that run this layout."""
    signature: str
    """Digest of the unit's graph (operators, shapes) the layout was solved for."""
    input: str
    """Placement of the unit's input activation on the tensor-parallel ranks."""
    output: str
    """Placement of the unit's output activation."""
    params: tuple[tuple[str, str], ...]
    """(parameter name relative to the unit, placement) for every parameter."""
    ops: tuple[OpLayout, ...]
    """One entry per operator node of the graph, in graph order."""
    coshard: int = 1
    """Sub-operators per rank run one after another (1: no co-shard)."""

    def param_placements(self) -> dict[str, str]:
        return dict(self.params)

    def op(self, node: str) -> OpLayout | None:
        for o in self.ops:
            if o.node == node:
                return o
        return None


@dataclass(frozen=True)
class Layouts:
    """The per-operator layout section of a plan."""

    units: tuple[UnitLayout, ...]
    """Layouts of the distinct units; every unit index appears in at most one."""
    interlaced: tuple[int, ...] = ()
    """Units sharded over all ranks of the pipeline and interlaced with the pipelined units."""
    mesh_axis: str = "tp"
    """The device-mesh axis the placements refer to (the plan's tensor-parallel axis)."""
    objective_s: float = 0.0
    """The layout search's predicted seconds per micro-batch of the model (informational)."""
    source: str = "search"
    """Where the layouts came from: 'search' (the operator-level search) or 'manual'."""

    def for_unit(self, index: int) -> UnitLayout | None:
        for u in self.units:
            if index in u.units:
                return u
        return None

    def validate(self, num_units: int | None = None, where: str = "layouts") -> "Layouts":
        seen: set[int] = set()
        if self.mesh_axis != "tp":
            raise ConfigError(f"{where}.mesh_axis", f"{self.mesh_axis!r} is not supported",
                              "operator layouts refer to the tensor-parallel axis: use 'tp'")
        for i, u in enumerate(self.units):
            w = f"{where}.units[{i}]"
            if not u.units:
                raise ConfigError(f"{w}.units", "must list at least one unit index")
            for j in u.units:
                if not isinstance(j, int) or isinstance(j, bool) or j < 0:
                    raise ConfigError(f"{w}.units", f"{j!r} is not a unit index")
                if j in seen:
                    raise ConfigError(f"{w}.units", f"unit {j} has two layouts")
                if num_units is not None and j >= num_units:
                    raise ConfigError(f"{w}.units", f"unit {j} does not exist: the model has {num_units} units")
                seen.add(j)
            check_placement(u.input, f"{w}.input")
            check_placement(u.output, f"{w}.output")
            for name, p in u.params:
                check_placement(p, f"{w}.params.{name}")
            if not isinstance(u.coshard, int) or u.coshard < 1:
                raise ConfigError(f"{w}.coshard", f"must be a positive integer, got {u.coshard!r}")
            for k, o in enumerate(u.ops):
                for m, p in enumerate(o.inputs):
                    if p is not None:
                        check_placement(p, f"{w}.ops[{k}].inputs[{m}]")
                for m, p in enumerate(o.outputs):
                    if p is not None:
                        check_placement(p, f"{w}.ops[{k}].outputs[{m}]")
        for j in self.interlaced:
            if num_units is not None and not 0 <= j < num_units:
                raise ConfigError(f"{where}.interlaced", f"unit {j} does not exist")
        return self

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        return {
            "mesh_axis": self.mesh_axis, "source": self.source, "objective_s": self.objective_s,
            "interlaced": list(self.interlaced),
            "units": [{
                "units": list(u.units), "signature": u.signature, "input": u.input, "output": u.output,
                "coshard": u.coshard, "params": {k: v for k, v in u.params},
                "ops": [{"node": o.node, "op": o.op, "inputs": list(o.inputs), "outputs": list(o.outputs)}
                        for o in u.ops],
            } for u in self.units],
        }

    @classmethod
    def from_dict(cls, data, where: str = "layouts") -> "Layouts":
        # Every count is bounded (autoplan.limits) so a hostile plan.json is one ConfigError.
        r = FieldReader(data, where)
        r.reject_unknown(("mesh_axis", "source", "objective_s", "interlaced", "units"))
        units = []
        for u in r.items("units", nonempty=True, max_len=MAX_UNITS):
            u.reject_unknown(("units", "signature", "input", "output", "coshard", "params", "ops"))
            idx = u.ints("units", nonempty=True, minimum=0, maximum=MAX_UNITS - 1, max_len=MAX_UNITS)
            params = u.sub("params", {})
            if len(params.data) > MAX_UNIT_PARAMS:
                raise ConfigError(u.path("params"), f"has {len(params.data):,} entries, "
                                  f"at most {MAX_UNIT_PARAMS:,} allowed")
            ops = []
            for o in u.items("ops", default=[], max_len=MAX_UNIT_OPS):
                o.reject_unknown(("node", "op", "inputs", "outputs"))
                ops.append(OpLayout(node=o.str("node"), op=o.str("op"),
                                    inputs=tuple(_optional(o.list("inputs", [], max_len=MAX_OP_TENSORS),
                                                           o.path("inputs"))),
                                    outputs=tuple(_optional(o.list("outputs", [], max_len=MAX_OP_TENSORS),
                                                            o.path("outputs")))))
            units.append(UnitLayout(
                units=tuple(idx), signature=u.str("signature", ""),
                input=check_placement(u.raw("input"), u.path("input")),
                output=check_placement(u.raw("output"), u.path("output")),
                params=tuple((check_text(str(k), params.path("<name>")),
                              check_placement(v, f"{params.path(str(k)[:60])}"))
                             for k, v in params.data.items()),
                ops=tuple(ops), coshard=u.int("coshard", 1, minimum=1, maximum=MAX_MICRO_BATCH)))
        return cls(units=tuple(units),
                   interlaced=tuple(r.ints("interlaced", [], minimum=0, maximum=MAX_UNITS - 1, max_len=MAX_UNITS)),
                   mesh_axis=r.str("mesh_axis", "tp"),
                   objective_s=r.float("objective_s", 0.0, minimum=0.0, maximum=1e9),
                   source=r.str("source", "search", choices=("search", "manual"))).validate(where=where)

    def describe(self) -> str:
        parts = []
        for u in self.units:
            sharded = sum(1 for _, p in u.params if p != "R")
            span = f"{u.units[0]}" if len(u.units) == 1 else f"{u.units[0]}..{u.units[-1]}({len(u.units)})"
            cs = f" coshard={u.coshard}" if u.coshard > 1 else ""
            parts.append(f"units {span}: {sharded}/{len(u.params)} params sharded, in {u.input} out {u.output}{cs}")
        if self.interlaced:
            parts.append(f"interlaced units {list(self.interlaced)}")
        return "; ".join(parts)


def _optional(values: Iterable, where: str) -> list[str | None]:
    return [None if p is None else check_placement(p, f"{where}[{j}]") for j, p in enumerate(values)]


__all__ = ["OpLayout", "UnitLayout", "Layouts", "check_placement", "shard_dim", "redistribute_kind",
           "grad_placement", "backward_target"]
