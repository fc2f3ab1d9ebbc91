"""What a profile entry is *of*: the shape key that matches a planner's :class:`LayerSpec`
to measured entries, the sharded configs a tensor-parallel rank runs, and a lossless
JSON form of LayerSpec (kept in profile files so the efficiency fit can recompute the
roofline of every measured layer).

Why the key is derived from the LayerSpec alone: the cost model asks a profile source
about one ``LayerSpec`` (``ProfileSource.layer_timing``) without the model it came from,
so everything the key needs must be in the spec. The spec is measured on ``meta`` from
the real module, so two units with the same architecture produce the same figures, and
the key is a digest of the figures that describe the *architecture* (weight shapes,
kinds and counts of kernels, per-token widths), with the sequence length taken out
and kept beside it so lookups can interpolate over it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass

from autoplan.errors import ConfigError
from autoplan.limits import MAX_EXPERTS
from autoplan.models.config import TransformerConfig
from autoplan.models.spec import ActivationBytes, ExpertSpec, Gemm, LayerSpec, RecomputePrefix, Split

TOKEN_ID_BYTES = 8
"""Bytes per input element of an embedding unit: token ids are int64."""


@dataclass(frozen=True)
class ShapeKey:
    """Identifies a layer shape independently of sequence length and micro-batch."""

    fingerprint: str
    """Digest of the sequence-independent architecture figures of the LayerSpec."""
    tokens: int
    """Tokens per sample the spec was measured at (its sequence length); 0 when the unit
    has no token dimension the key can recognise (then no interpolation over it)."""

    @property
    def id(self) -> str:
        return f"{self.fingerprint}-s{self.tokens}"


def _round(x: float) -> float:
    """Six significant digits: the figures are integer counts, but per-token ratios are
    floats and must digest identically however they were computed."""
    if x == 0 or not math.isfinite(x):
        return x
    return float(f"{x:.6g}")


def layer_tokens(layer: LayerSpec) -> int:
    """The sequence length a LayerSpec was measured at.

    Linear layers multiply ``[tokens, k] @ [k, n]`` per sample, so the ``m`` of any GEMM
    that grows with the micro-batch along ``m`` is the token count. An embedding has no
    GEMM; its input is one int64 id per token, and its full-recompute activation is
    exactly that input."""
    for g in layer.gemms_fwd:
        if g.batch_dim == "m":
            return int(round(g.m))
    if layer.kind == "embedding" and layer.activation_bytes.full.replicated > 0:
        return int(round(layer.activation_bytes.full.replicated / TOKEN_ID_BYTES))
    return 0


def _gemm_signature(g: Gemm, tokens: int) -> tuple:
    if g.batch_dim == "m":
        dims = ("s", _round(g.n), _round(g.k), _round(g.count))
    else:
        # Batched attention products: the s x s dimensions scale with the sequence.
        dims = tuple("s" if tokens and round(v) == tokens else _round(v) for v in (g.m, g.n, g.k, g.count))
    # Expert matmuls are marked only when present, so the keys of dense layers stay as they were.
    return dims + (g.shard_dim, g.batch_dim, g.in_core) + (("expert",) if g.expert else ())


def shape_key(layer: LayerSpec) -> ShapeKey:
    """The key of a LayerSpec (see the module docstring). Two specs of the same unit
    architecture at different sequence lengths share the fingerprint and differ in
    ``tokens``; anything that changes the layer's work (widths, heads, vocabulary, norm
    or MLP kind, attention kernel, dtype through the byte counts) changes the fingerprint."""
    s = layer_tokens(layer)
    per_token = (lambda x: _round(x / s)) if s else _round
    per_token2 = (lambda x: _round(x / (s * s))) if s else _round
    desc = {
        "kind": layer.kind,
        "causal": layer.causal,
        "kernels": [layer.kernels_fwd, layer.kernels_bwd],
        "tp_allreduces": layer.tp_allreduces_fwd,
        # An embedding's replicated parameters are its position table, sized by the
        # largest position, not by the positions a step looks up: leave it out.
        "params": [None if layer.kind == "embedding" else _round(layer.params.replicated),
                   _round(layer.params.sharded)],
        # A head's output is its logits, which its GEMM shapes already fix (and which specs
        # measured before the loss moved to the training stack recorded as 0).
        "output_per_token": per_token(layer.output_bytes if layer.kind != "head" else 0.0),
        "input_per_token": per_token(layer.activation_bytes.full.replicated),
        # Fused attention at equal widths still differs by head count (more, narrower heads),
        # which only what autograd keeps shows: FlashAttention saves a log-sum-exp row per
        # head. Those bytes grow exactly linearly with the sequence. (Explicit attention
        # shows its heads in the batched GEMM shapes instead; other units have no heads.)
        "saved_per_token": ([per_token(layer.activation_bytes.none.replicated),
                             per_token(layer.activation_bytes.none.sharded)]
                            if layer.attention_flops_fwd.total > 0 else None),
        "gemms": [_gemm_signature(g, s) for g in layer.gemms_fwd],
        "attention_per_token2": [per_token2(layer.attention_flops_fwd.replicated),
                                 per_token2(layer.attention_flops_fwd.sharded)],
    }
    if layer.attention_fraction != 1.0:
        # A sliding window does less attention work (keys added only when present, so the
        # fingerprints of full-attention layers stay what they were).
        desc["attention_fraction"] = _round(layer.attention_fraction)
    text = json.dumps(desc, sort_keys=True, separators=(",", ":"))
    return ShapeKey(fingerprint=hashlib.sha1(text.encode()).hexdigest()[:16], tokens=s)


# ----------------------------------------------------------------- LayerSpec <-> JSON
def spec_to_dict(layer: LayerSpec) -> dict:
    """A JSON-ready dict of every LayerSpec field (figures per sample, as in the spec)."""
    return dataclasses.asdict(layer)


def spec_from_dict(d: dict, where: str = "spec") -> LayerSpec:
    """Inverse of :func:`spec_to_dict`, validating every field (finite non-negative
    figures, known kinds and dimensions)."""
    from autoplan.fields import FieldReader

    r = FieldReader(d, where)

    def num(rr: FieldReader, key: str, default=None) -> float:
        return rr.float(key, default, minimum=0.0, maximum=1e30)

    def split(key: str, rr: FieldReader = r) -> Split:
        x = rr.sub(key)
        x.reject_unknown(("replicated", "sharded"))
        return Split(replicated=num(x, "replicated", 0.0), sharded=num(x, "sharded", 0.0))

    def gemms(key: str) -> tuple[Gemm, ...]:
        out = []
        r.list(key, max_len=100_000)
        for g in r.items(key):
            g.reject_unknown(("m", "n", "k", "count", "shard_dim", "batch_dim", "in_core", "expert"))
            out.append(Gemm(m=num(g, "m"), n=num(g, "n"), k=num(g, "k"), count=num(g, "count", 1.0),
                            shard_dim=g.str("shard_dim", "", choices=("", "m", "n", "k", "count")),
                            batch_dim=g.str("batch_dim", "m", choices=("m", "n", "k", "count")),
                            in_core=g.bool("in_core", False), expert=g.bool("expert", False)))
        return tuple(out)

    def experts(x: FieldReader | None) -> ExpertSpec | None:
        if x is None:
            return None
        x.reject_unknown(("num_experts", "top_k", "params", "activation_bytes", "dispatch_bytes", "capacity_factor"))
        return ExpertSpec(num_experts=x.int("num_experts", minimum=1, maximum=MAX_EXPERTS),
                          top_k=x.int("top_k", minimum=1, maximum=MAX_EXPERTS),
                          params=split("params", x), activation_bytes=split("activation_bytes", x),
                          dispatch_bytes=num(x, "dispatch_bytes"),
                          capacity_factor=x.float("capacity_factor", positive=True, maximum=1e6)
                          if x.has("capacity_factor") else None)

    def recompute_prefix(x: FieldReader | None) -> RecomputePrefix | None:
        if x is None:
            return None     # (specs measured before it was recorded: the whole forward)
        x.reject_unknown(("gemms", "attention_share", "memory_bytes", "kernels", "saved_tensors", "autocast_kernels"))
        return RecomputePrefix(gemms=x.int("gemms", minimum=0, maximum=100_000),
                               attention_share=x.float("attention_share", minimum=0.0, maximum=1.0),
                               memory_bytes=split("memory_bytes", x), kernels=x.int("kernels", minimum=0, maximum=10**9),
                               saved_tensors=x.int("saved_tensors", 0, minimum=0, maximum=10**9),
                               autocast_kernels=x.int("autocast_kernels", 0, minimum=0, maximum=10**9))

    act = r.sub("activation_bytes")
    act.reject_unknown(("none", "selective", "full"))
    return LayerSpec(
        name=r.str("name"), kind=r.str("kind"),
        params=split("params"), flops_fwd=split("flops_fwd"), flops_bwd=split("flops_bwd"),
        gemms_fwd=gemms("gemms_fwd"), gemms_bwd=gemms("gemms_bwd"),
        attention_flops_fwd=split("attention_flops_fwd"), attention_flops_bwd=split("attention_flops_bwd"),
        memory_bytes_fwd=split("memory_bytes_fwd"), memory_bytes_bwd=split("memory_bytes_bwd"),
        core_memory_bytes_fwd=split("core_memory_bytes_fwd"),
        kernels_fwd=r.int("kernels_fwd", minimum=0, maximum=10**9),
        kernels_bwd=r.int("kernels_bwd", minimum=0, maximum=10**9),
        # (specs measured before the autocast census recorded none: 0, the host counts the above)
        autocast_kernels_fwd=r.int("autocast_kernels_fwd", 0, minimum=0, maximum=10**9),
        autocast_kernels_bwd=r.int("autocast_kernels_bwd", 0, minimum=0, maximum=10**9),
        activation_bytes=ActivationBytes(**{k: split(k, act) for k in ("none", "selective", "full")}),
        output_bytes=num(r, "output_bytes"), tp_allreduces_fwd=r.int("tp_allreduces_fwd", minimum=0, maximum=10**6),
        causal=r.bool("causal"), experts=experts(r.sub("experts", None)),
        attention_fraction=r.float("attention_fraction", 1.0, minimum=0.0, maximum=1.0),
        recompute_prefix=recompute_prefix(r.sub("recompute_prefix", None)),
        param_tensors=r.int("param_tensors", 0, minimum=0, maximum=10**6))


# ------------------------------------------------------------------ shard configs
def shard_config(cfg: TransformerConfig, tp: int) -> TransformerConfig:
    """The config one rank of tensor-parallel degree ``tp`` runs, Megatron-style.

    Heads and MLP width must divide by ``tp``. Key/value heads divide when they can;
    when ``tp`` is a multiple of them each rank keeps one (Megatron replicates kv heads
    across the ranks of a group). The vocabulary is padded up to a multiple of ``tp``
    (Megatron pads it), so each rank holds ``ceil(vocab / tp)`` rows."""
    c = cfg.resolved()
    if tp == 1:
        return c
    if not isinstance(tp, int) or tp < 1:
        raise ConfigError("tp", f"must be a positive integer, got {tp!r}")
    if c.heads % tp:
        raise ConfigError("tp", f"{tp} does not divide {c.name}'s {c.heads} attention heads")
    if c.kv_heads % tp and tp % c.kv_heads:
        raise ConfigError("tp", f"{tp} neither divides nor is a multiple of {c.name}'s {c.kv_heads} kv heads")
    if c.ffn_hidden % tp:
        raise ConfigError("tp", f"{tp} does not divide {c.name}'s MLP width {c.ffn_hidden}")
    if c.arch == "moe" and (c.moe_ffn_hidden % tp or c.shared_ffn_hidden % tp):
        raise ConfigError("tp", f"{tp} does not divide {c.name}'s expert widths "
                          f"({c.moe_ffn_hidden}, shared {c.shared_ffn_hidden})")
    if c.kv_heads % tp == 0 and c.vocab % tp == 0:
        return c.with_shard(1 / tp).resolved()
    moe = {}
    if c.arch == "moe":
        moe = dict(moe_ffn_hidden=c.moe_ffn_hidden // tp, shared_ffn_hidden=c.shared_ffn_hidden // tp)
    return dataclasses.replace(c, heads=c.heads // tp, kv_heads=max(1, c.kv_heads // tp),
                               ffn_hidden=c.ffn_hidden // tp, vocab=-(-c.vocab // tp), **moe).resolved()


def tp_supported(cfg: TransformerConfig, tp: int) -> str:
    """'' when ``tp`` can shard ``cfg``, else why not."""
    try:
        shard_config(cfg, tp)
    except ConfigError as e:
        return e.problem
    return ""
