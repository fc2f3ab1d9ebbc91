"""Run an operator-level plan: every operator of a unit's graph as its layout says, on DTensors.

:class:`LayoutUnit` holds one pipeline unit of the user's module with its parameters
distributed (``distribute_tensor``) at the placements of its :class:`~autoplan.layouts.UnitLayout`,
and runs the unit's captured graph (:mod:`autoplan.models.graph`) node by node:

1. each tensor argument is redistributed to the placement the operator's strategy needs
   (DTensor ``redistribute``; one redistribution per (tensor, placement), shared by every
   reader, as the cost model counts it). DTensor keeps Replicate -> Partial for internal
   use, so that one (a bias added on one rank) is built here with the same semantics;
2. the operator runs on the local shards (``local_map`` semantics: the strategy came from
   DTensor's own rules, so the local result *is* the shard of the global result), with each
   input's gradient placement declared by the same rule the cost model uses
   (:func:`autoplan.layouts.grad_placement`); operators whose arguments carry global sizes
   (views, reshapes, expands) go through DTensor's dispatch instead, which rewrites them;
3. outputs become DTensors at the strategy's output placements.

So the communication that runs is exactly the data dependencies the plan implies
(``tests/test_operator_runtime.py`` counts them with ``CommDebugMode``), and autograd
through DTensor gives the backward. A co-sharded unit runs its micro-batch as k chunks, each
under activation checkpointing. :class:`OperatorParallel` chains the units of a module
(``module.layers``, an ``nn.Sequential``, or the whole module), keeps activations as
DTensors between them, and reduces gradients over a data-parallel group when there is one.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from autoplan.errors import ConfigError
from autoplan.layouts import Layouts, UnitLayout, grad_placement
from autoplan.models.graph import UnitGraph, capture_unit, unit_kind, units_of
from autoplan.models.opview import unit_strategies
from autoplan.models.strategies import Strategy

_GLOBAL_SHAPE_OPS = None


def _global_shape_ops() -> frozenset:
    """Operators whose arguments carry global sizes: run through DTensor's dispatch."""
    global _GLOBAL_SHAPE_OPS
    if _GLOBAL_SHAPE_OPS is None:
        prop = DTensor._op_dispatcher.sharding_propagator
        _GLOBAL_SHAPE_OPS = frozenset(prop.op_to_shape_and_stride_idx)
    return _GLOBAL_SHAPE_OPS


def placement(p: str):
    if p == "R":
        return Replicate()
    if p == "P":
        return Partial()
    return Shard(int(p[1:]))


def _name(pl) -> str:
    if isinstance(pl, Replicate):
        return "R"
    if isinstance(pl, Shard):
        return f"S{pl.dim}"
    return "P"


