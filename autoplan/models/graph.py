"""Operator graphs: any ``nn.Module`` captured on ``meta`` into the ATen operators it runs.

``capture_model(source)`` takes a zoo name / config or a user's ``nn.Module`` and returns a
:class:`ModelGraph`: the model's pipeline units (``module.layers``, the children of an
``nn.Sequential``, or the whole module as one unit), each *distinct* unit captured once as
a :class:`UnitGraph` (identical blocks share one graph, so a 100-layer transformer costs
three captures: embedding, block, head).

A unit is traced with ``make_fx(pre_dispatch=True)`` over ``torch.func.functional_call``,
so the graph's placeholders are the unit's parameters (by name) and its inputs, and its
operators are the ATen operators before dispatch to a kernel: ``aten.linear``,
``aten.layer_norm``, ``aten.scaled_dot_product_attention``, views... -- device independent,
and exactly what DTensor's sharding propagation sees when the same unit runs on DTensors.
Nothing is allocated: a 405B model is captured on a laptop.

Each node records its output shapes and which dimensions are *batch* dimensions (they
grow with the micro-batch: the unit is captured at micro-batch 1 and 2 and compared),
because the batch belongs to the data-parallel axis and is never a tensor-parallel choice.
What each operator costs is measured separately (:mod:`autoplan.models.opmeasure`).
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import operator
from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from autoplan.errors import ConfigError
from autoplan.models.extract import unit_kind as layer_kind

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class TensorInfo:
    """Shape of one tensor a node produces, at micro-batch 1."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    batch_dims: frozenset[int]
    """Dimensions whose size grows with the micro-batch."""
    root: tuple[str, int] | None = None
    """(node, output) whose storage this tensor views (None: it owns its storage)."""

    @property
    def nbytes(self) -> float:
        n = 1
        for s in self.shape:
            n *= s
        return float(n * torch.empty((), dtype=self.dtype).element_size())

    def shardable(self, dim: int, degree: int) -> bool:
        """Whether Shard(dim) over ``degree`` ranks is a tensor-parallel choice for this tensor."""
        return (0 <= dim < len(self.shape) and dim not in self.batch_dims
                and self.shape[dim] % degree == 0 and self.shape[dim] >= degree)


@dataclass
class OpNode:
    """One node of a unit graph."""

    name: str
    kind: str
    """'param', 'input', 'op' (an ATen operator), 'getitem' (picks one output of a
    multi-output operator) or 'output'."""
    target: object
    """The ATen OpOverload (kind 'op'), operator.getitem, or None."""
    args: tuple[tuple[str, int], ...]
    """Tensor arguments in the order of the operator's flattened positional arguments:
    (producing node, index of that node's output)."""
    outputs: tuple[TensorInfo | None, ...]
    """Tensors the node produces (None where an output is not a tensor)."""
    param: str = ""
    """Parameter name relative to the unit (kind 'param')."""

    @property
    def op_name(self) -> str:
        if self.kind == "op":
            return str(self.target)
        return self.kind

    @property
    def tensor_out(self) -> TensorInfo | None:
        return self.outputs[0] if self.outputs else None


