"""Mixture-of-experts feed-forward layers: top-k token-choice routing to SwiGLU experts with
stacked weights, optional shared experts, and the load-balancing loss.

Routing (``MoE.forward``): a linear gate scores every expert for every token; each token picks
its ``top_k`` experts (Mixtral, Qwen-MoE, DeepSeek). The chosen (token, expert) pairs are laid
out in a buffer of ``[num_experts, capacity, hidden]`` slots, first choices before second
choices (GShard's priority), the experts run on their slots as one batched matmul per weight,
and the outputs are added back weighted by the router probabilities.

Why token choice with a capacity rather than expert choice: token choice is what the models
this zoo describes were trained with (each token gets exactly top_k experts, so no token is
left out and none gets more), and a fixed ``capacity`` keeps every *shape* static -- the
buffer is [E, capacity, h] whatever the routing decided -- so the module still traces on
``meta`` and its all-to-all in expert parallelism has fixed sizes. Only the *values* (which
slot a token lands in) depend on the data. With ``capacity_factor=None`` (dropless) the
capacity is the token count, the largest load one expert can receive, so no token is ever
dropped; the empty slots cost compute, which the planner does not charge (it measures the
module at balanced load, capacity = tokens x top_k / experts, and applies a stated
capacity factor or the expected imbalance itself, see ``costmodel.experts``).

The load-balancing loss (Shazeer et al. 2017, Switch Transformer, Qiu et al. 2025) is
``N_E * sum_i f_i * p_i`` with ``f_i`` the fraction of selections that went to expert i and
``p_i`` the mean router probability of expert i. ``f`` is a count (no gradient), so the loss
only adds ``coeff * N_E * f_i / tokens`` to the gradient of every token's probability of
expert i. :class:`LoadBalancingLoss` adds exactly that in backward and leaves the forward
untouched (as Megatron-Core's aux-loss scaler does), so the loss needs no path to the
pipeline's last stage. Where ``f`` comes from is pluggable: this micro-batch's own counts by
default; a runtime may supply counts summed over micro-batches and data-parallel ranks (the
global-batch loss of Qiu et al.), which the backward reads when it runs.
"""
from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

TPPlan = dict[str, str]


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU MLPs with stacked weights, applied to their token slots.

    Input and output are ``[experts, slots, hidden]``; expert e computes
    ``w2[e] (silu(w3[e] x) * w1[e] x)`` on its slots with one batched matmul per weight
    (a grouped GEMM). Weights are stored as nn.Linear stores them, ``[experts, out, in]``,
    so tensor parallelism shards w1/w3 on dim 1 and w2 on dim 2, and expert parallelism
    shards all three on dim 0: a rank holding a slice of the experts gets a slice of the
    slots and runs this same code on both.
    """

    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.bmm(x, self.w1.transpose(1, 2)) * F.silu(torch.bmm(x, self.w3.transpose(1, 2)))
        return torch.bmm(h, self.w2.transpose(1, 2))


class Frequencies(Protocol):
    """Where the load-balancing loss takes its expert frequencies f from."""

    def register(self, counts: torch.Tensor) -> "FrequencyHandle": ...


class FrequencyHandle(Protocol):
    def resolve(self) -> torch.Tensor:
        """f (sums to 1) as the backward pass should use it."""
        ...


class _Fixed:
    def __init__(self, f: torch.Tensor):
        self.f = f

    def resolve(self) -> torch.Tensor:
        return self.f


class MicroBatchFrequencies:
    """f from the tokens of this call alone (the micro-batch on this rank): the load-balancing
    loss as GShard and Megatron-Core's ``aux_loss`` compute it."""

    def register(self, counts: torch.Tensor) -> _Fixed:
        return _Fixed(counts / counts.sum().clamp_min(1))


class _AttachBalanceGradient(torch.autograd.Function):
    """Identity on ``out``; in backward, d(coeff * LBL)/d(probs) = coeff * N_E * f / tokens,
    with f read from ``handle`` at that moment, times the module's gradient scale."""

    @staticmethod
    def forward(ctx, out, probs, handle, balance):
        ctx.handle, ctx.balance, ctx.tokens = handle, balance, probs.shape[0]
        ctx.probs_dtype = probs.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        b = ctx.balance
        f = ctx.handle.resolve().to(ctx.probs_dtype)
        g = (b.coeff * b.num_experts * b.grad_scale / ctx.tokens) * f
        return grad_out, g.expand(ctx.tokens, -1), None, None