class _Redistributor:
    """Redistributes tensors to planned placements, once per (node, placement)."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh
        self.cache: dict = {}
        self.first = mesh.get_local_rank() == 0

    def __call__(self, key: str, x, q: str | None):
        if q is None or not isinstance(x, torch.Tensor):
            return x
        if not isinstance(x, DTensor):
            # A constant built inside the graph (positions, masks): the same on every rank.
            x = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        cur = _name(x.placements[0])
        if cur == q:
            return x
        hit = self.cache.get((key, q))
        if hit is not None:
            return hit
        if q == "P":
            base = x if cur == "R" else x.redistribute(self.mesh, [Replicate()])
            local = base.to_local(grad_placements=[Partial()])
            if not self.first:
                local = local * 0   # the sum over ranks is the tensor; its gradient stays correct
            out = DTensor.from_local(local, self.mesh, [Partial()], run_check=False)
        else:
            out = x.redistribute(self.mesh, [placement(q)])
        self.cache[(key, q)] = out
        return out


class LayoutUnit(nn.Module):
    """One unit of a module run with its operator layout on a 1-D tensor-parallel mesh."""

    def __init__(self, unit: nn.Module, layout: UnitLayout | None, mesh: DeviceMesh, example: torch.Tensor,
                 target: torch.Tensor | None = None, loss=None, name: str = "unit", micro_batch: int = 1):
        super().__init__()
        self.mesh = mesh
        self.layout = layout
        self.unit = unit
        self.loss = loss
        self.coshard = layout.coshard if layout is not None else 1
        if micro_batch % self.coshard:
            raise ConfigError("micro_batch", f"{micro_batch} is not divisible by the co-shard factor {self.coshard}")
        chunk = micro_batch // self.coshard
        meta = _meta_unit(unit)
        x = example[:1].to("meta")
        inputs = (x, target[:1].to("meta")) if loss is not None else (x,)
        self.graph: UnitGraph = capture_unit(meta, inputs, name, unit_kind(unit), loss=loss, micro_batch=chunk)
        if layout is not None and layout.signature and layout.signature != self.graph.signature:
            raise ConfigError("layouts", f"unit {name}: the module's graph ({self.graph.signature}) is not the one the "
                              f"layout was made for ({layout.signature})", "search the layouts again for this module")
        self.strategies: dict[str, Strategy] = unit_strategies(self.graph, layout)
        # Distribute the parameters in place: names stay the module's own.
        params = layout.param_placements() if layout is not None else {}
        for fqn, p in list(unit.named_parameters()):
            owner, _, leaf = fqn.rpartition(".")
            mod = unit.get_submodule(owner) if owner else unit
            pl = placement(params.get(fqn, "R"))
            dt = distribute_tensor(p.detach(), mesh, [pl])
            setattr(mod, leaf, nn.Parameter(dt, requires_grad=p.requires_grad))
        self.pin = layout.input if layout is not None else "R"
        self.pout = layout.output if layout is not None else "R"

    # ------------------------------------------------------------------ running
    def forward(self, x, target=None):
        if self.coshard == 1:
            return self._run(x, target)
        xs = _chunks(x, self.coshard)
        ts = _chunks(target, self.coshard) if target is not None else [None] * self.coshard
        outs = [checkpoint(self._run, xi, ti, use_reentrant=False) for xi, ti in zip(xs, ts)]
        if self.graph.has_loss:
            return sum(outs[1:], outs[0]) / self.coshard
        return _cat(outs)

    def _run(self, x, target=None):
        g, mesh = self.graph, self.mesh
        env: dict[str, object] = {}
        params = dict(self.unit.named_parameters())
        buffers = dict(self.unit.named_buffers())
        redis = _Redistributor(mesh)
        inputs = [x] + ([target] if target is not None else [])
        placeholders = [n for n in g.gm.graph.nodes if n.op == "placeholder"]
        n_params = len(g.param_names)
        buffer_values = list(buffers.values())
        for i, n in enumerate(placeholders):
            if i < n_params:
                env[n.name] = params[g.param_names[i]]
            elif i < n_params + len(buffer_values):
                env[n.name] = buffer_values[i - n_params]
            else:
                v = inputs[i - n_params - len(buffer_values)]
                if i - n_params - len(buffer_values) == 0:
                    if not isinstance(v, DTensor):
                        v = DTensor.from_local(v, mesh, [Replicate()], run_check=False)
                    v = redis(n.name, v, self.pin)
                env[n.name] = v
        rank0 = mesh.get_local_rank() == 0
        for n in g.gm.graph.nodes:
            if n.op != "call_function":
                continue
            node = g.node(n.name)
            if node.kind == "getitem":
                src, k = n.args
                env[n.name] = env[src.name][k]
                continue
            st = self.strategies[n.name]
            env[n.name] = self._call(n, st, env, redis, rank0)
        out_node = [n for n in g.gm.graph.nodes if n.op == "output"][0]
        out = pytree.tree_leaves(out_node.args)[0]
        result = env[out.name]
        if isinstance(result, DTensor):
            result = redis(out.name, result, self.pout)
        return result

    def _call(self, n: torch.fx.Node, st: Strategy, env: dict, redis: _Redistributor, rank0: bool):
        mesh = self.mesh
        tensor_pos = [0]

        def fetch(a):
            if not isinstance(a, torch.fx.Node):
                return a
            v = env[a.name]
            if isinstance(a.meta.get("val"), torch.Tensor):
                i = tensor_pos[0]
                tensor_pos[0] += 1
                q = st.inputs[i] if i < len(st.inputs) else None
                return redis(a.name, v, q)
            return v
        args = pytree.tree_map(fetch, list(n.args))
        kwargs = {k: (torch.device("cpu") if k == "device" else v) for k, v in n.kwargs.items()}
        kwargs = {k: (env[v.name] if isinstance(v, torch.fx.Node) else v) for k, v in kwargs.items()}
        if "device" in n.kwargs:
            kwargs["device"] = _device(mesh)
        has_dtensor = any(isinstance(a, DTensor) for a in pytree.tree_leaves(args))
        if not has_dtensor:
            return n.target(*args, **kwargs)
        if n.target in _global_shape_ops():
            return n.target(*args, **kwargs)
        if st.collectives:
            # The vocabulary-parallel loss: DTensor's loss_parallel runs it (and its backward,
            # see OperatorParallel.backward).
            from torch.distributed.tensor.parallel import loss_parallel
            with loss_parallel():
                return n.target(*args, **kwargs)
        # Local execution of the planned strategy, gradient placements declared per input.
        replicated = st.replicated
        k = [0]

        def local(a):
            if isinstance(a, DTensor):
                q = st.inputs[k[0]] if k[0] < len(st.inputs) else _name(a.placements[0])
                k[0] += 1
                if not a.requires_grad:
                    return a.to_local()
                return a.to_local(grad_placements=[placement(grad_placement(q, replicated))])
            if isinstance(a, torch.Tensor):
                k[0] += 1
            return a
        largs = pytree.tree_map(local, args)
        out = n.target(*largs, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        wrapped = []
        for j, o in enumerate(outs):
            p = st.outputs[j] if j < len(st.outputs) else None
            if isinstance(o, torch.Tensor) and p is not None:
                wrapped.append(DTensor.from_local(o, mesh, [placement(p)], run_check=False))
            else:
                wrapped.append(o)
        if isinstance(out, (tuple, list)):
            return type(out)(wrapped)
        return wrapped[0]


def _device(mesh: DeviceMesh) -> torch.device:
    return torch.device(mesh.device_type)


def _chunks(x, k: int):
    if isinstance(x, DTensor):
        return [DTensor.from_local(c, x.device_mesh, x.placements, run_check=False)
                for c in x.to_local().chunk(k, dim=0)]
    return list(x.chunk(k, dim=0))


def _cat(outs):
    if isinstance(outs[0], DTensor):
        local = torch.cat([o.to_local() for o in outs], dim=0)
        return DTensor.from_local(local, outs[0].device_mesh, outs[0].placements, run_check=False)
    return torch.cat(outs, dim=0)


def _meta_unit(unit: nn.Module) -> nn.Module:
    from autoplan.models.graph import _meta_copy
    dtype = next((p.dtype for p in unit.parameters() if p.is_floating_point()), torch.float32)
    return _meta_copy(unit, dtype)


class OperatorParallel(nn.Module):
    """A module's units run with a plan's operator layouts on a (dp, tp) mesh.

    ``forward(x, target)`` takes this data-parallel replica's micro-batch (full-size tensors)
    and returns the loss (when the module was wrapped with ``loss``) or the output, as a
    plain tensor on every rank. After ``backward``, call :meth:`finish_gradients` once per
    step: it reduces the gradients the layouts leave partial and averages over ``dp``."""

    def __init__(self, module: nn.Module, layouts: Layouts | None, mesh: DeviceMesh, example_inputs: torch.Tensor,
                 target: torch.Tensor | None = None, loss=None, micro_batch: int = 1, dp_group=None):
        super().__init__()
        tp_mesh = mesh["tp"] if mesh.mesh_dim_names and "tp" in mesh.mesh_dim_names else mesh
        self.tp_mesh = tp_mesh
        self.dp_group = dp_group
        units = units_of(module)
        # Each unit's example input: the chain run on a meta copy (shapes only).
        from autoplan.models.graph import _meta_copy
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
        meta_units = units_of(_meta_copy(module, dtype))
        examples = [example_inputs[:1].to("meta")]
        with torch.no_grad():
            for mu in meta_units[:-1]:
                examples.append(mu(examples[-1]))
        self.units = nn.ModuleList()
        for i, unit in enumerate(units):
            last = i == len(units) - 1
            layout = layouts.for_unit(i) if layouts is not None else None
            lu = LayoutUnit(unit, layout, tp_mesh, examples[i], target if (last and loss is not None) else None,
                            loss if last else None, name=f"{unit_kind(unit)}.{i}", micro_batch=micro_batch)
            self.units.append(lu)
        self.has_loss = loss is not None

    def forward(self, x, target=None):
        n = len(self.units)
        for i, u in enumerate(self.units):
            x = u(x, target) if (i == n - 1 and self.has_loss) else u(x)
        if isinstance(x, DTensor):
            x = x.redistribute(self.tp_mesh, [Replicate()]).to_local()
        return x

    @property
    def loss_parallel(self) -> bool:
        """Whether a unit computes the loss over vocabulary-sharded logits; then the backward
        must run under DTensor's ``loss_parallel`` (use :meth:`backward`)."""
        return any(st.collectives for u in self.units for st in u.strategies.values())

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, under ``loss_parallel`` when the plan's loss needs it."""
        if self.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel
            with loss_parallel():
                loss.backward()
        else:
            loss.backward()

    def finish_gradients(self) -> None:
        """Reduce each parameter's gradient to its parameter's placement (a replicated weight
        read by sharded operators has a Partial gradient), then average over data parallel."""
        for p in self.parameters():
            if p.grad is None:
                continue
            g = p.grad
            if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
                g = g.redistribute(p.device_mesh, p.placements)
            if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
                local = g.to_local() if isinstance(g, DTensor) else g
                dist.all_reduce(local, group=self.dp_group)
                local.div_(dist.get_world_size(self.dp_group))
                if isinstance(g, DTensor):
                    g = DTensor.from_local(local, g.device_mesh, g.placements, run_check=False)
                else:
                    g = local
            p.grad = g

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient gathered in full, keyed by the module's own names."""
        out = {}
        for i, u in enumerate(self.units):
            for name, p in u.unit.named_parameters():
                if p.grad is None:
                    continue
                g = p.grad
                out[f"{i}.{name}"] = g.full_tensor() if isinstance(g, DTensor) else g
        return out


def build_mesh(dp: int, tp: int) -> DeviceMesh:
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


__all__ = ["LayoutUnit", "OperatorParallel", "build_mesh", "placement"]
