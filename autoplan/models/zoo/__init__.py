"""The model zoo: real PyTorch modules for every architecture autoplan plans for.

Contract the planner and runtime rely on:

* ``build_model(cfg)`` returns a module whose ``layers`` (an ``nn.ModuleList``) are the
  pipeline units in order; each maps one tensor to one tensor, so
  ``nn.Sequential(*model.layers[a:b])`` is a pipeline stage, and ``model(x)`` chains them.
* every unit has ``tp_plan() -> {relative submodule name: style}`` with styles
  ``colwise``, ``rowwise`` (Megatron linear sharding), ``norm`` (replicated norm; a
  sequence-parallel region under SP), ``embedding`` (vocab-sharded token table),
  ``output`` (vocab-sharded output projection), ``head_norm`` (a replicated norm applied per
  head, to heads that tensor parallelism spreads over ranks), ``experts`` (a ``GroupedExperts``:
  stacked expert weights, sharded by expert under expert parallelism and like a Megatron
  MLP under tensor parallelism) and ``head_shared`` (a parameter-free module whose output,
  computed in full on every rank, is read by every local head: its gradient is summed
  over the tensor-parallel ranks); unlisted modules stay replicated.
* ``loss_fn(output, target)`` and ``example_inputs(cfg, batch)`` complete a training step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from autoplan.models.config import SwinConfig, TransformerConfig
from autoplan.models.zoo.swin import SwinModel
from autoplan.models.zoo.transformer import TP_STYLES, TransformerModel, init_parameters, init_rule

__all__ = ["build_model", "loss_fn", "example_inputs", "init_parameters", "init_rule", "TP_STYLES",
           "TransformerModel", "SwinModel"]


def build_model(cfg: TransformerConfig | SwinConfig) -> TransformerModel | SwinModel:
    """The module for ``cfg`` (resolved here). Build it under ``with torch.device("meta"):``
    to get shapes without memory; parameters are initialised from the global RNG."""
    if isinstance(cfg, SwinConfig):
        return SwinModel(cfg)
    if isinstance(cfg, TransformerConfig):
        return TransformerModel(cfg)
    raise TypeError(f"build_model needs a TransformerConfig or SwinConfig, got {type(cfg).__name__}")


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy. LM logits [b, s, vocab] with targets [b, s] are flattened to
    tokens; classifier logits [b, classes] with targets [b] pass through unchanged."""
    return F.cross_entropy(output.flatten(0, -2), target.flatten())


def fp32_loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``loss_fn`` on an fp32 copy of the output: half-precision logits (mixed precision) get
    their softmax and mean in fp32, as the runtime trains and most stacks do."""
    return loss_fn(output.float(), target)


def measured_loss_fn(cfg):
    """The loss as the training stack runs it, for measuring a model: on an fp32 copy of the
    logits where ``cfg.fp32_loss`` (the default; Swin configs have no such field), else on them
    as they come."""
    return fp32_loss_fn if getattr(cfg, "fp32_loss", True) else loss_fn


def example_inputs(cfg: TransformerConfig | SwinConfig, batch: int,
                   device: str | torch.device = "meta",
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) for one batch of ``batch`` samples.

    Transformers: token ids and target ids, both LongTensor [batch, seq_len] in [0, vocab).
    Swin: float images [batch, C, H, W] and class ids [batch]. On ``meta`` only the shapes
    exist; elsewhere values are drawn on the CPU (from ``generator`` if given) and moved,
    so the same generator state gives the same batch on every device.
    """
    cfg = cfg.resolved()
    device = torch.device(device)
    if isinstance(cfg, SwinConfig):
        in_shape = (batch, cfg.in_channels, cfg.image_size, cfg.image_size)
        out_shape, classes = (batch,), cfg.num_classes
    else:
        in_shape = out_shape = (batch, cfg.seq_len)
        classes = cfg.vocab
    if device.type == "meta":
        in_dtype = torch.float32 if isinstance(cfg, SwinConfig) else torch.long
        return (torch.empty(in_shape, dtype=in_dtype, device=device),
                torch.empty(out_shape, dtype=torch.long, device=device))
    if isinstance(cfg, SwinConfig):
        inputs = torch.randn(in_shape, generator=generator)
    else:
        inputs = torch.randint(0, classes, in_shape, generator=generator)
    targets = torch.randint(0, classes, out_shape, generator=generator)
    return inputs.to(device), targets.to(device)
