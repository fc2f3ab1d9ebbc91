"""How close real kernels come to a device's spec-sheet peaks, when no measured profile
says otherwise. Each figure is a property of the hardware and library generation, not
of any benchmark this project is checked against; measured profiles override them
(:mod:`autoplan.profiler` fits them per device).

Sources of the defaults:
* matmul: cuBLAS bf16 GEMMs of transformer shapes reach ~80% of the A100's 312 TFLOP/s
  and ~70% of the H100 SXM's 989 TFLOP/s (the H100 is power- and clock-limited under
  sustained tensor-core load); NVIDIA's "Deep Learning Performance" GEMM guide
  describes the tile and wave-quantization losses modelled below.
* fused attention: FlashAttention-2 (Dao, 2023) reports 50-73% of A100 peak forward and
  ~63% backward at head dim 128, and 35-50% of H100 peak (FlashAttention-3, Shah et al.
  2024, gets 75% with Hopper-specific kernels that eager PyTorch does not use).
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


_BY_FAMILY = {
    "A100": Efficiency(matmul=0.80, attention_fwd=0.62, attention_bwd=0.52),
    "H100": Efficiency(matmul=0.70, attention_fwd=0.45, attention_bwd=0.38, launch_s=3e-6),
    "H200": Efficiency(matmul=0.72, attention_fwd=0.45, attention_bwd=0.38, launch_s=3e-6),
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
