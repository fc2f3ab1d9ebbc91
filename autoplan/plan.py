"""Plan: how a model is split over a cluster. JSON round-trippable and validated.

A plan has ``pp`` device groups (pipeline ranks), each a set of cluster ranks laid out
as a (dp x cp x tp) grid with tensor-parallel ranks adjacent (inside a node), then the
context-parallel ranks that split each sequence, then data replicas. The model's
units are cut into ``pp * virtual_stages`` contiguous *stages*; stage ``s`` runs on
group ``s % pp`` (interleaved schedules loop over the groups ``virtual_stages`` times).
Data-parallel degree is the same for every group, so every micro-batch passes every
stage once; tensor-parallel degree may differ per group (heterogeneous clusters). A
mixture-of-experts model's experts are split over ``ep`` of each group's data-parallel x
context-parallel ranks.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from autoplan.errors import ConfigError
from autoplan.fields import FieldReader, load_json
from autoplan.layouts import Layouts
from autoplan.limits import (MAX_GLOBAL_BATCH, MAX_GPUS, MAX_MICRO_BATCH, MAX_MICRO_BATCHES, MAX_SCHEDULE_SLOTS,
                             MAX_SEQ_LEN, MAX_UNITS, MAX_VIRTUAL_STAGES)
from autoplan.models.spec import RECOMPUTE_MODES

if TYPE_CHECKING:
    from autoplan.cluster import Cluster
    from autoplan.models.spec import ModelSpec

SCHEMA_VERSION = 2
"""Version 2 added context parallelism (``groups[i].cp``, ``cp_comm``) and expert parallelism
(``ep``); version 1 files are read with the missing degrees = 1."""
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
CP_COMMS = ("p2p", "all_gather", "a2a")
"""How context-parallel attention exchanges the sequence (Megatron-Core's ``--cp-comm-type``
names): 'p2p' passes key/value chunks around a ring, overlapped with attention on the
chunk at hand; 'all_gather' gathers every rank's keys/values before attention (Llama 3's
choice); 'a2a' (Ulysses) trades the sequence split for a head split with all-to-alls
around attention. The first two split the sequence zig-zag (rank r holds chunks r and
2cp-1-r of 2cp) so causal attention costs every rank the same."""


@dataclass(frozen=True)
class DeviceGroup:
    """The ranks that run one pipeline position."""

    ranks: tuple[int, ...]
    """Cluster ranks, laid out dp-major, then cp, then tp: ranks[(d * cp + c) * tp + t] is
    data replica d, context (sequence) shard c, tensor shard t."""
    tp: int
    """Tensor-parallel degree inside this group."""
    cp: int = 1
    """Context-parallel degree: ranks that split each sequence (the same in every group)."""

    @property
    def dp(self) -> int:
        return len(self.ranks) // (self.tp * self.cp)

    def tp_groups(self) -> list[tuple[int, ...]]:
        """Ranks of one (replica, sequence shard), one tuple per pair."""
        return [self.ranks[i * self.tp:(i + 1) * self.tp] for i in range(self.dp * self.cp)]

    def cp_groups(self) -> list[tuple[int, ...]]:
        """Ranks that split one replica's sequences, one tuple per (replica, tensor shard)."""
        tp, cp = self.tp, self.cp
        return [tuple(self.ranks[(d * cp + c) * tp + t] for c in range(cp))
                for d in range(self.dp) for t in range(tp)]

    def dp_groups(self) -> list[tuple[int, ...]]:
        """Ranks holding the same (sequence shard, tensor shard) of different replicas."""
        return [self.ranks[i::self.tp * self.cp] for i in range(self.tp * self.cp)]

    def dp_cp_groups(self) -> list[tuple[int, ...]]:
        """Ranks holding the same tensor shard of the weights: every replica and sequence
        shard. Gradients are reduced, and ZeRO shards states, over these (as Megatron-Core
        folds context parallelism into data parallelism for the weights)."""
        return [self.ranks[t::self.tp] for t in range(self.tp)]

    def ep_groups(self, ep: int) -> list[tuple[int, ...]]:
        """Expert-parallel groups of degree ``ep``: for every tensor shard, the group's
        data-parallel (x context-parallel) ranks in runs of ``ep`` consecutive ones, as
        Megatron-Core folds expert parallelism into data parallelism. Each group holds all
        experts between its members and exchanges tokens by all-to-all."""
        n = len(self.ranks) // self.tp
        return [tuple(self.ranks[j * self.tp + t] for j in range(e * ep, (e + 1) * ep))
                for t in range(self.tp) for e in range(n // ep)]

    def expert_dp_groups(self, ep: int) -> list[tuple[int, ...]]:
        """The ranks holding the same experts (one per expert-parallel group): what expert
        gradients are reduced over, and what ZeRO shards expert states over."""
        n = len(self.ranks) // self.tp
        return [tuple(self.ranks[(e * ep + i) * self.tp + t] for e in range(n // ep))
                for t in range(self.tp) for i in range(ep)]


@dataclass(frozen=True)
class Stage:
    """A contiguous run of model units on one device group."""

    start: int
    """First unit (index into ModelSpec.layers)."""
    end: int
    """One past the last unit."""
    group: int
    """Index into Plan.groups."""
    recompute: str = "none"
    """'none', 'selective' (attention core only) or 'full' (whole units) for this stage."""

    @property
    def num_layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Plan:
    """A complete parallelization decision for one training iteration."""

    groups: tuple[DeviceGroup, ...]
    """One device group per pipeline rank (pp = len(groups))."""
    stages: tuple[Stage, ...]
    """pp * virtual_stages stages in model order; stage s runs on groups[stages[s].group]."""
    micro_batch: int
    """Samples per micro-batch on one data-parallel replica."""
    num_micro_batches: int
    """Micro-batches per iteration per data-parallel replica (gradient accumulation steps)."""
    schedule: str = "1f1b"
    """'gpipe', '1f1b', 'interleaved-1f1b' or 'zero-bubble' (ZB-H1: split input/weight grads)."""
    virtual_stages: int = 1
    """Stages per device group (>1 only with interleaved-1f1b)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism in the tensor-parallel groups."""
    zero: int = 0
    """ZeRO stage 0-3 over the data-parallel group (1: optimizer states, 2: + gradients,
    3: + parameters sharded)."""
    ep: int = 1
    """Expert-parallel degree: each routed-expert layer's experts are split over ``ep`` ranks
    drawn from a group's data-parallel (x context-parallel) ranks, which exchange tokens by
    all-to-all (see :meth:`DeviceGroup.ep_groups`); expert states are ZeRO-sharded over the
    remaining dp x cp / ep ranks that hold the same experts."""
    dtype: str = "bf16"
    """Compute dtype (mixed precision with fp32 master weights and Adam states)."""
    model: str = ""
    """Name of the model the plan was made for (informational)."""
    seq_len: int = 0
    """Sequence length the plan was made for (informational; 0 = unknown)."""
    layouts: Layouts | None = None
    """Per-operator layouts on the tensor-parallel axis (see autoplan.layouts), replacing the
    model family's tensor-parallel recipe; None = the recipe (Megatron-style)."""
    cp_comm: str = "p2p"
    """How context-parallel attention exchanges the sequence: 'p2p', 'all_gather' or 'a2a'
    (see CP_COMMS); only meaningful when cp > 1."""

    # ------------------------------------------------------------- derived
    @property
    def pp(self) -> int:
        return len(self.groups)

    @property
    def dp(self) -> int:
        return self.groups[0].dp

    @property
    def tp(self) -> int:
        """The tensor-parallel degree when uniform; the largest one otherwise."""
        return max(g.tp for g in self.groups)

    @property
    def cp(self) -> int:
        """Context-parallel degree (every group has the same)."""
        return self.groups[0].cp

    @property
    def num_gpus(self) -> int:
        return sum(len(g.ranks) for g in self.groups)

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.num_micro_batches * self.dp

    @property
    def recompute(self) -> str:
        modes = {s.recompute for s in self.stages}
        return modes.pop() if len(modes) == 1 else "mixed"

    def stages_of_group(self, g: int) -> list[int]:
        return [i for i, s in enumerate(self.stages) if s.group == g]

    def describe(self) -> str:
        tps = sorted({g.tp for g in self.groups})
        tp = str(tps[0]) if len(tps) == 1 else "/".join(str(g.tp) for g in self.groups)
        split = ",".join(str(s.num_layers) for s in self.stages)
        v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        cp = f" cp={self.cp}({self.cp_comm})" if self.cp > 1 else ""
        ops = ""
        if self.layouts is not None:
            cs = max((u.coshard for u in self.layouts.units), default=1)
            ops = " op-layouts" + (f" coshard={cs}" if cs > 1 else "") + (" interlaced" if self.layouts.interlaced else "")
        return (f"dp={self.dp} tp={tp} pp={self.pp}{cp}{v}{ep} mb={self.micro_batch}x{self.num_micro_batches} "
                f"{self.schedule} zero={self.zero} recompute={self.recompute}"
                f"{' sp' if self.sequence_parallel else ''}{ops} split=[{split}]")

    # ---------------------------------------------------------- construction
    @classmethod
    def uniform(cls, model: "ModelSpec", cluster: "Cluster", *, tp: int, pp: int, dp: int,
                micro_batch: int, global_batch: int, schedule: str = "1f1b", virtual_stages: int = 1,
                recompute: str = "none", sequence_parallel: bool = False, zero: int = 0,
                dtype: str = "bf16", first_rank: int = 0, cp: int = 1, cp_comm: str = "p2p",
                ep: int = 1) -> "Plan":
        """Megatron-style plan: ranks in order (tensor-parallel fastest, then context, then
        data, then pipeline), transformer blocks split evenly, embedding on the first stage
        and the head on the last."""
        for name, v in (("tp", tp), ("cp", cp), ("pp", pp), ("dp", dp), ("micro_batch", micro_batch),
                        ("global_batch", global_batch), ("virtual_stages", virtual_stages), ("ep", ep)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(name, f"must be a positive integer, got {v!r}")
        if global_batch % (micro_batch * dp):
            raise ConfigError("global_batch", f"{global_batch} is not divisible by micro_batch*dp = "
                              f"{micro_batch}*{dp}", "pick a global batch that is a multiple of it")
        per_group = tp * cp * dp
        groups = tuple(DeviceGroup(ranks=tuple(range(first_rank + p * per_group,
                                                     first_rank + (p + 1) * per_group)), tp=tp, cp=cp)
                       for p in range(pp))
        n_stages = pp * virtual_stages
        bounds = even_split(model, n_stages)
        stages = tuple(Stage(start=a, end=b, group=s % pp, recompute=recompute)
                       for s, (a, b) in enumerate(bounds))
        plan = cls(groups=groups, stages=stages, micro_batch=micro_batch,
                   num_micro_batches=global_batch // (micro_batch * dp), schedule=schedule,
                   virtual_stages=virtual_stages, sequence_parallel=sequence_parallel, zero=zero,
                   dtype=dtype, model=model.name, seq_len=model.seq_len, cp_comm=cp_comm, ep=ep)
        plan.validate(model, cluster)
        return plan

    def with_split(self, bounds: Sequence[tuple[int, int]]) -> "Plan":
        stages = tuple(replace(s, start=a, end=b) for s, (a, b) in zip(self.stages, bounds))
        return replace(self, stages=stages)

    # ------------------------------------------------------------ validation
    def validate(self, model: "ModelSpec | None" = None, cluster: "Cluster | None" = None) -> "Plan":
        """Check the plan against itself, the model and the cluster; raise ConfigError
        naming the first broken field."""
        if not self.groups:
            raise ConfigError("groups", "a plan needs at least one device group")
        if self.schedule not in SCHEDULES:
            raise ConfigError("schedule", f"{self.schedule!r} is not one of {list(SCHEDULES)}")
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError("zero", f"must be 0, 1, 2 or 3, got {self.zero!r}")
        for name, top in (("micro_batch", MAX_MICRO_BATCH), ("num_micro_batches", MAX_MICRO_BATCHES),
                          ("virtual_stages", MAX_VIRTUAL_STAGES)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= top:
                raise ConfigError(name, f"must be an integer in 1..{top:,}, got {v!r}")
        if self.num_gpus > MAX_GPUS:
            raise ConfigError("groups", f"the plan has {self.num_gpus:,} ranks, at most {MAX_GPUS:,} are supported")
        if self.global_batch > MAX_GLOBAL_BATCH:
            raise ConfigError("global_batch", f"{self.global_batch:,} samples per iteration, at most "
                              f"{MAX_GLOBAL_BATCH:,} are supported")
        slots = self.pp * self.virtual_stages * self.num_micro_batches
        if slots > MAX_SCHEDULE_SLOTS:
            raise ConfigError("num_micro_batches", f"pp x virtual_stages x num_micro_batches = {slots:,} pipeline "
                              f"slots, at most {MAX_SCHEDULE_SLOTS:,} are supported",
                              "use larger micro-batches or fewer pipeline stages")
        if not isinstance(self.ep, int) or isinstance(self.ep, bool) or not 1 <= self.ep <= MAX_GPUS:
            raise ConfigError("ep", f"must be an integer in 1..{MAX_GPUS:,}, got {self.ep!r}")
        if self.cp_comm not in CP_COMMS:
            raise ConfigError("cp_comm", f"{self.cp_comm!r} is not one of {list(CP_COMMS)}")
        if self.virtual_stages > 1 and self.schedule != "interleaved-1f1b":
            raise ConfigError("virtual_stages", f"{self.virtual_stages} needs schedule 'interleaved-1f1b'",
                              f"got schedule {self.schedule!r}; set virtual_stages to 1")
        seen: set[int] = set()
        for i, g in enumerate(self.groups):
            where = f"groups[{i}]"
            if not g.ranks:
                raise ConfigError(f"{where}.ranks", "a device group needs at least one rank")
            if g.tp < 1 or len(g.ranks) % g.tp:
                raise ConfigError(f"{where}.tp", f"{g.tp} does not divide the group's {len(g.ranks)} ranks")
            if not isinstance(g.cp, int) or g.cp < 1 or len(g.ranks) % (g.tp * g.cp):
                raise ConfigError(f"{where}.cp", f"{g.cp} does not divide the group's {len(g.ranks)} ranks "
                                  f"into tensor-parallel groups of {g.tp}")
            if g.cp != self.groups[0].cp:
                raise ConfigError(f"{where}.cp", f"context-parallel degree {g.cp} differs from group 0's "
                                  f"{self.groups[0].cp}", "every pipeline rank splits the sequence alike")
            if (len(g.ranks) // g.tp) % self.ep:
                raise ConfigError("ep", f"{self.ep} does not divide the {len(g.ranks) // g.tp} data-parallel x "
                                  f"context-parallel ranks of groups[{i}]", "experts are split over the "
                                  "data-parallel x context-parallel ranks: pick an ep that divides dp x cp")
            if g.dp != self.groups[0].dp:
                raise ConfigError(f"{where}.ranks", f"data-parallel degree {g.dp} differs from group 0's "
                                  f"{self.groups[0].dp}", "every pipeline rank needs the same dp")
            dup = seen.intersection(g.ranks)
            if dup:
                raise ConfigError(f"{where}.ranks", f"rank {min(dup)} is used twice")
            seen.update(g.ranks)
            if cluster is not None and max(g.ranks) >= cluster.num_gpus:
                raise ConfigError(f"{where}.ranks", f"rank {max(g.ranks)} does not exist: the cluster has "
                                  f"{cluster.num_gpus} GPUs", "use fewer GPUs or a bigger cluster")
            if min(g.ranks) < 0:
                raise ConfigError(f"{where}.ranks", "ranks must be >= 0")
        if len(self.stages) != self.pp * self.virtual_stages:
            raise ConfigError("stages", f"{len(self.stages)} stages, expected pp*virtual_stages = "
                              f"{self.pp}*{self.virtual_stages}")
        prev_end = 0
        for i, s in enumerate(self.stages):
            where = f"stages[{i}]"
            if s.group != i % self.pp:
                raise ConfigError(f"{where}.group", f"is {s.group}, expected {i % self.pp} "
                                  "(stage s runs on group s % pp)")
            if s.start != prev_end:
                raise ConfigError(f"{where}.start", f"is {s.start}, expected {prev_end}: stages must cover "
                                  "the model's units contiguously and in order")
            if s.end <= s.start:
                raise ConfigError(f"{where}.end", f"stage {i} is empty ({s.start}..{s.end})",
                                  "use fewer pipeline stages")
            if s.recompute not in RECOMPUTE_MODES:
                raise ConfigError(f"{where}.recompute", f"{s.recompute!r} is not one of {list(RECOMPUTE_MODES)}")
            prev_end = s.end
        if self.layouts is not None:
            self.layouts.validate(model.num_layers if model is not None else None)
            if self.sequence_parallel:
                raise ConfigError("sequence_parallel", "cannot be combined with operator layouts",
                                  "operator layouts say where activations are sharded: set it to false")
            if self.cp > 1:
                raise ConfigError("groups[0].cp", f"is {self.cp}, but operator layouts cover the tensor-parallel "
                                  "axis only", "use cp=1 with layouts, or drop the layouts section")
        if model is not None:
            if prev_end != model.num_layers:
                raise ConfigError(f"stages[{len(self.stages) - 1}].end", f"is {prev_end}, but the model has "
                                  f"{model.num_layers} units: every unit needs a stage")
            if self.ep > 1 and not model.num_experts:
                raise ConfigError("ep", f"is {self.ep}, but {model.name} has no routed experts",
                                  "set ep to 1")
            if model.num_experts % self.ep:
                raise ConfigError("ep", f"{self.ep} does not divide the model's {model.num_experts} experts",
                                  "pick an ep that divides the expert count")
            allowed = model.tp_degrees(max(g.tp for g in self.groups))
            for i, g in enumerate(self.groups):
                if g.tp not in allowed:
                    raise ConfigError(f"groups[{i}].tp", f"{g.tp} does not divide the model's attention heads "
                                      f"({model.heads} heads, {model.kv_heads} kv heads)",
                                      f"allowed: {allowed}")
            if self.cp > 1:
                self._validate_context(model)
        return self

    def _validate_context(self, model: "ModelSpec") -> None:
        """The sequence and the heads must split as the context-parallel exchange needs."""
        cp, comm = self.cp, self.cp_comm
        if not model.heads:
            raise ConfigError("groups[0].cp", f"{cp}: context parallelism splits a transformer's sequence, "
                              f"and {model.name} has no attention heads autoplan knows", "set cp to 1")
        causal = any(l.causal for l in model.layers)
        if comm == "a2a":
            chunks, why = cp, "a2a gives each rank an equal part"
        elif causal:
            chunks, why = 2 * cp, f"{comm} splits it zig-zag into 2*cp chunks to balance causal attention"
        else:
            chunks, why = cp, f"{comm} gives each rank an equal part"
        if model.seq_len % chunks:
            raise ConfigError("groups[0].cp", f"{cp}: sequence length {model.seq_len} is not divisible by "
                              f"{chunks} ({why})", "pick a cp (or a sequence length) that divides")
        if comm == "a2a":
            for i, g in enumerate(self.groups):
                for name, n in (("heads", model.heads), ("kv heads", model.kv_heads or model.heads)):
                    local = max(n // g.tp, 1)   # tp > kv heads keeps one (replicated) per rank
                    if local % cp:
                        raise ConfigError(f"groups[{i}].cp", f"{cp}: a2a scatters heads over the context-"
                                          f"parallel ranks, but a tensor-parallel rank holds {local} {name}",
                                          "use cp_comm 'p2p' or 'all_gather', or a cp that divides them")

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION, "model": self.model, "seq_len": self.seq_len,
            "dtype": self.dtype, "schedule": self.schedule, "virtual_stages": self.virtual_stages,
            "micro_batch": self.micro_batch, "num_micro_batches": self.num_micro_batches,
            "global_batch": self.global_batch, "sequence_parallel": self.sequence_parallel,
            "zero": self.zero, "ep": self.ep,
            **({"cp_comm": self.cp_comm} if self.cp > 1 else {}),
            "groups": [{"ranks": list(g.ranks), "tp": g.tp, **({"cp": g.cp} if g.cp > 1 else {})}
                       for g in self.groups],
            "stages": [{"layers": [s.start, s.end], "group": s.group, "recompute": s.recompute}
                       for s in self.stages],
        } | ({"layouts": self.layouts.to_dict()} if self.layouts is not None else {})

    @classmethod
    def from_dict(cls, data: dict, where: str = "plan") -> "Plan":
        r = FieldReader(data, where)
        r.reject_unknown(("schema_version", "model", "seq_len", "dtype", "schedule", "virtual_stages",
                          "micro_batch", "num_micro_batches", "global_batch", "sequence_parallel",
                          "zero", "groups", "stages", "estimate", "layouts", "cp_comm", "ep"))
        version = r.int("schema_version", minimum=1)
        if version > SCHEMA_VERSION:
            raise ConfigError(r.path("schema_version"), f"{version} is newer than this autoplan "
                              f"understands ({SCHEMA_VERSION})", "upgrade autoplan")
        groups = []
        r.list("groups", nonempty=True, max_len=MAX_GPUS)
        for g in r.items("groups", nonempty=True):
            g.reject_unknown(("ranks", "tp", "cp", "device"))
            ranks = g.ints("ranks", nonempty=True, minimum=0, maximum=MAX_GPUS - 1, max_len=MAX_GPUS)
            groups.append(DeviceGroup(ranks=tuple(ranks), tp=g.int("tp", minimum=1, maximum=MAX_GPUS),
                                      cp=g.int("cp", 1, minimum=1, maximum=MAX_GPUS)))
        stages = []
        r.list("stages", nonempty=True, max_len=MAX_UNITS * MAX_VIRTUAL_STAGES)
        for s in r.items("stages", nonempty=True):
            s.reject_unknown(("layers", "group", "recompute"))
            span = s.ints("layers", minimum=0, maximum=MAX_UNITS)
            if len(span) != 2:
                raise ConfigError(s.path("layers"), f"must be [start, end], got {len(span)} numbers")
            stages.append(Stage(start=span[0], end=span[1], group=s.int("group", minimum=0, maximum=MAX_GPUS),
                                recompute=s.str("recompute", "none", choices=RECOMPUTE_MODES)))
        plan = cls(groups=tuple(groups), stages=tuple(stages),
                   micro_batch=r.int("micro_batch", minimum=1, maximum=MAX_MICRO_BATCH),
                   num_micro_batches=r.int("num_micro_batches", minimum=1, maximum=MAX_MICRO_BATCHES),
                   schedule=r.str("schedule", "1f1b", choices=SCHEDULES),
                   virtual_stages=r.int("virtual_stages", 1, minimum=1, maximum=MAX_VIRTUAL_STAGES),
                   sequence_parallel=r.bool("sequence_parallel", False),
                   zero=r.int("zero", 0, minimum=0, maximum=3),
                   dtype=r.str("dtype", "bf16", choices=("bf16", "fp16", "fp32")),
                   ep=r.int("ep", 1, minimum=1, maximum=MAX_GPUS),
                   model=r.str("model", ""), seq_len=r.int("seq_len", 0, minimum=0, maximum=MAX_SEQ_LEN),
                   layouts=Layouts.from_dict(r.raw("layouts"), r.path("layouts")) if r.has("layouts") else None,
                   cp_comm=r.str("cp_comm", "p2p", choices=CP_COMMS))
        plan.validate()
        if r.has("global_batch"):
            stated = r.int("global_batch", minimum=1, maximum=MAX_GLOBAL_BATCH)
            if stated != plan.global_batch:
                raise ConfigError(r.path("global_batch"), f"is {stated}, but micro_batch * "
                                  f"num_micro_batches * dp = {plan.global_batch}")
        return plan

    def save(self, path: str | Path, extra: dict | None = None) -> None:
        from autoplan.files import write_text
        d = self.to_dict()
        if extra:
            d.update(extra)
        write_text(path, json.dumps(d, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        path = Path(path)
        return cls.from_dict(load_json(path), where=path.name)


def even_split(model: "ModelSpec", n_stages: int) -> list[tuple[int, int]]:
    """Megatron's split: transformer blocks evenly over stages, the embedding joins the
    first stage and the head the last; leftover blocks go to the middle stages."""
    n = model.num_layers
    kinds = [l.kind for l in model.layers]
    lead = 1 if kinds and kinds[0] == "embedding" else 0
    tail = 1 if n - lead > 0 and kinds[-1] == "head" else 0
    body = n - lead - tail
    if n_stages > max(body, 1):
        raise ConfigError("pp", f"{n_stages} stages for {body} blocks", "use fewer pipeline stages "
                          "(or virtual stages) than the model has blocks")
    base, extra = divmod(body, n_stages)
    # Extra blocks go to stages away from the first and last, which already hold the
    # embedding and head.
    order = sorted(range(n_stages), key=lambda s: (s in (0, n_stages - 1), abs(s - (n_stages - 1) / 2)))
    counts = [base] * n_stages
    for s in order[:extra]:
        counts[s] += 1
    bounds, start = [], 0
    for s, c in enumerate(counts):
        end = start + c + (lead if s == 0 else 0) + (tail if s == n_stages - 1 else 0)
        bounds.append((start, end))
        start = end
    return bounds
