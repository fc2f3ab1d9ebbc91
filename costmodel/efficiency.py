"""How close real kernels come to a device's spec-sheet peaks, when no measured profile
says otherwise. Each figure is a property of the hardware and library generation, fitted
to kernel measurements (never to the end-to-end training runs the cost model is checked
against); measured profiles and calibrations override them.

Sources of the defaults:
* H100: ``benchmarks/results/gpu/h100/`` (``python benchmarks/gpu_kernels.py``, H100 SXM
  80GB, PyTorch 2.11, cuBLAS of CUDA 13): 330 bf16 GEMMs fitted by ``gemm_time``'s model
  give matmul 0.72, k_half 63, memory 0.78 (mean |error| 5.6% over the transformer
  shapes); ``gemm_alignment.csv`` of the same directory (``--families gemm_alignment``): a
  linear layer whose width is not a multiple of 8 (GPT-2's 50,257-token head) runs its
  forward, input- and weight-gradient GEMMs at 0.128 of peak together (median over 18
  shapes, 0.107-0.133; their padded twins 0.73), cuBLAS then taking kernels without
  16-byte loads: 0.18 of the aligned rate; PyTorch SDPA (FlashAttention-2 kernels) reaches 0.30 of peak forward and 0.27
  backward (median, seq >= 2048); elementwise kernels move 0.87 of HBM bandwidth.
  FlashAttention-3 reaches 0.6-0.75 of the H100's peak forward (Shah et al. 2024, Fig. 5)
  and about 0.5 backward; cuDNN / Transformer Engine kernels are of that class.
* Kernels of FlashAttention's first generation (FlashAttention up to 1.0, its Triton port)
  run at half the speed of FlashAttention-2's class: FlashAttention-2 is "around 2x"
  faster, FlashAttention reaching 25-40% of the A100's peak forward where FlashAttention-2
  reaches 50-73% (Dao 2023, arXiv:2307.08691, abstract). Measured on A100; other devices are
  assumed alike (on H100 the published llm-foundry rows suggest a smaller gap).
* A100: cuBLAS bf16 GEMMs of transformer shapes reach ~80% of 312 TFLOP/s; FlashAttention-2
  (Dao 2023, Fig. 4-5) 50-73% forward, ~60% backward at head dim 128. No fallback rate for
  rows that are not 16-byte aligned: none was measured on an A100 here, and the H100's is a
  ratio to Hopper's own aligned kernels (TMA and wgmma), which Ampere lacks. That there is
  one BigScience's 2022 sweep shows (Megatron-DeepSpeed, explicit attention): its runs whose head
  size is not a multiple of 8 took 52% longer than predicted on average against 18% for the
  rest, and the same layout at hidden 14,400 (heads not a multiple of 8 wide) against 13,824
  ran 221 s against 160 s (train/tr11-176B-ml/chronicles-prequel.md, 02-20), 1.38x where the
  model gives 1.09x (1.10x at 96 heads).
* H200: the H100's figures (the same GH100 compute die with more, faster HBM); not measured
  on an H200 here.
* V100 / T4 / MI: assumed, not measured here: fractions of peak in the range vendor GEMM
  benchmarks report for those generations; the T4's 70 W power limit holds its sustained
  tensor-core clock far below the 1590 MHz boost the 65 TFLOP/s peak assumes. The AMP GPT-2
  layer profiles on T4 and V100 (``benchmarks/published/data``) check them, host-bound as
  those layers are.
* CPU (a CPU process standing in for a GPU in tests): assumed; CI's measured CPU profiles
  (``autoplan/data/profiles``) and calibrations replace it wherever they apply.
* Families without an entry (L4, L40S, A10G, RTX 4090, ...) take the dataclass defaults, an
  A100-like assumption, not a measurement.
* bandwidth-bound kernels reach 70-90% of HBM bandwidth (STREAM-like copies).
* NCCL ring collectives reach ~80-90% of the link's per-direction bandwidth (the
  "bus bandwidth" of nccl-tests) for large messages.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class Efficiency:
    """Achievable fractions of a device's peaks."""

    matmul: float = 0.80
    """Largest GEMMs: achieved / peak FLOP/s."""
    attention_fwd: float = 0.60
    """Fused attention forward: achieved / peak."""
    attention_bwd: float = 0.50
    """Fused attention backward: achieved / peak."""
    memory: float = 0.80
    """Bandwidth-bound kernels: achieved / HBM bandwidth."""
    network: float = 0.85
    """Large collectives: achieved / link bandwidth."""
    launch_s: float = 4e-6
    """Fixed cost per kernel launch (host + GPU scheduling), seconds."""
    tile: int = 128
    """Output tile side of the GEMM kernels (wave quantization)."""
    k_half: float = 64.0
    """Reduction length at which a GEMM reaches half its large-k efficiency."""
    split_k_min: float = 512.0
    """Shortest reduction slice a split-K / stream-K GEMM gives one SM (0: no splitting)."""
    unaligned_matmul: float = 1.0
    """Rate of a linear layer's GEMM whose weight rows are not 16-byte aligned (a width not a
    multiple of 8 in 2-byte types, an unpadded vocabulary head) relative to ``matmul``; it is
    flat in the shape (1: as aligned, where not measured)."""
    flash3_fwd: float = 0.0
    """Hopper-specific fused attention (FlashAttention-3, cuDNN) forward; 0 = as attention_fwd."""
    flash3_bwd: float = 0.0
    """... and backward; 0 = as attention_bwd."""

    def attention(self, kernel: str) -> tuple[float, float]:
        """(forward, backward) efficiency of a fused attention kernel class ('flash1', 'flash2'
        or 'flash3'; see autoplan.stacks.ATTENTION_KERNELS)."""
        if kernel == "flash3" and self.flash3_fwd:
            return self.flash3_fwd, self.flash3_bwd or self.attention_bwd
        if kernel == "flash1":
            return self.attention_fwd / FLASH1_SLOWDOWN, self.attention_bwd / FLASH1_SLOWDOWN
        return self.attention_fwd, self.attention_bwd


