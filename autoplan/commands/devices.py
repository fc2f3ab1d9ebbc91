"""`autoplan devices`: the built-in device catalog."""
from __future__ import annotations

from autoplan.commands._common import table
from autoplan.units import GB, GiB, TFLOPS


def register(sub) -> None:
    p = sub.add_parser("devices", help="list the built-in device catalog")
    p.add_argument("--sources", action="store_true", help="also print where each figure comes from")
    p.set_defaults(func=run)


def run(args) -> int:
    from autoplan.catalog import devices
    rows = []
    for d in devices():
        peaks = " ".join(f"{k}={v / TFLOPS:g}" for k, v in d.peak_flops.items())
        rows.append([d.name, ", ".join(d.aliases), f"{d.memory_bytes / GiB:g}", f"{d.memory_bandwidth / GB:g}",
                     peaks, f"{d.intra_node_link.bandwidth / GB:g}"])
    print(table(rows, ["device", "aliases", "GiB", "HBM GB/s", "peak TFLOP/s", "link GB/s"]))
    if args.sources:
        for d in devices():
            print(f"\n{d.name}: {d.source}")
    return 0