class LoadBalancingLoss(nn.Module):
    """Adds the gradient of ``coeff * N_E * sum_i f_i * p_i`` to the router probabilities.

    ``frequencies`` supplies f (default: this micro-batch's counts). ``grad_scale`` multiplies
    the added gradient: a runtime that divides each micro-batch's loss by the number of
    micro-batches sets it to the same factor, so the loss enters the gradient exactly as if
    it were part of the mean training loss. When ``records`` is a list (a runtime sets it;
    None keeps nothing), every call appends (p, f handle), so the loss's *value* can be
    computed once f is final (:meth:`value`); :meth:`reset` starts a new step."""

    def __init__(self, num_experts: int, coeff: float):
        super().__init__()
        self.num_experts = num_experts
        self.coeff = coeff
        self.grad_scale = 1.0
        self.frequencies: Frequencies = MicroBatchFrequencies()
        self.records: list[tuple[torch.Tensor, FrequencyHandle]] | None = None

    def forward(self, out: torch.Tensor, probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            # Nothing to balance without a backward (evaluation, a pipeline's shape
            # inference). A forward re-run inside backward (activation recomputation) only
            # rebuilds saved tensors; the gradient goes through the first run's graph, which
            # has its frequencies already, so counting again would count this micro-batch twice.
            return out
        handle = self.frequencies.register(counts)
        if self.records is not None and not probs.is_meta:
            self.records.append((probs.detach().mean(0), handle))
        if self.coeff <= 0:
            return out
        return _AttachBalanceGradient.apply(out, probs, handle, self)

    def value(self) -> float | None:
        """Mean over this step's calls of N_E * sum_i f_i * p_i (None before any call)."""
        if not self.records:
            return None
        vals = [float(self.num_experts * (h.resolve().to(p.dtype) * p).sum()) for p, h in self.records]
        return sum(vals) / len(vals)

    def reset(self) -> None:
        if self.records is not None:
            self.records.clear()


class MoE(nn.Module):
    """Routed experts (top-k token choice), plus shared experts when ``shared_ffn_hidden`` > 0.

    ``gate`` scores experts; ``experts`` are the routed SwiGLU experts; ``shared`` (optional)
    is a dense SwiGLU MLP every token also passes through (DeepSeekMoE's shared experts);
    ``balance`` adds the load-balancing loss's gradient. See the module docstring for the
    routing and why it keeps shapes static."""

    def __init__(self, cfg):
        super().__init__()
        from autoplan.models.zoo.transformer import MLP

        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.capacity_factor = cfg.capacity_factor
        self.normalize_top_k = cfg.normalize_top_k
        self.gate = nn.Linear(cfg.hidden, cfg.num_experts, bias=False)
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden, cfg.moe_ffn_hidden)
        self.shared = (MLP(cfg.hidden, cfg.shared_ffn_hidden, "swiglu", bias=False)
                       if cfg.shared_ffn_hidden else None)
        self.balance = LoadBalancingLoss(cfg.num_experts, cfg.aux_loss_coeff)

    def capacity(self, tokens: int) -> int:
        """Slots per expert for a call with ``tokens`` tokens."""
        if self.capacity_factor is None:
            return tokens       # dropless: one expert may receive every token
        return max(1, min(tokens, math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])                                   # [T, h]
        tokens, experts, k = flat.shape[0], self.num_experts, self.top_k
        capacity = self.capacity(tokens)
        # The router runs in fp32 (as Megatron-Core's --moe-router-dtype fp32): the top-k
        # choice should not flip with the compute dtype's rounding.
        probs = torch.softmax(self.gate(flat).float(), dim=-1)              # [T, E]
        weight, chosen = probs.topk(k, dim=-1)                              # [T, k]
        if self.normalize_top_k:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        # Pairs in priority order: every token's first choice, then every second choice.
        expert_of = chosen.t().reshape(-1)                                   # [k T]
        token_of = torch.arange(tokens, device=x.device).repeat(k)           # [k T]
        onehot = F.one_hot(expert_of, experts)                               # [k T, E]
        counts = onehot.sum(0)                                               # selections per expert
        position = (onehot.cumsum(0) - 1).gather(1, expert_of[:, None]).squeeze(1)
        # A pair past its expert's capacity is dropped: it adds zero to slot 0 and takes
        # nothing back (masking keeps every buffer exactly [E * capacity, h]).
        keep = (position < capacity)[:, None]                                # [k T, 1]
        slot = torch.where(keep.squeeze(1), expert_of * capacity + position, torch.zeros_like(position))
        sent = flat[token_of] * keep.to(flat.dtype)
        slots = flat.new_zeros(experts * capacity, flat.shape[-1]).index_add(0, slot, sent)
        out_slots = self.experts(slots.view(experts, capacity, -1))          # [E, C, h]
        pair_weight = (weight.t().reshape(-1, 1) * keep).to(out_slots.dtype)  # [k T, 1]
        back = out_slots.reshape(experts * capacity, -1)[slot] * pair_weight
        out = flat.new_zeros(flat.shape).index_add(0, token_of, back)
        if self.shared is not None:
            out = out + self.shared(flat)
        out = self.balance(out, probs, counts)
        return out.view_as(x)

    def tp_plan(self) -> TPPlan:
        # The router stays replicated: every rank needs all expert scores. The routed
        # experts are one 'experts' module (stacked weights: w1/w3 colwise on their output
        # dim, w2 rowwise on its input dim, and split by expert under expert parallelism).
        plan: TPPlan = {"experts": "experts"}
        if self.shared is not None:
            plan.update({f"shared.{k}": v for k, v in self.shared.tp_plan().items()})
        return plan
