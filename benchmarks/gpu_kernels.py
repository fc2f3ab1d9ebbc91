"""Measure the kernels the cost model's roofline stands in for, on the GPU at hand.

Four families, each timed with CUDA events (median of repeats after warm-up, L2 flushed
between repeats):

* **GEMMs** (``torch.mm`` in the chosen dtype): square sizes, the shapes transformer
  layers run (tokens x hidden x width at several tensor-parallel shards, forward, input
  gradient and weight gradient), and the awkward ones -- small outputs with long
  reductions (weight gradients of narrow layers, Swin's early stages), thin token counts.
  These are what ``costmodel.compute.gemm_time`` models (tiles, waves, split-K).
* **fused attention** (``F.scaled_dot_product_attention``, flash backend) forward and
  backward at head dims 64/128 and sequence lengths 1k-16k, causal and not.
* **bandwidth-bound kernels**: copy, add, GELU, RMSNorm, softmax, cross-entropy, dropout
  and an eager bias-dropout-add over large tensors (bytes moved / time).
* **alignment**: linear layers whose width is not a multiple of 8 (an unpadded vocabulary
  head) beside padded ones, in the three orientations autograd runs them.

Writes ``gemm.csv``, ``gemm_alignment.csv``, ``attention.csv``, ``bandwidth.csv`` and
``environment.json`` to
``--out``. These files are *fitting* data for the device's efficiency constants
(``costmodel/efficiency.py``); the published end-to-end runs the cost model is checked
against are never used to fit them.

    python benchmarks/gpu_kernels.py --out benchmarks/results/gpu/h100
"""
from __future__ import annotations

