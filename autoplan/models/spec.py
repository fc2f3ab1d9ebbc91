"""ModelSpec: a model as the ordered layers a planner splits, with what each costs.

Every per-layer quantity is *per sample* (one sequence of ``seq_len`` tokens, or one
image) and is linear in the micro-batch size. Quantities that tensor parallelism
divides are kept as a :class:`Split` ``x(t) = replicated + sharded / t``; under
sequence parallelism the replicated part of activations is divided by ``t`` too.
The figures are measured from the real ``nn.Module`` on the ``meta`` device (see
:mod:`autoplan.models.extract`), not written down by hand.
"""
from __future__ import annotations

from dataclasses import dataclass, field

RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class Split:
    """A quantity ``replicated + sharded / tp`` under tensor-parallel degree ``tp``."""

    replicated: float = 0.0
    """Part every tensor-parallel rank holds or does in full."""
    sharded: float = 0.0
    """Part divided among the tensor-parallel ranks."""

    def at(self, tp: int = 1, sequence_parallel: bool = False) -> float:
        """Per-rank value; sequence parallelism also splits the replicated part."""
        rep = self.replicated / tp if sequence_parallel else self.replicated
        return rep + self.sharded / tp

    @property
    def total(self) -> float:
        return self.replicated + self.sharded

    def __add__(self, other: "Split") -> "Split":
        return Split(self.replicated + other.replicated, self.sharded + other.sharded)

    def scaled(self, k: float) -> "Split":
        return Split(self.replicated * k, self.sharded * k)


@dataclass(frozen=True)
class Gemm:
    """One matrix multiply of a layer, for one sample: ``count`` products of (m x k) @ (k x n)."""

    m: float
    n: float
    k: float
    count: float = 1
    shard_dim: str = ""
    """Which of 'm', 'n', 'k', 'count' tensor parallelism divides ('' = none)."""
    batch_dim: str = "m"
    """Which dimension grows with the micro-batch size ('m' for linears, 'count' for batched attention)."""
    in_core: bool = False
    """Part of the attention core that selective recomputation re-runs."""
    expert: bool = False
    """A routed experts' grouped matmul: ``count`` experts, each on ``m`` token slots (measured
    at balanced load); expert parallelism divides the experts and gathers their tokens."""

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count

    def shape(self, micro_batch: int, tp: int, ep: int = 1, load: float = 1.0) -> tuple[float, float, float, float]:
        """(m, n, k, count) for a micro-batch on one rank under tensor parallelism ``tp`` and,
        for expert matmuls, expert parallelism ``ep``: the rank holds count / ep experts, each
        receiving its tokens from all ep ranks, times ``load`` (the busiest rank's load over
        the balanced one)."""
        dims = {"m": self.m, "n": self.n, "k": self.k, "count": self.count}
        dims[self.batch_dim] *= micro_batch
        if self.shard_dim:
            dims[self.shard_dim] /= tp
        if self.expert:
            rows = "k" if self.batch_dim == "k" else "m"   # weight gradients reduce over tokens
            dims["count"] /= ep
            dims[rows] *= ep * load
        return dims["m"], dims["n"], dims["k"], dims["count"]


@dataclass(frozen=True)
class Collective:
    """One collective an operator-level layout implies on the tensor-parallel ranks
    (see :mod:`autoplan.layouts`: DTensor ``redistribute`` between a producer's and a
    consumer's placement, or of a gradient on its way back)."""

    kind: str
    """'all_reduce', 'all_gather', 'reduce_scatter' or 'all_to_all'."""
    nbytes: float
    """Full size of the tensor: per sample when ``batch_scaled``, else in total."""
    phase: str = "forward"
    """'forward' or 'backward'."""
    batch_scaled: bool = True
    """The tensor grows with the micro-batch (an activation; False for a parameter's gradient)."""
    scope: str = "tp"
    """'tp' (the group's tensor-parallel ranks) or 'pipeline' (every rank of the pipeline
    replica: an interlaced unit)."""


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes a layer keeps for backward per sample, by recompute mode."""

    none: Split = Split()
    """Everything autograd saves."""
    selective: Split = Split()
    """The attention core is recomputed (Korthikanti et al. 2022): its internals are not kept."""
    full: Split = Split()
    """The whole layer is recomputed: only its input is kept."""

    def __getitem__(self, mode: str) -> Split:
        return getattr(self, mode)


@dataclass(frozen=True)
class RecomputePrefix:
    """The part of a unit's forward that a checkpoint with early stopping re-runs: PyTorch's
    non-reentrant checkpoint stops once the last tensor the backward saved is rebuilt, so the
    ops after the unit's last save (its MLP's down projection and residual add, the head's
    vocabulary GEMM) do not run again. Measured per sample, as the forward's figures."""

    gemms: int
    """How many of the unit's forward GEMMs (``LayerSpec.gemms_fwd``, in order) it re-runs."""
    attention_share: float
    """Share of the forward's fused-attention FLOPs it re-runs (0 or 1 for one core)."""
    memory_bytes: Split
    """Bytes its bandwidth-bound kernels move."""
    kernels: int
    """Kernels it launches."""
    saved_tensors: int = 0
    """Tensors autograd saves in the unit's forward (parameters included): each passes the
    checkpoint's pack hook in the forward and its unpack hook in the backward."""
    autocast_kernels: int = 0
    """Kernels it launches under autocast on fp32 weights (``LayerSpec.autocast_kernels_fwd``);
    0: not measured."""