FLASH1_SLOWDOWN = 2.0
"""How many times slower a first-generation FlashAttention kernel runs than FlashAttention-2's
class (Dao 2023, abstract: "around 2x"; see the module docstring)."""


_BY_FAMILY = {
    "A100": Efficiency(matmul=0.80, attention_fwd=0.62, attention_bwd=0.52),
    "H100": Efficiency(matmul=0.72, k_half=63.0, memory=0.78, attention_fwd=0.30, attention_bwd=0.27,
                       flash3_fwd=0.60, flash3_bwd=0.45, launch_s=3e-6, unaligned_matmul=0.18),
    "H200": Efficiency(matmul=0.72, k_half=63.0, memory=0.78, attention_fwd=0.30, attention_bwd=0.27,
                       flash3_fwd=0.60, flash3_bwd=0.45, launch_s=3e-6, unaligned_matmul=0.18),
    "V100": Efficiency(matmul=0.75, attention_fwd=0.45, attention_bwd=0.35, launch_s=5e-6),
    "T4": Efficiency(matmul=0.60, attention_fwd=0.40, attention_bwd=0.30, memory=0.75, launch_s=6e-6),
    "MI": Efficiency(matmul=0.55, attention_fwd=0.35, attention_bwd=0.30, launch_s=6e-6),
    # A CPU "device" runs eager PyTorch kernels whose fixed cost dominates small layers.
    "CPU": Efficiency(matmul=0.5, attention_fwd=0.3, attention_bwd=0.3, memory=0.5, network=0.5,
                      launch_s=1e-5, tile=1),
}


@lru_cache(maxsize=1024)   # pure in the name; the collectives ask once per rank per call
def default_efficiency(device_name: str) -> Efficiency:
    """The defaults for a device family, matched on the catalog name's prefix."""
    upper = device_name.upper()
    for prefix, eff in _BY_FAMILY.items():
        if upper.startswith(prefix):
            return eff
    return Efficiency()


def achieved_memory_bandwidth(device) -> float:
    """Bytes per second a bandwidth-bound pass (optimizer step, copies) moves on ``device``:
    its HBM bandwidth at the family's memory efficiency."""
    return device.memory_bandwidth * default_efficiency(device.name).memory