import argparse
import csv
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def timed(fn, repeats: int = 20, warmup: int = 5, min_time_s: float = 0.05, flush=None) -> float:
    """Median seconds of ``fn`` over repeats (each bracketed by CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times: list[float] = []
    total = 0.0
    while len(times) < repeats or (total < min_time_s and len(times) < 500):
        if flush is not None:
            flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        t = start.elapsed_time(end) / 1e3
        times.append(t)
        total += t
    return statistics.median(times)


class Flush:
    """Overwrite a buffer twice the L2 size so every timed call starts with a cold cache."""

    def __init__(self):
        props = torch.cuda.get_device_properties(0)
        l2 = int(getattr(props, "L2_cache_size", 50 * 2 ** 20) or 50 * 2 ** 20)
        self.buf = torch.empty(2 * l2 // 4, dtype=torch.float32, device="cuda")

    def __call__(self):
        self.buf.fill_(1.0)


def gemm_shapes() -> list[tuple[str, int, int, int]]:
    """(family, m, n, k) for C[m, n] = A[m, k] @ B[k, n]."""
    shapes = []
    for s in (256, 512, 1024, 2048, 4096, 8192, 16384):
        shapes.append(("square", s, s, s))
    # Transformer linears: tokens t = micro-batch x sequence, hidden h, width w (sharded by tp).
    for h, ffn in ((2048, 8192), (4096, 14336), (8192, 28672), (12288, 49152)):
        for tokens in (2048, 4096, 8192, 16384):
            for tp in (1, 2, 4, 8):
                w = ffn // tp
                q = h // tp
                shapes += [("fwd", tokens, w, h), ("fwd", tokens, h, w),        # up / down projection
                           ("fwd", tokens, q, h),                               # q or o projection shard
                           ("wgrad", h, w, tokens), ("wgrad", w, h, tokens)]    # weight gradients: k = tokens
    # Long reductions with small outputs: cuBLAS runs these split-K / stream-K.
    for mn in ((16, 16), (48, 16), (64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (384, 96),
               (512, 512), (768, 768), (1024, 1024)):
        for k in (8192, 32768, 82944, 262144, 1048576):
            shapes.append(("long-k", mn[0], mn[1], k))
    # Few tokens (small micro-batch x short sequence) against wide weights.
    for m in (1, 8, 32, 128, 512):
        for h in (4096, 8192):
            shapes.append(("thin-m", m, 4 * h, h))
    # Swin-B like: many tokens, narrow channels (stage 1: 128 ch, MLP 512).
    for tokens in (200704, 401408, 802816):
        shapes += [("narrow", tokens, 512, 128), ("narrow", tokens, 128, 512), ("narrow-wgrad", 128, 512, tokens),
                   ("narrow-wgrad", 512, 128, tokens)]
    seen, out = set(), []
    for s in shapes:
        if s[1:] not in seen:
            seen.add(s[1:])
            out.append(s)
    return out


def measure_gemms(dtype: torch.dtype, flush, max_bytes: float) -> list[dict]:
    rows = []
    for family, m, n, k in gemm_shapes():
        nbytes = (m * k + k * n + m * n) * torch.tensor([], dtype=dtype).element_size()
        if nbytes > max_bytes:
            continue
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(k, n, device="cuda", dtype=dtype)
        t = timed(lambda: torch.mm(a, b), flush=flush)
        rows.append({"family": family, "m": m, "n": n, "k": k, "seconds": t,
                     "tflops": 2 * m * n * k / t / 1e12, "bytes": nbytes, "gbps": nbytes / t / 1e9})
        del a, b
    torch.cuda.empty_cache()
    return rows


def alignment_shapes() -> list[tuple[int, int, int]]:
    """(tokens, hidden, width) of linear layers whose width is or is not a multiple of 8:
    vocabulary heads as models define them (GPT-2's 50,257, a 32,001-token vocabulary)
    beside the padded widths engines round them to, and a plain linear one wider."""
    return [(tokens, hidden, width)
            for tokens in (4096, 16384)
            for hidden in (1024, 2560, 4096)
            for width in (50257, 50304, 32001, 32000, 4097, 4096)]


def measure_alignment(dtype: torch.dtype, flush) -> list[dict]:
    """A linear layer's three GEMMs as autograd runs them (forward ``F.linear(x, W)``, input
    gradient ``dy @ W``, weight gradient ``dy.T @ x``), with W of shape (width, hidden):
    where width is not a multiple of 8 no operand row is 16-byte aligned and cuBLAS falls
    back to kernels without the aligned loads."""
    rows = []
    for tokens, hidden, width in alignment_shapes():
        x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
        w = torch.randn(width, hidden, device="cuda", dtype=dtype)
        dy = torch.randn(tokens, width, device="cuda", dtype=dtype)
        for gemm, fn in (("fwd", lambda: F.linear(x, w)), ("dgrad", lambda: dy @ w),
                         ("wgrad", lambda: dy.t() @ x)):
            t = timed(fn, flush=flush)
            rows.append({"gemm": gemm, "tokens": tokens, "hidden": hidden, "width": width,
                         "aligned": int(width % 8 == 0), "seconds": t,
                         "tflops": 2 * tokens * hidden * width / t / 1e12})
        del x, w, dy
    torch.cuda.empty_cache()
    return rows


def measure_attention(dtype: torch.dtype, flush) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rows = []
    for d in (64, 128):
        for s in (1024, 2048, 4096, 8192, 16384):
            heads = 4096 // d if s <= 8192 else 2048 // d
            batch = max(1, 16384 // s)
            for causal in (True, False):
                q, k, v = (torch.randn(batch, heads, s, d, device="cuda", dtype=dtype, requires_grad=True)
                           for _ in range(3))
                try:
                    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                        fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), flush=flush)
                        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        g = torch.randn_like(out)

                        def both():
                            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                            torch.autograd.grad(o, (q, k, v), g)
                        total = timed(both, flush=flush)
                except RuntimeError as e:  # no flash kernel for this shape / dtype
                    print(f"  attention d={d} s={s}: {e}", file=sys.stderr)
                    continue
                # FLOPs of the full s x s work (4 b h s^2 d forward; backward 2.5x), halved when causal.
                flops_f = 4 * batch * heads * s * s * d * (0.5 if causal else 1.0)
                bwd = max(total - fwd, 1e-9)
                rows.append({"head_dim": d, "seq": s, "heads": heads, "batch": batch, "causal": causal,
                             "fwd_s": fwd, "bwd_s": bwd, "fwd_tflops": flops_f / fwd / 1e12,
                             "bwd_tflops": 2.5 * flops_f / bwd / 1e12})
                del q, k, v
    torch.cuda.empty_cache()
    return rows


def measure_bandwidth(dtype: torch.dtype, flush) -> list[dict]:
    rows = []
    for numel in (2 ** 22, 2 ** 24, 2 ** 26, 2 ** 28):
        x = torch.randn(numel, device="cuda", dtype=dtype)
        y = torch.randn(numel, device="cuda", dtype=dtype)
        e = x.element_size()
        h = 4096
        x2 = x.view(-1, h)
        w = torch.ones(h, device="cuda", dtype=dtype)
        vocab = 32768
        logits = x.view(-1, vocab)
        target = torch.randint(0, vocab, (logits.shape[0],), device="cuda")
        cases = {
            "copy": (lambda: x.clone(), 2 * numel * e),
            "add": (lambda: x + y, 3 * numel * e),
            "gelu": (lambda: F.gelu(x, approximate="tanh"), 2 * numel * e),
            "rms_norm": (lambda: F.rms_norm(x2, (h,), w), 2 * numel * e),
            "softmax": (lambda: torch.softmax(x2, dim=-1), 2 * numel * e),
            "cross_entropy_fp32": (lambda: F.cross_entropy(logits.float(), target), numel * (e + 4 + 4)),
            # Dropout draws its mask from the random state (Philox) and keeps it, one byte per element.
            "dropout": (lambda: torch.native_dropout(x, 0.1, True), numel * (2 * e + 1)),
            # Megatron's bias-dropout-add as eager PyTorch runs it (its fused kernel is not timed here).
            "bias_dropout_add": (lambda: y.view(-1, h) + F.dropout(x2 + w, 0.1, True), numel * (3 * e + 1)),
        }
        for name, (fn, nbytes) in cases.items():
            t = timed(fn, flush=flush)
            rows.append({"kernel": name, "numel": numel, "bytes": nbytes, "seconds": t, "gbps": nbytes / t / 1e9})
        del x, y
    torch.cuda.empty_cache()
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--max-gemm-GB", type=float, default=8.0, help="skip GEMMs whose operands exceed this")
    p.add_argument("--families", default="gemm,gemm_alignment,attention,bandwidth",
                   help="comma-separated kernel families to measure (each writes <family>.csv)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = DTYPES[args.dtype]
    torch.backends.cuda.matmul.allow_tf32 = True
    flush = Flush()
    props = torch.cuda.get_device_properties(0)
    env = {"device": torch.cuda.get_device_name(0), "sms": props.multi_processor_count,
           "memory_bytes": props.total_memory, "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(), "dtype": args.dtype,
           "command": "python benchmarks/gpu_kernels.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    (out / "environment.json").write_text(json.dumps(env, indent=1) + "\n")
    t0 = time.time()
    families = {"gemm": lambda: measure_gemms(dtype, flush, args.max_gemm_GB * 1e9),
                "gemm_alignment": lambda: measure_alignment(dtype, flush),
                "attention": lambda: measure_attention(dtype, flush),
                "bandwidth": lambda: measure_bandwidth(dtype, flush)}
    chosen = [f for f in args.families.split(",") if f]
    unknown = sorted(set(chosen) - set(families))
    if unknown:
        p.error(f"--families: unknown family {unknown[0]!r}; known: {', '.join(families)}")
    for name in chosen:
        rows = families[name]()
        write_csv(out / f"{name}.csv", rows)
        print(f"{name}: {len(rows)} rows ({time.time() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
