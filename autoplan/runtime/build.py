"""Build this rank's part of a zoo model and parallelize it as the plan says.

Order of application, per unit (a pipeline unit of ``model.layers``), all on the
``meta`` device, so no rank ever allocates more than its own shard:

1. take the units this rank holds from a model built on ``meta``;
2. tensor / sequence parallelism with DTensor ``parallelize_module`` from the unit's
   ``tp_plan()``;
3. activation checkpointing as planned (``selective``: the attention core; ``full``:
   the whole unit);
4. data parallelism / ZeRO with FSDP2 ``fully_shard`` or the FSDP-family ``replicate``,
   per unit and then per pipeline stage (the stage is the FSDP root);
5. ``to_empty`` on the device, then :func:`init_local_shards` fills each parameter's
   local shard with exactly the values that shard has in the whole model: the global
   tensor is cut into tiles, each drawn from its own seed, so a shard draws only the
   tiles it overlaps. Every plan, and the single-process reference, therefore starts
   from the same weights while a rank's host memory scales with its shard;
6. plain DDP (``DistributedDataParallel``) where it is the ZeRO-0 choice, after the
   weights exist (it broadcasts them at construction).

Parameter names are the full model's (``layers.<unit>.<...>``) on every rank and under
every plan, which is what lets a checkpoint saved under one plan load under another.
"""
from __future__ import annotations

import contextlib
import hashlib
from typing import Iterable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               PrepareModuleInputOutput, PrepareModuleOutput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)
from torch.utils.checkpoint import checkpoint

from autoplan.data_parallel import DataParallelChoice
from autoplan.errors import ConfigError
from autoplan.models.config import SwinConfig, TransformerConfig
from autoplan.models.zoo import build_model, init_rule
from autoplan.models.zoo.transformer import Block, Head, TokenEmbedding

INIT_TILE = 1024
"""Side of the square tiles (rows x columns of a weight; 1-D tensors use INIT_TILE^2
elements) that are drawn from independent seeds: a shard draws only the tiles it
overlaps, at most one tile's memory at a time."""

SEQUENCE_PARALLEL_UNITS = (TokenEmbedding, Block, Head)
"""Unit types whose sequence-parallel layout the runtime knows (see apply_tensor_parallel)."""


def meta_model(cfg: TransformerConfig | SwinConfig) -> nn.Module:
    """The whole model on ``meta``: shapes only, no memory."""
    with torch.device("meta"):
        return build_model(cfg)


def tied_embedding_fqns(cfg, num_units: int) -> tuple[str, str] | None:
    """(embedding weight, output weight) names when the model ties them, else None."""
    if isinstance(cfg, TransformerConfig) and cfg.tie_embeddings:
        return ("layers.0.tok_embeddings.weight", f"layers.{num_units - 1}.output.weight")
    return None


def meta_units(cfg, unit_ids: Iterable[int]) -> dict[int, nn.Module]:
    """The units ``unit_ids`` of ``cfg``'s model, on ``meta``, with tied embeddings untied:
    the head holds its own copy of the table (initialised to the same values by
    :func:`init_local_shards`), and the trainer keeps the two copies equal by summing
    their gradients (as Megatron-LM does between the first and last pipeline stage)."""
    full = meta_model(cfg)
    n = len(full.layers)
    units = {i: full.layers[i] for i in sorted(set(unit_ids))}
    if tied_embedding_fqns(cfg, n) and n - 1 in units:
        head = units[n - 1]
        head.output.weight = nn.Parameter(torch.empty_like(head.output.weight, device="meta"))
    for unit in units.values():
        if any(True for _ in unit.buffers()):
            raise ConfigError("model", f"{type(unit).__name__} has buffers, which the runtime does not initialise")
    return units


