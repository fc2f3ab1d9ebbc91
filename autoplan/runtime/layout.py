"""Where each process sits in a plan: the ("pp", "dp", "cp", "tp") device mesh and this
rank's coordinates, and the checks a plan must pass before the runtime can run it.

The plan's groups are laid out exactly as written (``groups[g].ranks[(d * cp + c) * tp + t]``
is pipeline rank g, data replica d, sequence shard c, tensor shard t), so a planner that placed tensor
parallel ranks inside a node on a heterogeneous cluster gets that placement; the mesh
is built from those ranks, not from a default row-major order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autoplan.errors import ConfigError
from autoplan.plan import Plan

MESH_DIMS = ("pp", "dp", "cp", "tp")
"""Names of the runtime's mesh axes, outermost first."""
EXPERT_DIMS = ("edp", "ep")
"""The data-parallel axis split for routed experts: ``ep`` ranks that share out the experts
(runs of consecutive replicas, as ``DeviceGroup.ep_groups``) and the ``edp`` = dp / ep
ranks holding the same experts."""


@dataclass(frozen=True)
class RankLayout:
    """This process's coordinates in the plan's (pp, dp, cp, tp) grid."""

    rank: int
    """Global rank (torch.distributed)."""
    world_size: int
    """Number of processes; equals plan.num_gpus."""
    pp_rank: int
    """Pipeline rank = index into plan.groups."""
    dp_rank: int
    """Data-parallel replica inside the group."""
    cp_rank: int
    """Context-parallel (sequence) shard inside the replica."""
    tp_rank: int
    """Tensor-parallel shard inside the replica."""
    pp: int
    """Pipeline degree."""
    dp: int
    """Data-parallel degree (the same for every group)."""
    cp: int
    """Context-parallel degree (the same for every group)."""
    tp: int
    """Tensor-parallel degree (the same for every group in this runtime)."""
    stage_ids: tuple[int, ...]
    """Indices into plan.stages that run on this rank, in model order."""
    ep: int = 1
    """Expert-parallel degree (divides dp)."""

    def coordinate(self, dim: str) -> int:
        return {"pp": self.pp_rank, "dp": self.dp_rank, "cp": self.cp_rank, "tp": self.tp_rank,
                "ep": self.dp_rank % self.ep, "edp": self.dp_rank // self.ep}[dim]


def check_plan_supported(plan: Plan, num_units: int, kv_heads: int | None = None,
                         sequence_parallel_ok: bool = True, num_experts: int = 0) -> None:
    """Raise ConfigError for plans this runtime cannot run faithfully (see docs/runtime.md)."""
    plan.validate()
    if plan.ep > 1 and not num_experts:
        raise ConfigError("ep", f"is {plan.ep}, but the model has no routed experts", "set ep to 1")
    if num_experts % plan.ep:
        raise ConfigError("ep", f"{plan.ep} does not divide the model's {num_experts} experts",
                          "pick an ep that divides the expert count")
    if plan.cp > 1 and num_experts:
        raise ConfigError("cp", f"is {plan.cp}: this runtime does not run context parallelism with "
                          "mixture-of-experts layers (their load-balancing counts and expert gradients are "
                          "reduced over data-parallel ranks only)", "use cp 1 for a mixture-of-experts model")
    if plan.layouts is not None:
        raise ConfigError("layouts", "this trainer runs the model family's tensor-parallel recipe, not "
                          "per-operator layouts", "run them with autoplan.runtime.operators.OperatorParallel "
                          "(see docs/operators.md)")
    tps = [g.tp for g in plan.groups]
    if len(set(tps)) > 1:
        i = next(i for i, t in enumerate(tps) if t != tps[0])
        # Pipeline p2p sends each tensor-parallel rank's activation to the rank at the same
        # position of the next group; with different tp degrees the two sides disagree on
        # the layout and a resharding exchange would be needed, which is not implemented.
        raise ConfigError(f"groups[{i}].tp", f"is {tps[i]} but groups[0].tp is {tps[0]}: the runtime "
                          "needs the same tensor-parallel degree in every pipeline group",
                          "re-plan with a uniform tp (e.g. search with a uniform-tp constraint)")
    if plan.stages[-1].end != num_units:
        raise ConfigError(f"stages[{len(plan.stages) - 1}].end", f"is {plan.stages[-1].end}, but the model "
                          f"has {num_units} units", "the plan was made for a different model or depth")
    if plan.pp == 1 and plan.virtual_stages > 1:
        raise ConfigError("virtual_stages", f"{plan.virtual_stages} virtual stages on a single pipeline rank",
                          "interleaving needs pp >= 2; set virtual_stages to 1")
    tp = tps[0]
    if kv_heads is not None and tp > 1 and kv_heads % tp:
        # Colwise-sharding wk/wv splits whole kv heads; tp > kv_heads would need replicated
        # kv projections, which the zoo's tp_plan does not express.
        raise ConfigError("groups[0].tp", f"{tp} does not divide the model's {kv_heads} key/value heads",
                          f"use a tp that divides {kv_heads}")
    if plan.sequence_parallel and tp > 1 and not sequence_parallel_ok:
        raise ConfigError("sequence_parallel", "is not supported by the runtime for this model "
                          "(its units mix tokens across the sequence outside attention)",
                          "set sequence_parallel to false")
    if plan.dtype == "fp16":
        raise ConfigError("dtype", "fp16 training needs loss scaling, which the runtime does not implement",
                          "use bf16 (or fp32)")
    ranks = sorted(r for g in plan.groups for r in g.ranks)
    if ranks != list(range(len(ranks))):
        raise ConfigError("groups", f"the plan uses ranks {ranks[:8]}{'...' if len(ranks) > 8 else ''}; "
                          f"the runtime needs exactly ranks 0..{len(ranks) - 1}",
                          "renumber the plan's ranks from 0")
    grid = mesh_tensor(plan)
    for axis, name in enumerate(MESH_DIMS):
        if grid.shape[axis] > 1 and not bool((grid.diff(dim=axis) > 0).all()):
            # torch.distributed.new_group orders a group's members by global rank, so a
            # mesh axis whose ranks do not increase with the coordinate would give DTensor
            # and pipeline p2p a group-rank order different from the plan's.
            raise ConfigError("groups", f"ranks do not increase along the {name!r} axis of the plan",
                              "order groups by rank (pipeline rank g before g+1, replicas, "
                              "sequence shards and tensor shards in rank order)")


def mesh_tensor(plan: Plan) -> torch.Tensor:
    """[pp, dp, cp, tp] tensor of global ranks, following the plan's own rank placement."""
    tp, cp = plan.groups[0].tp, plan.cp
    return torch.tensor([[[list(g.ranks[(d * cp + c) * tp:(d * cp + c + 1) * tp]) for c in range(cp)]
                          for d in range(g.dp)] for g in plan.groups], dtype=torch.int64)


def rank_layout(plan: Plan, rank: int) -> RankLayout:
    """Coordinates of ``rank`` in the plan (no process group needed)."""
    grid = mesh_tensor(plan)
    hits = (grid == rank).nonzero()
    if len(hits) != 1:
        raise ConfigError("groups", f"rank {rank} is not in the plan (it has {plan.num_gpus} ranks)",
                          f"launch exactly {plan.num_gpus} processes")
    p, d, c, t = (int(x) for x in hits[0])
    pp, dp, cp, tp = grid.shape
    return RankLayout(rank=rank, world_size=plan.num_gpus, pp_rank=p, dp_rank=d, cp_rank=c, tp_rank=t,
                      pp=pp, dp=dp, cp=cp, tp=tp, stage_ids=tuple(plan.stages_of_group(p)), ep=plan.ep)


def build_mesh(plan: Plan, device_type: str) -> DeviceMesh:
    """The ("pp", "dp", "cp", "tp") DeviceMesh of the plan over the current process group."""
    world = dist.get_world_size()
    if world != plan.num_gpus:
        raise ConfigError("plan", f"needs {plan.num_gpus} processes but {world} were launched",
                          f"launch with --nproc-per-node (times --nnodes) = {plan.num_gpus}")
    return DeviceMesh(device_type, mesh_tensor(plan), mesh_dim_names=MESH_DIMS)


def expert_mesh(mesh: DeviceMesh, plan: Plan) -> DeviceMesh:
    """The plan's mesh with its "dp" axis split into ("edp", "ep") (see EXPERT_DIMS): the
    same ranks and root mesh, so expert weights (DTensors over "ep" x "tp") and their
    data parallelism (over "edp") compose with the dense parts' FSDP."""
    return mesh._unflatten("dp", (plan.dp // plan.ep, plan.ep), EXPERT_DIMS)