@dataclass(frozen=True)
class ExpertSpec:
    """The routed experts of a mixture-of-experts unit, measured at balanced load (every
    expert receives tokens x top_k / num_experts token slots)."""

    num_experts: int
    """Routed experts in the unit."""
    top_k: int
    """Experts each token is sent to."""
    params: Split
    """Parameters of all routed experts (part of ``LayerSpec.params``; expert parallelism
    divides them, tensor parallelism shards them like a dense MLP)."""
    activation_bytes: Split
    """Bytes saved for backward inside the routed experts per sample (part of the unit's
    'none' and 'selective' activations); they grow with the load of the busiest expert rank."""
    dispatch_bytes: float
    """Bytes of the routed token copies per sample (tokens x top_k x hidden x dtype size):
    what one dispatch or combine all-to-all moves out of a rank at balanced load."""
    capacity_factor: float | None = None
    """Token slots per expert over the balanced load when the model drops tokens past it
    (every slot is computed and sent, full or not); None = dropless routing."""


@dataclass(frozen=True)
class LayerSpec:
    """One pipeline unit (embedding, block, head, ...) and its costs per sample.

    Equality and hashing ignore the name, so identical blocks share cached timings."""

    name: str = field(compare=False)
    """Unique name, e.g. 'block.3'."""
    kind: str
    """'embedding', 'block', 'head', or a model-specific unit kind."""
    params: Split
    """Parameter count."""
    flops_fwd: Split
    """Forward FLOPs (model FLOPs, as FlopCounterMode counts them)."""
    flops_bwd: Split
    """Backward FLOPs (input and weight gradients)."""
    gemms_fwd: tuple[Gemm, ...] = ()
    """Forward matmuls, for shape-dependent efficiency."""
    gemms_bwd: tuple[Gemm, ...] = ()
    """Backward matmuls."""
    attention_flops_fwd: Split = Split()
    """FLOPs of fused attention kernels (counted over the full s x s, causal or not)."""
    attention_flops_bwd: Split = Split()
    memory_bytes_fwd: Split = Split()
    """HBM bytes read+written by the bandwidth-bound (non-matmul) kernels of the forward."""
    memory_bytes_bwd: Split = Split()
    core_memory_bytes_fwd: Split = Split()
    """The part of memory_bytes_fwd inside the attention core (re-run by selective recompute)."""
    kernels_fwd: int = 0
    """Kernels launched by the forward (for launch overhead)."""
    kernels_bwd: int = 0
    autocast_kernels_fwd: int = 0
    """Kernels the forward launches when it runs under autocast on fp32 weights, as
    autoplan's runtime runs a plan without an FSDP-family wrapper: the casts autocast inserts
    included (:mod:`autoplan.models.autocast`). 0: not measured (the host counts
    ``kernels_fwd``)."""
    autocast_kernels_bwd: int = 0
    """The backward's kernels under autocast (the casts' backward included); 0: not measured."""
    activation_bytes: ActivationBytes = ActivationBytes()
    """Bytes saved for backward per sample, by recompute mode ('none', 'selective', 'full')."""
    output_bytes: float = 0.0
    """Bytes of the output activation per sample (what a pipeline send carries)."""
    tp_allreduces_fwd: int = 0
    """Tensor-parallel all-reduces of an output-sized tensor per forward (the same count runs
    in backward); with sequence parallelism each becomes a reduce-scatter + all-gather pair."""
    causal: bool = False
    """Attention is causal: fused kernels skip the masked half of the s x s work."""
    tp_collectives: tuple[Collective, ...] = ()
    """Collectives of an operator-level layout (in addition to ``tp_allreduces_fwd``)."""
    transient_bytes: Split = Split()
    """Bytes per sample held only while the unit's backward runs (a co-sharded unit
    rebuilding one chunk; an interlaced unit's share), on top of the usual temporaries."""
    attention_fraction: float = 1.0
    """Share of that (causal) work a fused attention kernel does: 1 = every pair; a sliding
    window of w tokens over a sequence of s leaves about w/s of it."""
    experts: ExpertSpec | None = None
    """The unit's routed experts (mixture-of-experts units only)."""
    recompute_prefix: RecomputePrefix | None = None
    """What an early-stopping checkpoint re-runs of the forward (None: not measured; the
    whole forward)."""
    param_tensors: int = 0
    """Parameter tensors of the unit (weights, biases, norm scales); 0: not counted (taken as
    its weight matrices, ``weight_tensors``)."""

    def __post_init__(self):
        # Specs are hashed on every cost lookup; compute the hash once.
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f) for f in _LAYER_KEY_FIELDS)))

    def __hash__(self) -> int:
        return self._hash

    def params_at(self, tp: int) -> float:
        return self.params.at(tp)

    def largest_weight(self, tp: int) -> float:
        """Parameters of the largest single weight matrix one tensor-parallel rank holds (one
        routed expert's for expert matmuls); the whole unit where no matmul reads a weight
        (an embedding table is one tensor)."""
        sizes = [g.k * g.n / (tp if g.shard_dim in ("n", "k") else 1)
                 for g in self.gemms_fwd if not g.in_core]
        return min(max(sizes), self.params.at(tp)) if sizes else self.params.at(tp)

    def weight_tensors(self) -> int:
        """Weight matrices its matmuls read, or one tensor where none does (an embedding
        table): what an engine that gathers per sub-module gathers one at a time."""
        return sum(1 for g in self.gemms_fwd if not g.in_core) or 1

    def parameter_tensors(self) -> int:
        """Its parameter tensors, or its weight matrices where they were not counted."""
        return self.param_tensors or self.weight_tensors()