@dataclass
class UnitGraph:
    """One distinct pipeline unit as an operator graph."""

    name: str
    """Unit kind and first index, e.g. 'block.1'."""
    kind: str
    """'embedding', 'block', 'head' or the unit's class name in lower case."""
    gm: torch.fx.GraphModule = field(repr=False)
    """The traced graph (placeholders: parameters in ``param_names`` order, then inputs)."""
    nodes: list[OpNode] = field(repr=False)
    """Every node in graph order."""
    param_names: tuple[str, ...]
    """Parameter names relative to the unit, in placeholder order."""
    input_nodes: tuple[str, ...]
    """Placeholder names of the unit's inputs (activation first; a loss target last)."""
    output_node: str
    """The node whose output 0 is the unit's output (activation or loss)."""
    has_loss: bool
    """The unit ends in the training loss (its output is a scalar)."""
    signature: str
    """Digest of operators and shapes: identical units have identical signatures."""
    micro_batch: int = 1
    """Micro-batch the graph was traced at (shapes in ``nodes`` are always per micro-batch 1)."""

    def node(self, name: str) -> OpNode:
        return self._by_name[name]

    def __post_init__(self):
        self._by_name = {n.name: n for n in self.nodes}

    @property
    def ops(self) -> list[OpNode]:
        return [n for n in self.nodes if n.kind in ("op", "getitem")]

    def consumers(self) -> dict[tuple[str, int], list[tuple[str, int]]]:
        """(producer, output index) -> [(consumer, argument position)]."""
        out: dict[tuple[str, int], list[tuple[str, int]]] = {}
        for n in self.nodes:
            for pos, src in enumerate(n.args):
                out.setdefault(src, []).append((n.name, pos))
        return out

    def input_info(self) -> TensorInfo:
        return self.node(self.input_nodes[0]).tensor_out

    def output_info(self) -> TensorInfo:
        src = self.node(self.output_node)
        return src.tensor_out


@dataclass
class ModelGraph:
    """A model as a chain of units, each distinct unit captured once."""

    name: str
    units: tuple[int, ...]
    """For every model unit in order, the index of its distinct graph in ``graphs``."""
    graphs: tuple[UnitGraph, ...]
    seq_len: int
    """Tokens (or patches) per sample."""
    dtype: str
    tokens_per_sample: int
    config: object | None = None
    """The zoo config the model came from, if any."""
    module: nn.Module | None = field(default=None, repr=False)
    """The user's module (on meta) when captured from an ``nn.Module``."""

    @property
    def num_units(self) -> int:
        return len(self.units)

    def graph_of(self, unit: int) -> UnitGraph:
        return self.graphs[self.units[unit]]

    def unit_indices(self, graph: int) -> tuple[int, ...]:
        return tuple(i for i, g in enumerate(self.units) if g == graph)


