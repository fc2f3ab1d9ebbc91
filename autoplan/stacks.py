"""The training stack: the software a plan runs on, as an input of the cost model.

The same plan costs different memory and time on different software: whether weights
are kept in bf16 with an fp32 master copy (Megatron-LM, DeepSpeed) or in fp32 under
autocast (plain PyTorch), whether gradients accumulate in fp32, whether the loss
materialises fp32 logits, whether attention is a fused kernel, whether data-parallel
communication overlaps the backward, how much the allocator and NCCL hold besides the
model. Each stack is a documented data file (``autoplan/data/stacks/<name>.json``) with
the source of every figure; ``get_stack`` reads one by name or path.

    from autoplan.stacks import get_stack
    stack = get_stack("megatron-core")
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import lru_cache
from pathlib import Path

from autoplan.errors import ConfigError, closest
from autoplan.fields import FieldReader, load_json
from autoplan.units import GiB, MiB

STACK_DIR = Path(__file__).parent / "data" / "stacks"
SCHEMA_VERSION = 2
"""2 added ``base``: a stack file that varies another names it and gives only what differs."""
ATTENTION_KERNELS = ("math", "flash1", "flash2", "flash3")
"""'math': explicit softmax(QK^T)V (saves the s x s probabilities); 'flash1': a fused kernel of
FlashAttention's first generation (FlashAttention up to 1.0, its Triton port), half
FlashAttention-2's speed; 'flash2': a fused kernel of FlashAttention-2's class (PyTorch SDPA,
FlashAttention-2); 'flash3': Hopper-specific fused kernels (FlashAttention-3, cuDNN /
Transformer Engine), FlashAttention-2 speed elsewhere."""
GRAD_COLLECTIVES = ("reduce_scatter", "all_reduce")
"""Collectives a ZeRO-1/2 data-parallel group may reduce its gradients with."""
PIPELINE_SENDS = ("whole", "scatter_gather")
"""Values of ``Stack.pipeline_send``."""
ZERO3_GATHER_UNITS = ("layer", "module")
"""Values of ``Stack.zero3_gather_unit``."""
TRAFFIC_WHERE = ("always", "autocast")
"""Values of ``Stack.traffic_where``."""
DEFAULT_STACK = "autoplan"
TARGET_STACKS = {"autoplan": "autoplan", "megatron": "megatron-core", "deepspeed": "deepspeed",
                 "torchtitan": "torchtitan"}
"""The stack a plan exported to (or searched for) an engine runs on."""


@dataclass(frozen=True)
class Stack:
    """What a training stack does that changes a plan's memory and time.

    Model states are per parameter held on a rank, before ZeRO sharding: ZeRO-1 divides
    the master weights and optimizer moments by the data-parallel degree, ZeRO-2 also the
    gradients, ZeRO-3 also the weights (Rajbhandari et al., SC20); a stack on FSDP shards
    its weights from an earlier stage (``weights_sharded_from_zero``), and a pipelined plan
    may run at a lower stage than it names (``realized_zero``)."""

    name: str
    """Short name (the file's stem)."""
    description: str
    """What software this is, in a sentence."""
    version: str
    """The release or commit the figures describe."""
    attention: str = "flash2"
    """Attention kernel: one of ATTENTION_KERNELS."""
    fused_norm: bool = True
    """Norms run as one fused kernel saving only the half-precision input (Apex, TE, PyTorch
    >= 2.8 on CUDA); False: the eager decomposition, which saves fp32 copies."""
    fused_qkv: bool = False
    """The model code projects q, k and v with one GEMM (Megatron's query_key_value), so the
    backward adds no three input gradients; False: three projections (HuggingFace, torchtitan)."""
    fused_softmax: bool = False
    """Explicit attention scales, masks and normalizes the scores in one kernel each way
    (Megatron's FusedScaleMaskSoftmax); False: separate eager passes."""
    fused_dropout_add: bool = False
    """A residual branch's bias, dropout and add run as one kernel (Megatron's
    bias-dropout-add fusion); False: a dropout kernel, then an add."""
    fused_swiglu: bool = False
    """A gated MLP's activation runs as one kernel that saves only its two inputs (Megatron's
    bias-SwiGLU fusion); False: the eager ``up * act(gate)``, which also saves the activation."""
    fp32_loss: bool = True
    """The cross entropy runs on an fp32 copy of the logits, each of its passes reading and
    writing 4 bytes per logit; False: on the half-precision logits (2 bytes), or a fused
    cross-entropy kernel, whose traffic is smaller still."""
    weights_bytes_per_param: float = 2.0
    """Persistent weight copy (bf16 = 2, fp32 = 4)."""
    master_weights_bytes_per_param: float = 4.0
    """Separate fp32 master weights kept by the optimizer (0 when the weights are fp32)."""
    gradient_bytes_per_param: float = 4.0
    """Gradient accumulation buffer (fp32 main grads = 4, bf16 = 2)."""
    half_gradient_bytes_per_param: float = 0.0
    """Half-precision gradients autograd writes that the engine keeps beside that buffer
    until the next backward frees them (DeepSpeed's BF16 optimizer: 2); 0 where gradients
    land in the buffer or are freed once added to it. Memory only: the reductions read the
    buffer."""
    optimizer_bytes_per_param: float = 8.0
    """Optimizer moments (Adam's m and v in fp32 = 8)."""
    gathered_weights_bytes_per_param: float = 2.0
    """Bytes per parameter of the full weights ZeRO-3 gathers for the unit being run."""
    weights_sharded_from_zero: int = 3
    """The ZeRO stage from which a rank keeps only its shard of the weight copy
    (``weights_bytes_per_param``): 3 as in ZeRO; 1 where ZeRO-1 and -2 run on FSDP, which
    shards the parameters it wraps at every stage (their half-precision compute copy, if
    any, is ``weight_cast_bytes_per_param`` and stays whole below ZeRO-3)."""
    reduce_every_micro_batch_from_zero: int = 3
    """The ZeRO stage from which every micro-batch's backward reduce-scatters its gradients
    over the data-parallel group (charged per micro-batch, beside the backward); below it
    they accumulate and are reduced once per step. 3 as ZeRO-3 does everywhere."""
    pipeline_max_zero: int = 3
    """The highest ZeRO stage a pipelined plan really runs at: where the pipeline keeps the
    gathered weights and whole gradients until the step's last backward, a higher stage
    runs as this one (``realized_zero``)."""
    zero3_copy_bytes_per_param: float = 0.0
    """Memory traffic per parameter of a stage, every micro-batch, that ZeRO-3 adds on the
    compute stream besides its collectives (FSDP2 copies gathered weights out to the
    parameters and gradients into the reduce-scatter buffer), charged to the backward."""
    zero3_stream_copy_bytes_per_param: float = 0.0
    """The same on the communication stream, beside the collectives it serves and hidden
    behind compute as they are (FSDP1's gradient cast and pre-divide, DeepSpeed's bucket
    copies)."""
    weight_cast_bytes_per_param: float = 0.0
    """Half-precision copies of the weights made for every micro-batch in flight (autocast's
    cast of fp32 weights, saved for the backward); 0 when weights are already half precision."""
    optimizer_step_bytes_per_param: float = 0.0
    """Temporary bytes per local parameter while the optimizer steps (PyTorch's foreach
    AdamW allocates a fp32 tensor per parameter for sqrt(v); fused kernels allocate none)."""
    optimizer_traffic_bytes_per_param: float = 42.0
    """Memory traffic of one optimizer step per local parameter, gradient-norm and clipping
    passes included (bandwidth-bound: it sets the step's time)."""
    fp8_linears: bool = False
    """The blocks' linear layers run their three GEMMs (forward, input gradient, weight
    gradient) in fp8 with dynamic scaling (torchao's Float8Linear, Transformer Engine): at the
    device's fp8 peak, plus the casts below. Attention, norms, the LM head, expert matmuls,
    communication and saved activations stay in the plan's dtype."""
    fp8_cast_bytes_per_activation: float = 0.0
    """Memory traffic per element of an fp8 linear's input (forward) and of its output
    gradient (backward) to scale it and write the fp8 copies its GEMMs read."""
    fp8_cast_bytes_per_weight: float = 0.0
    """Memory traffic per element of an fp8 linear's weight, every micro-batch, to scale it and
    write its fp8 copies for the forward and the backward (charged to the forward)."""
    fp8_cast_kernels_per_activation: float = 0.0
    """Kernels that scale and cast one fp8 linear's input, or its output gradient (each costs
    at least a launch, which decides small layers)."""
    fp8_cast_kernels_per_weight: float = 0.0
    """Kernels that scale and cast one fp8 linear's weight, every micro-batch."""
    activation_scale: float = 1.0
    """Saved activations of the stack's own model code over the zoo's measured ones (1 where
    the zoo's layers save what the stack's layers save; fitted, with the data named in
    ``sources``, where the stack's code keeps more)."""
    activation_traffic_scale: float = 1.0
    """Bandwidth-bound traffic of the stack's model code over the zoo's measured bytes (1 where
    its layers move what the zoo's bf16 layers move; fitted, with the data named in
    ``sources``, where its code keeps wider types, as autocast's fp32 residual stream and
    norms)."""
    weight_cast_traffic_bytes_per_param: float = 0.0
    """Memory traffic per parameter in each micro-batch's forward from weights kept in a wider
    type than the GEMMs read (autocast casting an fp32 weight to bf16: read 4 B, write 2 B).
    Not charged to embedding lookups, which read their table uncast."""
    weight_grad_traffic_bytes_per_param: float = 0.0
    """Memory traffic per parameter in each micro-batch's backward from the same: the weight
    gradient cast back to the parameter's type and added into the accumulated gradient
    (autocast: bf16 to fp32, read 2 B, write 4 B; fp32 add, read 8 B, write 4 B; charged on
    every micro-batch, the first one's add included)."""
    traffic_where: str = "always"
    """Where the three traffic figures above apply: 'always', or 'autocast' (only where
    autoplan's runtime computes under autocast -- one data-parallel replica, or DDP --
    the FSDP-family wrappers computing on bf16 weight copies instead; see
    ``autoplan.data_parallel``)."""
    recompute_early_stop: bool = False
    """Full recomputation runs as PyTorch's non-reentrant checkpoint with early stopping
    (``torch.utils.checkpoint``, ``use_reentrant=False``, on by default): a unit's forward is
    re-run only up to its last save, so its trailing ops (the MLP's down projection, the
    head's vocabulary GEMM) run once (``LayerSpec.recompute_prefix``). False: the whole
    forward runs again (Megatron-LM's and DeepSpeed's checkpointing; torchtitan turns early
    stopping off)."""
    loss_saved_bytes_per_logit: float = 4.0
    """Bytes per logit element the loss keeps from forward to backward (an fp32 softmax or
    log-softmax = 4; a fused cross entropy keeps almost none)."""
    loss_peak_bytes_per_logit: float = 6.0
    """Bytes per logit element alive at the peak of the loss's backward, saved bytes included."""
    sequence_parallel_keeps_gathered_inputs: bool = False
    """Under sequence parallelism, the column-parallel linears' inputs (a block's attention
    and MLP inputs) are kept whole: the stack gathers the sequence before the matmul and
    autograd saves the gathered tensor. False: only the rank's sequence shard is kept and the
    backward gathers it again (Megatron-LM, Korthikanti et al. 2022, Sec. 4.2.2)."""
    vocab_multiple: int = 1
    """The engine pads the vocabulary to a multiple of this before it builds the embedding and
    head (Megatron-LM's ``--make-vocab-size-divisible-by``, 128 by default, times the
    tensor-parallel size, which is not counted here: at most 128 x (tp - 1) rows more), so
    the head's GEMMs run on aligned rows; 1: the vocabulary as the model defines it."""
    vocab_parallel_loss: bool = True
    """The loss runs on vocabulary shards (Megatron's vocab-parallel cross entropy); False:
    the logits are gathered to the full vocabulary on every tensor-parallel rank first."""
    grad_reduce_bytes_per_param: float = 4.0
    """Bytes per parameter the data-parallel gradient reduction moves (fp32 = 4, bf16 = 2)."""
    grad_reduce_copy_bytes_per_param: float = 0.0
    """Bytes per local parameter of the copy the data-parallel gradient reduction makes in its
    communication dtype, held while it runs after the backward (DeepSpeed's engine casts each
    flat fp32 gradient group of its BF16 optimizer to bf16 whole: 2); 0 where gradients are
    reduced in place or through bounded buckets (``dp_buffer_bytes``). Below ZeRO-2 only,
    where a rank reduces its whole gradients at once."""
    sharded_grad_collective: str = "reduce_scatter"
    """How ZeRO-1/2 reduce gradients over the data-parallel group: 'reduce_scatter' (each rank
    receives the sum of its own optimizer shard only) or 'all_reduce' (every rank receives
    the whole sum and keeps its shard: twice the traffic). Without ZeRO it is an all-reduce
    and under ZeRO-3 a reduce-scatter on every stack."""
    dp_buffer_bytes: float = 0.0
    """Communication buffers for the data-parallel reduction and gather that are not the
    gradients themselves (DeepSpeed's reduce/all-gather buckets), when dp > 1."""
    forward_host_s_per_kernel: float = 0.0
    """Host time per forward kernel of the stack's model code (Python module code, framework
    dispatch, launch): a layer's forward that the GPU would finish sooner waits on the host.
    The backward runs in the autograd engine's C++ loop and is not held to it. 0: the host
    keeps ahead of the GPU."""
    host_s_per_kernel: float = 0.0
    """Host time to issue one forward or backward kernel from the stack's code (Python,
    dispatch, autograd, launch) on an accelerator, which runs kernels while its host goes
    on: a step takes about the longer of its device work and its host work
    (``costmodel.host``). 0: the host keeps ahead of the device."""
    host_s_per_step: float = 0.0
    """Host time per step besides the forward and backward kernels (the optimizer's
    per-tensor loops, gradient clipping, zeroing), on an accelerator."""
    overlap_grad_reduce: bool = True
    """Data-parallel gradient reduction overlaps the backward (bucketed)."""
    overlap_param_gather: bool = True
    """ZeRO-1/2's parameter all-gather after the step overlaps the next forward."""
    zero3_gather_unit: str = "layer"
    """What ZeRO-3 gathers at a time: 'layer', a pipeline unit's parameters in one collective
    (FSDP wraps each block; a recomputed forward runs inside the unit's backward and uses
    its gather); 'module', each weight matrix of a unit in a collective of its own
    (DeepSpeed's per-module fetch), released after every forward of its module, so a fully
    recomputed forward gathers it again. The memory holds two at once: the one in use and
    the one prefetched."""
    zero3_host_s_per_rank: float = 0.0
    """Host time per member of the data-parallel group that each ZeRO-3 gather and gradient
    reduce-scatter costs the stack's own code besides the collective (DeepSpeed's first
    ZeRO-3 builds one tensor view per rank in a Python loop). 0: one flat buffer."""
    zero3_kernels_per_rank: int = 0
    """Kernels per member of the data-parallel group that each ZeRO-3 collective launches
    besides itself, each at the device's launch cost (the list-form all_gather and
    reduce_scatter of PyTorch up to 1.8 copy every rank's chunk out of, or into, a flat
    buffer in a kernel of its own). 0: a collective on one flat buffer."""
    overlap_zero3: bool = True
    """ZeRO-3's parameter gathers and gradient reduce-scatters, every micro-batch, run beside
    the compute (prefetched and reduced on streams of their own). False: each runs between
    the compute kernels, on the critical path (an engine that synchronizes the device around
    its gathers)."""
    overlap_cp_exchange: bool = True
    """Context-parallel key/value transfers overlap the attention computed meanwhile (the
    ring steps of Megatron-Core's p2p exchange and of PyTorch's ring attention)."""
    blocking_p2p: bool = True
    """Pipeline sends hold the sending rank until they complete (batched send/recv)."""
    pipeline_send: str = "whole"
    """How tensor-parallel ranks pass a stage's activation (and its gradient back) without
    sequence parallelism: 'whole' (each sends the whole tensor to its counterpart in the
    next stage: Megatron-Core, torch.distributed.pipelining with DTensor) or
    'scatter_gather' (each sends 1/t of it and the receivers all-gather it over their
    tensor-parallel group: Megatron-LM 2021's scatter/gather, DeepSpeed's PartitionedTensor).
    Under sequence parallelism each rank sends its sequence shard either way."""
    cuda_context_bytes: float = 0.6 * GiB
    """Driver context, kernel images and library handles per GPU (outside the allocator)."""
    nccl_bytes_per_group: float = 0.25 * GiB
    """NCCL buffers per communicator a rank belongs to (tensor, data, pipeline groups)."""
    allocator_fragmentation: float = 0.08
    """Share of the dynamic working set (activations, temporaries) the caching allocator
    cannot hand out again (fragmentation and rounding)."""
    sources: dict = field(default_factory=dict, compare=False, hash=False)
    """Where each figure comes from (field name -> citation)."""

    def validate(self) -> "Stack":
        """The one place a stack's values are checked."""
        if self.attention not in ATTENTION_KERNELS:
            raise ConfigError(f"stack {self.name}.attention", f"{self.attention!r} is not one of "
                              f"{list(ATTENTION_KERNELS)}")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("float",) and (not isinstance(v, (int, float)) or v < 0 or v != v):
                raise ConfigError(f"stack {self.name}.{f.name}", f"must be a finite number >= 0, got {v!r}")
        if self.traffic_where not in TRAFFIC_WHERE:
            raise ConfigError(f"stack {self.name}.traffic_where",
                              f"{self.traffic_where!r} is not one of {list(TRAFFIC_WHERE)}")
        if self.pipeline_send not in PIPELINE_SENDS:
            raise ConfigError(f"stack {self.name}.pipeline_send",
                              f"{self.pipeline_send!r} is not one of {list(PIPELINE_SENDS)}")
        if self.sharded_grad_collective not in GRAD_COLLECTIVES:
            raise ConfigError(f"stack {self.name}.sharded_grad_collective",
                              f"{self.sharded_grad_collective!r} is not one of {list(GRAD_COLLECTIVES)}")
        if not self.fp8_linears:
            for name in ("fp8_cast_bytes_per_activation", "fp8_cast_bytes_per_weight",
                         "fp8_cast_kernels_per_activation", "fp8_cast_kernels_per_weight"):
                if getattr(self, name):
                    raise ConfigError(f"stack {self.name}.{name}", "is set but fp8_linears is false",
                                      "set fp8_linears to true, or drop the fp8 cast figures")
        if self.activation_traffic_scale <= 0:
            raise ConfigError(f"stack {self.name}.activation_traffic_scale",
                              f"must be > 0, got {self.activation_traffic_scale}")
        if self.zero3_gather_unit not in ZERO3_GATHER_UNITS:
            raise ConfigError(f"stack {self.name}.zero3_gather_unit",
                              f"must be one of {', '.join(ZERO3_GATHER_UNITS)}, got {self.zero3_gather_unit!r}")
        for name in ("weights_sharded_from_zero", "reduce_every_micro_batch_from_zero", "pipeline_max_zero"):
            if not 1 <= getattr(self, name) <= 3:
                raise ConfigError(f"stack {self.name}.{name}", f"must be a ZeRO stage 1-3, got {getattr(self, name)!r}")
        if self.allocator_fragmentation >= 1:
            raise ConfigError(f"stack {self.name}.allocator_fragmentation",
                              f"must be < 1, got {self.allocator_fragmentation}")
        return self

    @property
    def fp8_cast(self) -> tuple[float, float, float, float] | None:
        """The fp8 linears' casts: (bytes per activation element, per weight element, kernels
        per activation, per weight); None when the linears run in the plan's dtype (see
        ``costmodel.compute``)."""
        if not self.fp8_linears:
            return None
        return (self.fp8_cast_bytes_per_activation, self.fp8_cast_bytes_per_weight,
                self.fp8_cast_kernels_per_activation, self.fp8_cast_kernels_per_weight)

    @property
    def traffic(self) -> tuple[float, float, float] | None:
        """(activation traffic scale, forward and backward weight traffic in bytes per
        parameter per micro-batch); None where the stack moves what the zoo's layers move
        (see ``costmodel.compute``)."""
        t = (self.activation_traffic_scale, self.weight_cast_traffic_bytes_per_param,
             self.weight_grad_traffic_bytes_per_param)
        return None if t == (1.0, 0.0, 0.0) else t

    def traffic_for(self, dp: int, zero: int, pp: int, tp: int = 1, ep: int = 1, schedule: str = "1f1b",
                    dtype: str = "bf16") -> tuple[float, float, float] | None:
        """``traffic`` where it applies to a plan with these degrees (``dp``: data-parallel
        shards, context ranks included) computing in ``dtype``, else None. Autocast traffic
        needs a half-precision plan: an fp32 plan runs its weights uncast."""
        if self.traffic_where == "autocast" and not self.computes_under_autocast(dp, zero, pp, tp, ep, schedule,
                                                                                 dtype):
            return None
        return self.traffic

    @property
    def autocasts(self) -> bool:
        """Whether any plan computes under autocast on this stack (autoplan's runtime: the
        stack whose traffic applies where it autocasts, ``traffic_where`` 'autocast')."""
        return self.traffic_where == "autocast"

    def computes_under_autocast(self, dp: int, zero: int, pp: int, tp: int = 1, ep: int = 1,
                                schedule: str = "1f1b", dtype: str = "bf16") -> bool:
        """Whether a plan with these degrees computes its layers under autocast on fp32
        weights on this stack: one that ``autocasts`` does for a half-precision plan without
        an FSDP-family wrapper (``autoplan.data_parallel``). Its traffic and its host's
        kernel count (``costmodel.host.layer_host_kernels``) follow."""
        if not self.autocasts or dtype not in ("bf16", "fp16"):
            return False
        from autoplan.data_parallel import runs_under_autocast
        return runs_under_autocast(dp, zero, pp, tp, schedule, ep)

    @property
    def least_traffic(self) -> tuple[float, float, float] | None:
        """The traffic every plan pays (lower bounds may count on it)."""
        return self.traffic if self.traffic_where == "always" else None

    def full_recompute_time(self, timing) -> float:
        """Extra backward seconds of one layer under full recomputation on this stack, from its
        ``costmodel.compute.LayerTiming``."""
        if self.recompute_early_stop and timing.recompute_early_stop is not None:
            return timing.recompute_early_stop
        return timing.forward

    @property
    def spec_attention(self) -> str:
        """The zoo's attention implementation whose saved tensors this stack's kernel has."""
        return "math" if self.attention == "math" else "flash"

    def padded_vocab(self, vocab: int, tp: int = 1) -> int:
        """The vocabulary size this stack builds for a model's ``vocab`` at tensor-parallel
        size ``tp`` (a multiple of ``vocab_multiple`` x tp, Megatron-LM's rule)."""
        step = self.vocab_multiple * tp if self.vocab_multiple > 1 else 1
        return -(-vocab // step) * step

    def model_kernels(self) -> dict:
        """The model-config fields that make the zoo measure a layer as this stack runs it
        (``TransformerConfig``'s attention, ``fused_*`` kernels and ``fp32_loss``)."""
        from autoplan.models.config import STACK_KERNELS
        return {"attention": self.spec_attention, **{k: getattr(self, k) for k in STACK_KERNELS}}

    def grad_reduce_kind(self, zero: int) -> str:
        """The collective that reduces gradients over the data-parallel group at ZeRO stage
        ``zero`` (the ZeRO-3 per-unit reduce-scatter is not this one's business)."""
        if zero == 0:
            return "all_reduce"
        return self.sharded_grad_collective if zero < 3 else "reduce_scatter"

    def pipeline_send_shape(self, tp: int, sequence_parallel: bool) -> tuple[bool, bool]:
        """(each tensor-parallel rank sends 1/tp of a stage's activation, the receivers
        all-gather it) for a stage of ``tp`` ranks (see ``pipeline_send``)."""
        if tp == 1 or sequence_parallel:
            return True, False
        return (True, True) if self.pipeline_send == "scatter_gather" else (False, False)

    def casts_all_weights(self, dp: int, zero: int, pp: int, tp: int = 1, ep: int = 1, schedule: str = "1f1b",
                          dtype: str = "bf16") -> bool:
        """Whether the half-precision compute copy (``weight_cast_bytes_per_param``) of a plan
        with these degrees covers every parameter, the embedding tables too: FSDP's mixed
        precision gathers them all, where autocast casts only the weights a matmul reads.
        autoplan's runtime: its FSDP-family wrappers (``autoplan.data_parallel``); another
        stack with a compute copy: FSDP from ZeRO-1 on over more than one rank."""
        if not self.weight_cast_bytes_per_param:
            return False
        if self.autocasts:
            from autoplan.data_parallel import runs_under_autocast
            return not runs_under_autocast(dp, zero, pp, tp, schedule, ep)
        return dp > 1 and self.realized_zero(zero, pp) >= 1

    def realized_zero(self, zero: int, pp: int) -> int:
        """The ZeRO stage a plan at stage ``zero`` with ``pp`` pipeline stages runs at on
        this stack (see ``pipeline_max_zero``)."""
        return min(zero, self.pipeline_max_zero) if pp > 1 else zero

    @property
    def state_parts(self) -> tuple[tuple[float, int], tuple[float, int], tuple[float, int]]:
        """(bytes per parameter, the ZeRO stage from which a rank keeps only its 1/dp shard) of
        the weights, the gradients, and the master weights with the optimizer moments: the one
        place that says which stage shards what."""
        return ((self.weights_bytes_per_param, self.weights_sharded_from_zero),
                (self.gradient_bytes_per_param + self.half_gradient_bytes_per_param, 2),
                (self.master_weights_bytes_per_param + self.optimizer_bytes_per_param, 1))

    def state_bytes_per_param(self, dp: int, zero: int) -> float:
        """Bytes of weights, gradients and optimizer state per parameter on one rank at the
        (realized) ZeRO stage ``zero``."""
        return sum(b / (dp if zero >= stage else 1) for b, stage in self.state_parts)

    def to_dict(self) -> dict:
        out = {"schema_version": SCHEMA_VERSION}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in _FILE_UNITS:
                v = v / _FILE_UNITS[f.name]
            out[_FILE_KEYS.get(f.name, f.name)] = dict(v) if isinstance(v, dict) else v
        return out

    @classmethod
    def from_dict(cls, data: dict, where: str = "stack") -> "Stack":
        r = FieldReader(data, where)
        keys = {_FILE_KEYS.get(f.name, f.name): f for f in fields(cls)}
        r.reject_unknown(["schema_version", "base", *keys])
        version = r.int("schema_version", SCHEMA_VERSION)
        if version > SCHEMA_VERSION:
            raise ConfigError(r.path("schema_version"), f"{version} is newer than this autoplan "
                              f"understands ({SCHEMA_VERSION})", "upgrade autoplan")
        values = {}
        if r.has("base"):
            # A variant of another stack (a precision recipe of the same software): the base's
            # figures and sources, each one the file sets replacing the base's.
            base_name = r.str("base")
            if base_name == data.get("name"):
                raise ConfigError(r.path("base"), "names the stack itself", "name the stack this one varies")
            try:
                base = get_stack(base_name)
            except ConfigError as e:
                raise ConfigError(r.path("base"), e.problem, e.fix) from None
            set_here = {f.name for key, f in keys.items() if r.has(key)}
            values = {f.name: getattr(base, f.name) for f in fields(cls)
                      if f.name not in ("name", "description", "version", "sources")}
            values["sources"] = {k: v for k, v in base.sources.items()
                                 if keys.get(k) is None or keys[k].name not in set_here}
        for key, f in keys.items():
            if not r.has(key):
                if f.name in ("name", "description", "version"):
                    raise ConfigError(r.path(key), "is required but missing")
                continue
            if f.type == "bool":
                values[f.name] = r.bool(key)
            elif f.type == "int":
                values[f.name] = r.int(key, minimum=_INT_MINIMUM.get(f.name, 1))
            elif f.type == "str":
                values[f.name] = r.str(key, choices=_STR_CHOICES.get(f.name))
            elif f.type == "dict":
                sub = r.sub(key)
                values[f.name] = {**values.get(f.name, {}), **{k: sub.str(k) for k in sub.data}}
            else:
                values[f.name] = r.float(key, minimum=0.0) * _FILE_UNITS.get(f.name, 1)
        return cls(**values).validate()


_STR_CHOICES = {"attention": ATTENTION_KERNELS, "sharded_grad_collective": GRAD_COLLECTIVES,
                "pipeline_send": PIPELINE_SENDS,
                "traffic_where": TRAFFIC_WHERE}
"""Text fields and the values they accept."""
_INT_MINIMUM = {"zero3_kernels_per_rank": 0}
"""Whole-number fields that may be 0 (the others count from 1)."""
_FILE_KEYS = {"cuda_context_bytes": "cuda_context_GiB", "nccl_bytes_per_group": "nccl_MiB_per_group",
              "dp_buffer_bytes": "dp_buffer_MiB", "forward_host_s_per_kernel": "forward_host_us_per_kernel",
              "host_s_per_kernel": "host_us_per_kernel", "host_s_per_step": "host_ms_per_step",
              "zero3_host_s_per_rank": "zero3_host_us_per_rank"}
"""Fields whose file key carries a unit other than bytes."""
_FILE_UNITS = {"cuda_context_bytes": GiB, "nccl_bytes_per_group": MiB, "dp_buffer_bytes": MiB,
               "forward_host_s_per_kernel": 1e-6, "host_s_per_kernel": 1e-6, "host_s_per_step": 1e-3,
               "zero3_host_s_per_rank": 1e-6}


def stack_names() -> list[str]:
    """Names of the stacks shipped with autoplan."""
    return sorted(p.stem for p in STACK_DIR.glob("*.json"))


@lru_cache(maxsize=32)
def _load(path: str) -> Stack:
    p = Path(path)
    return Stack.from_dict(load_json(p, "stack file"), where=p.name)


def get_stack(stack: "str | Stack | None" = None) -> Stack:
    """A stack by name (``autoplan``, ``megatron-core``, ...), by path to a stack JSON file,
    or passed through; None is the default (autoplan's own runtime)."""
    if isinstance(stack, Stack):
        return stack
    name = DEFAULT_STACK if stack is None else stack
    if not isinstance(name, str):
        raise ConfigError("stack", f"must be a stack name or a path, got {type(name).__name__}")
    if name.endswith(".json"):
        return _load(str(Path(name).resolve()))
    path = STACK_DIR / f"{name}.json"
    if not path.is_file():
        known = stack_names()
        hint = closest(name, known)
        raise ConfigError("stack", f"{name!r} is not a known training stack",
                          (hint + " " if hint else "") + f"known: {', '.join(known)}; or a path to a stack .json")
    return _load(str(path))