@dataclass(frozen=True)
class ModelSpec:
    """A model as an ordered list of pipeline units, at one sequence length and dtype."""

    name: str
    layers: tuple[LayerSpec, ...]
    seq_len: int
    """Tokens per sample (patches for vision models)."""
    dtype: str = "bf16"
    """Training compute dtype; activation and parameter bytes are in this dtype."""
    heads: int = 0
    """Attention heads (tensor-parallel degree must divide them); 0 = no constraint."""
    kv_heads: int = 0
    vocab: int = 0
    hidden: int = 0
    config: object | None = None
    """The architecture config the spec came from (for the runtime and exports)."""
    tokens_per_sample: int = 0
    """Tokens a sample contributes to tokens/s (seq_len for LMs)."""
    shared_params: float = 0.0
    """Parameters held by two units (a tied embedding and output head): counted once in
    ``num_params``, but each pipeline stage holding one of the units keeps its own copy."""
    tp_shardable: bool = True
    """Whether the layers were measured at sharded shapes (False: tensor parallelism not offered)."""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_params(self) -> float:
        return sum(l.params.total for l in self.layers) - self.shared_params

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE unit (0 for a dense model); expert parallelism divides it."""
        return max((l.experts.num_experts for l in self.layers if l.experts), default=0)

    @property
    def active_params(self) -> float:
        """Parameters one token passes through: all but the routed experts it is not sent to."""
        idle = sum(l.experts.params.total * (1 - l.experts.top_k / l.experts.num_experts)
                   for l in self.layers if l.experts)
        return self.num_params - idle

    def flops_per_sample(self) -> float:
        """Model FLOPs of forward + backward for one sample (no recomputation); for a mixture
        of experts the active-parameter FLOPs (each token through its top_k experts)."""
        return sum(l.flops_fwd.total + l.flops_bwd.total for l in self.layers)

    def tp_degrees(self, limit: int = 64) -> list[int]:
        """Tensor-parallel degrees this model's heads allow."""
        if not self.tp_shardable:
            return [1]
        out = []
        for t in range(1, limit + 1):
            if self.heads and self.heads % t:
                continue
            if self.kv_heads and self.kv_heads % t and t % self.kv_heads:
                continue
            out.append(t)
        return out

    def describe(self) -> str:
        active = (f" ({self.active_params / 1e9:.2f}B active, {self.num_experts} experts)"
                  if self.num_experts else "")
        return (f"{self.name}: {self.num_params / 1e9:.2f}B parameters{active}, {self.num_layers} units, "
                f"seq {self.seq_len}, {self.flops_per_sample() / 1e12:.1f} TFLOP per sample (fwd+bwd)")


_LAYER_KEY_FIELDS = tuple(f for f in LayerSpec.__dataclass_fields__ if f != "name")