# --------------------------------------------------------------------------- tracing
def _meta_copy(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy on meta that never copies data (the user's module stays untouched)."""
    memo = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta", dtype=dtype if p.is_floating_point() else p.dtype),
                                   requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


def _trace(unit: nn.Module, inputs: tuple, loss) -> tuple[torch.fx.GraphModule, tuple[str, ...]]:
    params = dict(unit.named_parameters())
    buffers = dict(unit.named_buffers())
    names = tuple(params)

    def run(p, b, *xs):
        if loss is not None:
            out = torch.func.functional_call(unit, {**p, **b}, xs[:-1])
            return loss(out, xs[-1])
        return torch.func.functional_call(unit, {**p, **b}, xs)

    gm = make_fx(run, pre_dispatch=True)(params, buffers, *inputs)
    return gm, names


def _flat_outputs(val) -> tuple:
    if isinstance(val, torch.Tensor):
        return (val,)
    if isinstance(val, (tuple, list)):
        return tuple(v if isinstance(v, torch.Tensor) else None for v in val)
    return (None,)


def _nodes(gm: torch.fx.GraphModule, param_names: tuple[str, ...], n_buffers: int,
           gm2: torch.fx.GraphModule | None) -> tuple[list[OpNode], tuple[str, ...], str]:
    """OpNodes of a traced graph; ``gm2`` (the same unit at micro-batch 2) marks batch dims."""
    vals2 = {}
    if gm2 is not None:
        for a, b in zip(gm.graph.nodes, gm2.graph.nodes):
            if a.op != b.op or a.target != b.target:
                raise ConfigError("module", f"its graph changes with the batch size at node {a.name!r} "
                                  f"({a.target} vs {b.target})",
                                  "operator-level plans need a forward whose operators do not depend on the batch size")
            vals2[a.name] = b.meta.get("val")
    out: list[OpNode] = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    n_params = len(param_names)
    inputs = tuple(n.name for n in placeholders[n_params + n_buffers:])
    output_node = ""
    for i, n in enumerate(gm.graph.nodes):
        val = n.meta.get("val")
        flat = _flat_outputs(val)
        flat2 = _flat_outputs(vals2[n.name]) if n.name in vals2 else flat
        infos = []
        for t1, t2 in zip(flat, flat2):
            if t1 is None:
                infos.append(None)
                continue
            shape = tuple(int(s) for s in t1.shape)
            batch = frozenset(d for d, (a, b) in enumerate(zip(t1.shape, t2.shape)) if a != b) \
                if t2 is not None and len(t2.shape) == len(t1.shape) else frozenset()
            infos.append(TensorInfo(shape, t1.dtype, batch))
        if n.op == "placeholder":
            idx = placeholders.index(n)
            if idx < n_params:
                out.append(OpNode(n.name, "param", None, (), tuple(infos), param=param_names[idx]))
            elif idx < n_params + n_buffers:
                out.append(OpNode(n.name, "input", None, (), tuple(infos), param=""))
            else:
                out.append(OpNode(n.name, "input", None, (), tuple(infos)))
        elif n.op == "call_function":
            if n.target is operator.getitem:
                src, k = n.args
                args = ((src.name, int(k)),)
                out.append(OpNode(n.name, "getitem", operator.getitem, args, tuple(infos)))
            else:
                leaves = pytree.tree_leaves(n.args)
                args = tuple((a.name, 0) for a in leaves
                             if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor))
                out.append(OpNode(n.name, "op", n.target, args, tuple(infos)))
        elif n.op == "output":
            leaves = [a for a in pytree.tree_leaves(n.args) if isinstance(a, torch.fx.Node)]
            output_node = leaves[0].name if leaves else ""
            out.append(OpNode(n.name, "output", None, tuple((a.name, 0) for a in leaves[:1]), ()))
        else:
            raise ConfigError("module", f"graph node {n.name!r} of kind {n.op!r} is not supported")
    _mark_views(gm, out)
    return out, inputs, output_node


_MAYBE_COPY = ("reshape", "flatten")
"""View operators that copy when their input is not contiguous."""


def _mark_views(gm: torch.fx.GraphModule, nodes: list[OpNode]) -> None:
    """Record which outputs are views of another node's storage (by the operators' alias
    annotations, as traced: a reshape of a contiguous tensor is a view), so that a saved
    activation and its views are counted once, as autograd keeps one storage."""
    by_name = {n.name: n for n in nodes}
    fx = {n.name: n for n in gm.graph.nodes}

    def root(ref):
        node = by_name[ref[0]]
        info = node.outputs[ref[1]]
        return info.root if info is not None and info.root is not None else ref

    for n in nodes:
        if n.kind == "getitem":
            parent = by_name[n.args[0][0]]
            if parent.kind == "op" and getattr(parent.target, "is_view", False) and parent.args:
                n.outputs = tuple(None if t is None else dataclasses.replace(t, root=root(parent.args[0]))
                                  for t in n.outputs)
            continue
        if n.kind != "op" or not getattr(n.target, "is_view", False) or not n.args:
            continue
        if n.target.overloadpacket.__name__ in _MAYBE_COPY:
            src = fx[n.name].args[0]
            val = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
            if not isinstance(val, torch.Tensor) or not val.is_contiguous():
                continue
        r = root(n.args[0])
        n.outputs = tuple(None if t is None else dataclasses.replace(t, root=r) for t in n.outputs)


def _signature(nodes: list[OpNode]) -> str:
    """Digest of a graph's structure: operators, how they are wired, parameter names and
    tensor ranks -- not sizes or float precision, so a layout searched for a large instance of a module runs
    on a small one of the same code (where the sizes still divide)."""
    h = hashlib.sha1()
    for n in nodes:
        h.update(f"{n.kind}|{n.op_name}|{n.param}|{n.args}|".encode())
        for t in n.outputs:
            h.update(repr(None if t is None else (len(t.shape), t.dtype.is_floating_point)).encode())
    return h.hexdigest()[:16]


def _batched(x: torch.Tensor, b: int) -> torch.Tensor:
    return x.expand(b, *x.shape[1:]).clone() if x.dim() else x


def capture_unit(unit: nn.Module, inputs: tuple[torch.Tensor, ...], name: str, kind: str,
                 loss=None, micro_batch: int = 1) -> UnitGraph:
    """Trace ``unit`` (already on meta) at micro-batch ``micro_batch`` (and 2 x it, to find
    batch dimensions). ``inputs`` are per-sample meta tensors (batch 1); with ``loss`` the
    last input is the target and the unit's output is ``loss(unit(x), target)``."""
    base = tuple(_batched(x, micro_batch) for x in inputs)
    twice = tuple(_batched(x, 2 * micro_batch) for x in inputs)
    gm, names = _trace(unit, base, loss)
    gm2, _ = _trace(unit, twice, loss)
    n_buffers = len(dict(unit.named_buffers()))
    nodes, inputs_, out = _nodes(gm, names, n_buffers, gm2)
    if micro_batch != 1:
        # Shapes are kept per micro-batch 1: divide batch dimensions back.
        for n in nodes:
            n.outputs = tuple(None if t is None else dataclasses.replace(
                t, shape=tuple(s // micro_batch if d in t.batch_dims else s for d, s in enumerate(t.shape)))
                for t in n.outputs)
    return UnitGraph(name=name, kind=kind, gm=gm, nodes=nodes, param_names=names, input_nodes=inputs_,
                     output_node=out, has_loss=loss is not None, signature=_signature(nodes),
                     micro_batch=micro_batch)


def unit_kind(unit: nn.Module) -> str:
    """The unit's kind as the layer-level spec names it, but a unit that is neither an
    embedding, a head, nor named a block/layer keeps its class name (operator graphs label
    their units with it)."""
    name = type(unit).__name__.lower()
    if "block" not in name and "layer" not in name and layer_kind(unit) == "block":
        return name
    return layer_kind(unit)


def _unit_signature(unit: nn.Module, x: torch.Tensor) -> tuple:
    return (type(unit).__name__, tuple(x.shape), x.dtype,
            tuple((n, tuple(p.shape)) for n, p in unit.named_parameters()),
            tuple((name, k, repr(v)) for name, m in unit.named_modules() for k, v in sorted(vars(m).items())
                  if not k.startswith("_") and isinstance(v, (int, float, bool, str, tuple))))


def units_of(module: nn.Module) -> list[nn.Module]:
    """The pipeline units of a module: ``module.layers`` (a ModuleList chained one tensor
    to the next), the children of an ``nn.Sequential``, else the module itself."""
    if isinstance(getattr(module, "layers", None), nn.ModuleList):
        return list(module.layers)
    if isinstance(module, nn.Sequential):
        return list(module)
    return [module]


def capture_units(units: list[nn.Module], example: torch.Tensor, target: torch.Tensor | None, loss,
                  name: str, dtype: str, micro_batch: int = 1) -> tuple[tuple[int, ...], tuple[UnitGraph, ...]]:
    """Capture a chain of meta units; identical units (same class, shapes, attributes and
    input shape) share one graph. ``example`` is one sample (batch 1) on meta."""
    graphs: list[UnitGraph] = []
    by_sig: dict[tuple, int] = {}
    order: list[int] = []
    x = example
    for i, unit in enumerate(units):
        last = i == len(units) - 1
        with_loss = loss is not None and last
        sig = _unit_signature(unit, x)
        if sig in by_sig and not with_loss:
            order.append(by_sig[sig])
        else:
            inputs = (x, target) if with_loss else (x,)
            g = capture_unit(unit, inputs, f"{unit_kind(unit)}.{i}", unit_kind(unit),
                             loss=loss if with_loss else None, micro_batch=micro_batch)
            by_sig[sig] = len(graphs)
            order.append(len(graphs))
            graphs.append(g)
        if not last:
            with torch.no_grad():
                x = unit(x)
    return tuple(order), tuple(graphs)


def capture_model(source, example_inputs: torch.Tensor | None = None, target: torch.Tensor | None = None,
                  loss=None, dtype: str = "bf16", name: str | None = None, micro_batch: int = 2) -> ModelGraph:
    """The operator graph of a zoo model (preset name or config) or of any ``nn.Module``.

    For a module, ``example_inputs`` is a batch of inputs (only its shapes and dtype are
    used; the first sample is taken), and ``loss(output, target)`` with a ``target`` batch
    puts the training loss into the last unit (without it the unit's output is summed)."""
    if dtype not in DTYPES:
        raise ConfigError("dtype", f"{dtype!r} is not one of {list(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    if isinstance(source, nn.Module):
        if example_inputs is None:
            raise ConfigError("example_inputs", "is required to capture an nn.Module",
                              "pass example_inputs=a batch of inputs (e.g. torch.randint(0, vocab, (1, seq)))")
        module = _meta_copy(source, torch_dtype)
        x = example_inputs[:1].to("meta")
        if x.is_floating_point():
            x = x.to(torch_dtype)
        t = target[:1].to("meta") if target is not None else None
        if loss is not None and t is None:
            raise ConfigError("target", "is required with loss", "pass target=a batch of targets")
        order, graphs = capture_units(units_of(module), x, t, loss, name or type(source).__name__, dtype,
                                      micro_batch)
        seq = int(example_inputs.shape[1]) if example_inputs.dim() > 1 else 1
        return ModelGraph(name=name or type(source).__name__, units=order, graphs=graphs, seq_len=seq,
                          dtype=dtype, tokens_per_sample=seq, module=module)
    return _capture_config(source, dtype, micro_batch)


def _capture_config(source, dtype: str, micro_batch: int) -> ModelGraph:
    import os
    from autoplan.models.presets import get_config
    if isinstance(source, (str, os.PathLike)):
        text = str(source)
        if text.endswith(".json") or os.sep in text:
            from autoplan.models.hf import config_from_hf
            cfg = config_from_hf(text).resolved()
        else:
            cfg = get_config(text)
    elif hasattr(source, "resolved"):
        cfg = source.resolved()
    else:
        raise ConfigError("model", f"cannot capture {type(source).__name__}",
                          "give a zoo name, a config.json path, a zoo config or an nn.Module")
    return _capture_config_cached(cfg, dtype, micro_batch)


@lru_cache(maxsize=16)
def _capture_config_cached(cfg, dtype: str, micro_batch: int) -> ModelGraph:
    from autoplan.models import config as C
    from autoplan.models.extract import _prepare
    from autoplan.models.zoo import build_model, example_inputs, measured_loss_fn

    if not isinstance(cfg, (C.TransformerConfig, C.SwinConfig)):
        raise ConfigError("model", f"cannot capture {type(cfg).__name__}",
                          "give a zoo name, a zoo config or an nn.Module")
    torch_dtype = DTYPES[dtype]
    flash = getattr(cfg, "attention", "math") == "flash"
    causal = bool(getattr(cfg, "causal", False))
    # A uniform stack repeats one block: capture a one-block model and replicate its graph.
    uniform = isinstance(cfg, C.TransformerConfig)
    probe = dataclasses.replace(cfg, layers=1) if uniform else cfg
    with torch.device("meta"):
        model = _prepare(build_model(probe), torch_dtype, flash, causal, cfg)
        inputs, targets = example_inputs(probe, 1, device="meta")
    if inputs.is_floating_point():
        inputs = inputs.to(torch_dtype)
    order, graphs = capture_units(list(model.layers), inputs, targets, measured_loss_fn(cfg), cfg.name, dtype,
                                  micro_batch)
    if uniform:
        emb, block, head = order
        order = (emb,) + (block,) * cfg.layers + (head,)
    return ModelGraph(name=cfg.name, units=tuple(order), graphs=graphs, seq_len=cfg.seq_len, dtype=dtype,
                      tokens_per_sample=cfg.seq_len, config=cfg)
