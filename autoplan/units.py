"""Unit constants. Inside autoplan every quantity is in SI base units
(seconds, bytes, FLOP, bytes/s); file formats carry the unit in the field name
(``bandwidth_GBps``, ``latency_us``, ``memory_GiB``) and are converted at the edge."""

GB = 1e9            # bytes; network and memory bandwidth are quoted in decimal GB/s
GiB = 2**30         # bytes; HBM capacities ("80GB") are binary in practice
MiB = 2**20
TFLOPS = 1e12       # FLOP/s
US = 1e-6           # seconds per microsecond
Gbit = 1e9 / 8      # bytes per gigabit

DTYPE_BYTES = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