def _tile_seed(seed: int, key: str, ti: int, tj: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{key}/{ti}/{tj}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def fill_shard(local: torch.Tensor, global_shape: tuple[int, ...], offset: tuple[int, ...],
               rule: tuple[str, float], seed: int, key: str) -> None:
    """Fill ``local``, the block of a parameter of ``global_shape`` starting at ``offset``,
    with that block's values under ``rule`` (see zoo.init_rule). Random values come from
    tiles of the global tensor, each seeded by (seed, key, tile), so they do not depend on
    how the tensor is sharded."""
    kind, std = rule
    with torch.no_grad():
        if kind == "normal_per_matrix":
            # A stack of matrices (experts on dim 0): each matrix its own 2-D tensor, keyed
            # by its global index, so a rank's experts and tensor-parallel slices of them
            # (dims 1 or 2) get the values they have in the whole stack.
            for e in range(local.shape[0]):
                fill_shard(local[e], tuple(global_shape[1:]), tuple(offset[1:]), ("normal", std), seed,
                           f"{key}/{offset[0] + e}")
            return
        if kind == "zeros":
            local.zero_()
            return
        if kind == "ones":
            local.fill_(1.0)
            return
        if local.numel() == 0:
            return
        two_d = len(global_shape) >= 2
        shape = tuple(global_shape) if two_d else (global_shape[0], 1)
        loc = local if two_d else local.unsqueeze(1)
        off = tuple(offset) if two_d else (offset[0], 0)
        if tuple(loc.shape[2:]) != shape[2:] or any(off[2:]):
            raise ValueError(f"{key}: only the first two dimensions may be sharded")
        rt, ct = (INIT_TILE, INIT_TILE) if two_d else (INIT_TILE * INIT_TILE, 1)
        r0, c0 = off[0], off[1]
        r1, c1 = r0 + loc.shape[0], c0 + loc.shape[1]
        for ti in range(r0 // rt, (r1 - 1) // rt + 1):
            tr0, tr1 = ti * rt, min((ti + 1) * rt, shape[0])
            for tj in range(c0 // ct, (c1 - 1) // ct + 1):
                tc0, tc1 = tj * ct, min((tj + 1) * ct, shape[1])
                g = torch.Generator().manual_seed(_tile_seed(seed, key, ti, tj))
                tile = torch.empty((tr1 - tr0, tc1 - tc0, *shape[2:])).normal_(0.0, std, generator=g)
                a0, a1, b0, b1 = max(r0, tr0), min(r1, tr1), max(c0, tc0), min(c1, tc1)
                loc[a0 - r0:a1 - r0, b0 - c0:b1 - c0].copy_(tile[a0 - tr0:a1 - tr0, b0 - tc0:b1 - tc0])


def init_local_shards(units: dict[int, nn.Module], cfg, num_units: int, seed: int) -> None:
    """Give every parameter of ``units`` (index -> materialised unit, possibly holding
    DTensor shards) the values its part has in the whole model of run ``seed``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    tied = tied_embedding_fqns(cfg, num_units)
    for i, unit in units.items():
        for name, p in unit.named_parameters():
            fqn = f"layers.{i}.{name}"
            owner, _, leaf = name.rpartition(".")
            rule = init_rule(unit.get_submodule(owner) if owner else unit, leaf)
            # The head's untied copy of a tied table starts equal to the table.
            key = tied[0] if tied and fqn == tied[1] else fqn
            if isinstance(p, DTensor):
                local = p.to_local()
                shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                if tuple(shape) != tuple(local.shape):
                    raise RuntimeError(f"{fqn}: local shard {tuple(local.shape)} is not the expected {shape}")
            else:
                local, offset = p.data, (0,) * p.dim()
            fill_shard(local, tuple(p.shape), tuple(offset), rule, seed, key)


def materialize_units(cfg, unit_ids: Iterable[int], seed: int, device: str | torch.device = "cpu") -> dict[int, nn.Module]:
    """The units ``unit_ids`` of ``cfg``'s model, whole, on ``device``, with the weights
    every plan of run ``seed`` starts from (the single-process reference builds this way;
    the runtime builds shards with the same values). Tied embeddings are untied, as in
    :func:`meta_units`."""
    n = len(meta_model(cfg).layers)
    units = meta_units(cfg, unit_ids)
    for unit in units.values():
        unit.to_empty(device=device)
    init_local_shards(units, cfg, n, seed)
    return units


# --------------------------------------------------------------------- tensor parallel
def tensor_parallel_styles(unit: nn.Module, sequence_parallel: bool) -> tuple[dict, object | None]:
    """(parallelize_module plan for the unit's submodules, style for the unit itself or None).

    The zoo's styles map to DTensor styles as in torchtitan's parallelize_llama:

    * ``colwise`` -> ColwiseParallel, ``rowwise`` -> RowwiseParallel (Megatron MLP/attention);
    * ``embedding`` -> RowwiseParallel on the vocab-sharded table with a replicated output
      (the zoo adds positions to the full sequence, so under SP the unit's *output* is
      split along the sequence instead: a local slice, no communication);
    * ``output`` -> ColwiseParallel over the vocabulary, gathered to replicated logits (no
      loss parallelism: the zoo's loss takes full logits);
    * ``norm`` -> replicated; under SP a SequenceParallel region.
    * ``head_norm`` -> replicated, run as SequenceParallel over the head dimension.

    Under SP a *region* is the top-level child holding colwise/rowwise modules
    (``attention``, ``mlp``, ``moe``): its input is all-gathered along the sequence
    (PrepareModuleInput) and, when its rowwise linears are its direct children, they
    reduce-scatter back to sequence shards. A region whose rowwise linears sit deeper
    (MoE experts see routed tokens, not the sequence) all-reduces inside and slices its
    output instead. Any other parameterised module in a SP unit runs on sequence shards
    as a SequenceParallel module so its replicated weights get all-reduced gradients.
    Every style hands plain local tensors to the next module (``use_local_output``).
    """
    spec = unit.tp_plan()
    sp = sequence_parallel
    regions: dict[str, bool] = {}
    for fqn, style in spec.items():
        if style == "experts":
            # Routed experts see routed tokens, not the sequence: their region gathers its
            # input and splits its output (ExpertParallel all-reduces the experts' output).
            regions[fqn.partition(".")[0]] = False
        elif style in ("colwise", "rowwise"):
            root, _, rest = fqn.partition(".")
            if not rest:
                raise ConfigError("tp_plan", f"{type(unit).__name__} shards {fqn!r} at the top level; the "
                                  "runtime needs colwise/rowwise modules inside a child module")
            if style == "rowwise":
                regions[root] = regions.get(root, True) and "." not in rest
            else:
                regions.setdefault(root, True)
    plan: dict[str, object] = {}
    for fqn, style in spec.items():
        root = fqn.partition(".")[0]
        if style == "colwise":
            plan[fqn] = ColwiseParallel()
        elif style == "rowwise":
            plan[fqn] = RowwiseParallel(output_layouts=Shard(1)) if sp and regions[root] else RowwiseParallel()
        elif style == "norm":
            if sp:
                plan[fqn] = SequenceParallel(use_local_output=True)
        elif style == "head_norm":
            # A norm applied per head ([b, s, heads, head_dim]) to the heads this rank holds:
            # replicated weight, input sharded on the head dimension, so its gradient is
            # summed over the tensor-parallel ranks like a sequence-parallel norm's.
            plan[fqn] = SequenceParallel(sequence_dim=2, use_local_output=True)
        elif style == "embedding":
            plan[fqn] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        elif style == "output":
            plan[fqn] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                        output_layouts=Replicate())
        elif style == "experts":
            continue   # sharded by apply_expert_parallel, over the expert mesh
        elif style == "head_shared":
            plan[fqn] = SumGradientOverRanks()
        else:
            raise ConfigError("tp_plan", f"{type(unit).__name__}.{fqn}: unknown style {style!r}")
    own = None
    if sp:
        is_embedding = any(s == "embedding" for s in spec.values())
        if is_embedding:
            own = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                      use_local_output=True)
        for root, direct in regions.items():
            if direct:
                plan[root] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                use_local_output=True)
            else:
                plan[root] = PrepareModuleInputOutput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                    output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True)
        if not is_embedding:
            for name, mod in unit.named_modules():
                if (name and name not in spec and name.partition(".")[0] not in regions
                        and any(True for _ in mod.parameters(recurse=False))):
                    plan[name] = SequenceParallel(use_local_output=True)
    return plan, own


class SumGradientOverRanks(ParallelStyle):
    """For a module whose input every tensor-parallel rank computes in full and whose output
    each rank's share of the heads reads: the input's gradient is partial on every rank, so
    it is all-reduced over the mesh (the input is treated as a DTensor that is Replicate in
    forward and Partial in backward)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def pre(_m, args):
            x = args[0]
            return (DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                    .to_local(grad_placements=[Partial()]),) + tuple(args[1:])
        module.register_forward_pre_hook(pre)
        return module


def apply_expert_parallel(unit: nn.Module, experts_mesh: DeviceMesh) -> None:
    """Shard the unit's routed experts over the ("ep", "tp") mesh and exchange their tokens
    by all-to-all over "ep" (:class:`autoplan.runtime.experts.ExpertParallel`)."""
    from autoplan.runtime.experts import ExpertParallel, expert_modules
    for experts in expert_modules([unit]):
        parallelize_module(experts, experts_mesh, ExpertParallel())


def apply_tensor_parallel(unit: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    if sequence_parallel and not isinstance(unit, SEQUENCE_PARALLEL_UNITS):
        raise ConfigError("sequence_parallel", f"is not supported for {type(unit).__name__} units",
                          "set sequence_parallel to false")
    plan, own = tensor_parallel_styles(unit, sequence_parallel)
    if plan:
        parallelize_module(unit, tp_mesh, plan)
    if own is not None:
        parallelize_module(unit, tp_mesh, own)


# ------------------------------------------------------------------------ recompute
def _checkpoint_forward(module: nn.Module) -> None:
    """Recompute ``module``'s forward in backward (non-reentrant torch.utils.checkpoint).

    The instance's ``forward`` is wrapped rather than the module replaced by a
    CheckpointWrapper, so parameter names stay those of the model (checkpoints written
    with and without recomputation are interchangeable) and the hooks DTensor and FSDP
    put on the module keep running once, outside the recomputed region."""
    inner = module.forward

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward


def apply_recompute(unit: nn.Module, mode: str) -> None:
    if mode == "full":
        _checkpoint_forward(unit)
    elif mode == "selective":
        core = getattr(getattr(unit, "attention", None), "core", None)
        if core is not None:   # embedding / head units have no attention core
            _checkpoint_forward(core)
    elif mode != "none":
        raise ConfigError("recompute", f"unknown mode {mode!r}")


# ------------------------------------------------------------------------- modules
class StageModule(nn.Module):
    """One pipeline stage: units ``start..end`` run in order. Units are registered under
    their model index (``layers.<i>``) so names match the whole model's."""

    def __init__(self, units: dict[int, nn.Module], autocast_dtype: torch.dtype | None = None,
                 device_type: str = "cpu"):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): units[i] for i in sorted(units)})
        self.autocast_dtype = autocast_dtype
        self.device_type = device_type

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = (torch.autocast(self.device_type, dtype=self.autocast_dtype) if self.autocast_dtype
               else contextlib.nullcontext())
        with ctx:
            for unit in self.layers.values():
                x = unit(x)
        return x


class RankModel(nn.Module):
    """Every unit this rank holds (across its virtual stages), under the model's names:
    what the optimizer and checkpoints see. Its forward is never called; the stage
    modules that share these units are."""

    def __init__(self, units: dict[int, nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): units[i] for i in sorted(units)})


# ---------------------------------------------------------------- data parallel / ZeRO
def apply_data_parallel(stage: StageModule, dp_mesh: DeviceMesh, choice: DataParallelChoice,
                        mp_policy=None, expert_dp_mesh: DeviceMesh | None = None) -> None:
    """The FSDP-family wrappers for data parallelism over ``dp_mesh`` on every unit (and the
    stage, as root), applied on ``meta`` before the weights exist (DDP comes later: see
    :func:`wrap_ddp`). With ``expert_dp_mesh``, routed experts are wrapped first, over the
    ranks holding the same experts (see :mod:`autoplan.runtime.experts` for how their
    gradients are averaged)."""
    if choice.under_autocast:   # (no FSDP-family wrapper)
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = mp_policy or MixedPrecisionPolicy()
    if choice.wrapper == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate
        wrap = lambda m, mesh: replicate(m, mesh=mesh, mp_policy=mp)  # noqa: E731
    else:
        wrap = lambda m, mesh: fully_shard(m, mesh=mesh, reshard_after_forward=choice.reshard_after_forward,  # noqa: E731
                                           mp_policy=mp)
    if expert_dp_mesh is not None:
        from autoplan.runtime.experts import expert_modules
        for experts in expert_modules(stage.layers.values()):
            wrap(experts, expert_dp_mesh)
    if choice.wrapper == "replicate":
        for unit in stage.layers.values():
            wrap(unit, dp_mesh)
        wrap(stage, dp_mesh)
        return
    for unit in stage.layers.values():
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=choice.reshard_after_forward, mp_policy=mp)
    # The stage is the FSDP root (it holds no parameters of its own).
    fully_shard(stage, mesh=dp_mesh, reshard_after_forward=choice.reshard_after_forward, mp_policy=mp)


def wrap_ddp(stage: StageModule, dp_mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """``stage`` under DistributedDataParallel over the data-parallel group (materialised
    weights: DDP broadcasts them from the group's first rank at construction)."""
    from torch.nn.parallel import DistributedDataParallel
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(stage, process_group=dp_mesh.get_group(), device_ids=ids)
