"""The built-in device catalog (``autoplan/data/devices.json``).

Each entry carries vendor spec-sheet figures (memory, dense peak FLOP/s per dtype,
HBM bandwidth, the typical intra-node link) and names its source. Names resolve
case-insensitively, with short aliases; an unknown name fails with the closest ones.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Mapping

from autoplan.errors import ConfigError, closest
from autoplan.fields import FieldReader
from autoplan.units import GB, GiB, TFLOPS, US

DTYPES = ("fp32", "tf32", "fp16", "bf16", "fp8")

# Bounds on spec-sheet figures: finite, and far above any device or link (a value past
# them is a typo or garbage, and would overflow once converted to SI units).
MAX_BANDWIDTH_GBps = 1e12
MAX_LATENCY_us = 1e9
MAX_MEMORY_GiB = 1e9
MAX_PEAK_TFLOPS = 1e9
MAX_COMPUTE_UNITS = 10_000_000


@dataclass(frozen=True)
class Link:
    """A point-to-point link class, per GPU and per direction."""

    bandwidth: float
    """Bytes per second, per GPU, per direction."""
    latency: float
    """Seconds for a minimal message (the alpha of the alpha-beta model)."""
    name: str = ""
    """Human label, e.g. 'NVLink 3' or '25 GbE'."""

    @classmethod
    def read(cls, r: FieldReader) -> "Link":
        r.reject_unknown(("bandwidth_GBps", "latency_us", "name"))
        return cls(bandwidth=r.float("bandwidth_GBps", positive=True, maximum=MAX_BANDWIDTH_GBps) * GB,
                   latency=r.float("latency_us", 5.0, minimum=0.0, maximum=MAX_LATENCY_us) * US,
                   name=r.str("name", ""))

    def to_dict(self) -> dict:
        d = {"bandwidth_GBps": self.bandwidth / GB, "latency_us": self.latency / US}
        if self.name:
            d["name"] = self.name
        return d


def is_accelerator(device_name: str) -> bool:
    """Whether a catalog device is an accelerator, not a CPU standing in for one (CI's gloo
    runs): it has a driver context and its own memory, and runs kernels while its host goes
    on (``costmodel.host``)."""
    return not device_name.upper().startswith("CPU")


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator type."""

    name: str
    """Canonical name, e.g. 'A100-SXM4-80GB'."""
    memory_bytes: float
    """Device memory capacity in bytes."""
    peak_flops: Mapping[str, float] = field(hash=False)
    """Dense peak FLOP/s per dtype ('fp32', 'tf32', 'fp16', 'bf16', 'fp8')."""
    memory_bandwidth: float = 0.0
    """HBM/GDDR bandwidth in bytes/s."""
    intra_node_link: Link = Link(bandwidth=16e9, latency=10e-6)
    """Typical GPU-to-GPU link inside a server of this device."""
    compute_units: int = 0
    """SMs or CUs; 0 when unknown. Used for wave quantization of small matmuls."""
    vendor: str = ""
    source: str = ""
    """Where the figures come from."""
    aliases: tuple[str, ...] = field(default=())

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for matmuls in ``dtype``, falling back to the nearest the part has
        (a V100 has no bf16 units, so bf16 work runs at its fp16 rate; lacking fp16 too, fp32)."""
        for candidate in {"bf16": ("bf16", "fp16", "fp32"), "fp16": ("fp16", "bf16", "fp32"),
                          "fp8": ("fp8", "bf16", "fp16", "fp32"), "tf32": ("tf32", "fp32"),
                          "fp32": ("fp32",)}[dtype]:
            if candidate in self.peak_flops:
                return self.peak_flops[candidate]
        raise ConfigError(f"device {self.name}", f"has no peak FLOP/s for {dtype}")

    @classmethod
    def read(cls, r: FieldReader) -> "DeviceSpec":
        r.reject_unknown(("name", "aliases", "vendor", "memory_GiB", "memory_GB",
                          "memory_bandwidth_GBps", "peak_TFLOPS", "compute_units",
                          "intra_node_link", "source"))
        if r.has("memory_GiB") == r.has("memory_GB"):
            raise ConfigError(r.path("memory_GiB"), "give exactly one of memory_GiB or memory_GB")
        memory = (r.float("memory_GiB", positive=True, maximum=MAX_MEMORY_GiB) * GiB if r.has("memory_GiB")
                  else r.float("memory_GB", positive=True, maximum=MAX_MEMORY_GiB) * GB)
        peaks_r = r.sub("peak_TFLOPS")
        peaks_r.reject_unknown(DTYPES)
        peaks = {k: peaks_r.float(k, positive=True, maximum=MAX_PEAK_TFLOPS) * TFLOPS
                 for k in DTYPES if peaks_r.has(k)}
        if not peaks:
            raise ConfigError(peaks_r.where, "needs at least one dtype", "e.g. {\"bf16\": 312}")
        link_r = r.sub("intra_node_link", None)
        link = Link.read(link_r) if link_r else Link(bandwidth=16 * GB, latency=10 * US, name="PCIe (assumed)")
        return cls(name=r.str("name"), memory_bytes=memory, peak_flops=peaks,
                   memory_bandwidth=r.float("memory_bandwidth_GBps", positive=True,
                                            maximum=MAX_BANDWIDTH_GBps) * GB,
                   intra_node_link=link,
                   compute_units=r.int("compute_units", 0, minimum=0, maximum=MAX_COMPUTE_UNITS),
                   vendor=r.str("vendor", ""), source=r.str("source", "", multiline=True),
                   aliases=tuple(r.strs("aliases", [], max_len=64)))

    def to_dict(self) -> dict:
        return {"name": self.name, "memory_GiB": self.memory_bytes / GiB,
                "memory_bandwidth_GBps": self.memory_bandwidth / GB,
                "peak_TFLOPS": {k: v / TFLOPS for k, v in self.peak_flops.items()},
                "compute_units": self.compute_units,
                "intra_node_link": self.intra_node_link.to_dict(),
                **({"vendor": self.vendor} if self.vendor else {}),
                **({"source": self.source} if self.source else {})}


@lru_cache(maxsize=1)
def _catalog() -> tuple[dict[str, DeviceSpec], list[DeviceSpec]]:
    text = resources.files("autoplan").joinpath("data/devices.json").read_text()
    root = FieldReader(json.loads(text), "devices.json")
    by_key: dict[str, DeviceSpec] = {}
    devices = []
    for r in root.items("devices"):
        dev = DeviceSpec.read(r)
        devices.append(dev)
        for key in (dev.name, *dev.aliases):
            if key.lower() in by_key:
                raise ConfigError(r.where, f"name or alias {key!r} is used twice in the catalog")
            by_key[key.lower()] = dev
    return by_key, devices


def devices() -> list[DeviceSpec]:
    """Every catalog device, in catalog order."""
    return list(_catalog()[1])


def get_device(name: str, field_name: str = "device") -> DeviceSpec:
    """Resolve a catalog name or alias, case-insensitively."""
    by_key, _ = _catalog()
    found = by_key.get(name.lower().strip())
    if found is None:
        hint = closest(name, [d.name for d in _catalog()[1]] + [k for k in by_key])
        raise ConfigError(field_name, f"unknown device {name!r}",
                          hint or "run `autoplan devices` for the catalog, or declare the device inline")
    return found
