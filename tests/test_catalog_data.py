"""Invariants of the shipped data: the device catalog and the example clusters.

Reads the JSON files directly (json + pathlib only) so it does not depend on the
loaders in autoplan.catalog / autoplan.cluster.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CATALOG_PATH = ROOT / "autoplan" / "data" / "devices.json"
CLUSTERS_DIR = ROOT / "examples" / "clusters"

CATALOG = json.loads(CATALOG_PATH.read_text())
DEVICES = CATALOG["devices"]
BY_NAME = {d["name"]: d for d in DEVICES}
KEY_TO_NAME = {k.lower(): d["name"] for d in DEVICES for k in (d["name"], *d.get("aliases", []))}
CLUSTER_FILES = sorted(CLUSTERS_DIR.glob("*.json"))

DTYPES = {"fp32", "tf32", "fp16", "bf16", "fp8"}
DEVICE_FIELDS = {"name", "aliases", "vendor", "memory_GiB", "memory_bandwidth_GBps",
                 "peak_TFLOPS", "compute_units", "intra_node_link", "source"}
LINK_FIELDS = {"name", "bandwidth_GBps", "latency_us"}
FP8_DEVICES = {"H100-SXM5-80GB", "H100-PCIe-80GB", "H200-SXM-141GB", "L4-24GB", "L40S-48GB",
               "RTX-4090-24GB", "MI300X-OAM-192GB"}
REQUIRED_DEVICES = ["A100-SXM4-40GB", "A100-SXM4-80GB", "A100-PCIe-80GB", "H100-SXM5-80GB",
                    "H100-PCIe-80GB", "H200-SXM-141GB", "V100-SXM2-16GB", "V100-SXM2-32GB",
                    "T4-16GB", "A10G-24GB", "L4-24GB", "L40S-48GB", "RTX-4090-24GB",
                    "MI250X-OAM-128GB", "MI300X-OAM-192GB", "CPU"]
REQUIRED_CLUSTERS = ["dgx-a100-1node", "dgx-h100-8nodes", "selene-a100-128nodes", "mixed-v100-t4",
                     "mixed-a100-h100", "mixed-three-types", "cpu-4ranks", "small-mixed-v100-t4"]


def _resolve(key: str) -> dict | None:
    name = KEY_TO_NAME.get(key.lower().strip())
    return BY_NAME.get(name) if name else None


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def _device_id(d: dict) -> str:
    return d.get("name", "?")


# ------------------------------------------------------------------- catalog

def test_catalog_header():
    assert CATALOG.get("schema_version") == 1
    assert isinstance(DEVICES, list) and DEVICES


@pytest.mark.parametrize("name", REQUIRED_DEVICES, ids=REQUIRED_DEVICES)
def test_required_device_present(name):
    assert name in BY_NAME


@pytest.mark.parametrize("dev", DEVICES, ids=_device_id)
def test_device_fields(dev):
    assert set(dev) == DEVICE_FIELDS, f"fields differ: {set(dev) ^ DEVICE_FIELDS}"
    assert isinstance(dev["name"], str) and dev["name"]
    assert isinstance(dev["aliases"], list) and all(isinstance(a, str) and a for a in dev["aliases"])
    assert isinstance(dev["vendor"], str) and dev["vendor"]
    for key in ("memory_GiB", "memory_bandwidth_GBps", "compute_units"):
        assert _positive(dev[key]), f"{key} = {dev[key]!r}"
    assert isinstance(dev["compute_units"], int)
    peaks = dev["peak_TFLOPS"]
    assert isinstance(peaks, dict) and peaks and set(peaks) <= DTYPES, peaks
    assert "fp32" in peaks
    assert all(_positive(v) for v in peaks.values()), peaks
    link = dev["intra_node_link"]
    assert set(link) == LINK_FIELDS
    assert isinstance(link["name"], str) and link["name"]
    assert _positive(link["bandwidth_GBps"]) and _positive(link["latency_us"])
    assert isinstance(dev["source"], str) and len(dev["source"]) > 10


@pytest.mark.parametrize("dev", DEVICES, ids=_device_id)
def test_no_urls_or_hosts(dev):
    text = json.dumps(dev)
    assert not re.search(r"https?://|www\.|\.(com|org|net|io)\b", text, re.I), text


@pytest.mark.parametrize("dev", DEVICES, ids=_device_id)
def test_fp8_only_where_the_part_has_it(dev):
    assert ("fp8" in dev["peak_TFLOPS"]) == (dev["name"] in FP8_DEVICES)


@pytest.mark.parametrize("dev", DEVICES, ids=_device_id)
def test_low_precision_not_slower_than_fp32(dev):
    peaks = dev["peak_TFLOPS"]
    for dt in ("tf32", "fp16", "bf16", "fp8"):
        if dt in peaks:
            assert peaks[dt] >= peaks["fp32"], (dt, peaks)
    if "fp8" in peaks:
        assert peaks["fp8"] >= max(peaks.get("fp16", 0), peaks.get("bf16", 0))


@pytest.mark.parametrize("name,absent", [
    ("V100-SXM2-16GB", {"bf16", "tf32", "fp8"}),
    ("V100-SXM2-32GB", {"bf16", "tf32", "fp8"}),
    ("T4-16GB", {"bf16", "tf32", "fp8"}),
    ("MI250X-OAM-128GB", {"tf32", "fp8"}),
    ("A100-SXM4-80GB", {"fp8"}),
], ids=["V100-16GB", "V100-32GB", "T4", "MI250X", "A100"])
def test_missing_dtypes_are_omitted(name, absent):
    assert not (set(BY_NAME[name]["peak_TFLOPS"]) & absent)


def test_names_and_aliases_unique_case_insensitive():
    keys = [k.lower() for d in DEVICES for k in (d["name"], *d["aliases"])]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    assert not dupes, f"duplicate names/aliases: {dupes}"


@pytest.mark.parametrize("alias,name", [
    ("H100", "H100-SXM5-80GB"), ("h100", "H100-SXM5-80GB"), ("H200", "H200-SXM-141GB"),
    ("A100", "A100-SXM4-80GB"), ("A100-40GB", "A100-SXM4-40GB"), ("A100-80GB", "A100-SXM4-80GB"),
    ("V100", "V100-SXM2-32GB"), ("V100-16GB", "V100-SXM2-16GB"), ("V100-32GB", "V100-SXM2-32GB"),
    ("T4", "T4-16GB"), ("A10G", "A10G-24GB"), ("L4", "L4-24GB"), ("L40S", "L40S-48GB"),
    ("4090", "RTX-4090-24GB"), ("RTX4090", "RTX-4090-24GB"), ("MI250X", "MI250X-OAM-128GB"),
    ("MI300X", "MI300X-OAM-192GB"), ("cpu", "CPU"),
], ids=lambda v: v)
def test_alias_resolves(alias, name):
    dev = _resolve(alias)
    assert dev is not None and dev["name"] == name


def test_generation_ordering():
    bf16 = lambda n: BY_NAME[n]["peak_TFLOPS"]["bf16"]
    assert bf16("H100-SXM5-80GB") > bf16("A100-SXM4-80GB") > BY_NAME["V100-SXM2-32GB"]["peak_TFLOPS"]["fp16"]
    assert BY_NAME["H200-SXM-141GB"]["memory_bandwidth_GBps"] > BY_NAME["H100-SXM5-80GB"]["memory_bandwidth_GBps"]
    assert BY_NAME["A100-SXM4-80GB"]["memory_bandwidth_GBps"] > BY_NAME["A100-SXM4-40GB"]["memory_bandwidth_GBps"]


# The 80 GB parts list what the driver leaves usable (79.35 and 79.18 GiB: the figures PyTorch
# reports as total_memory), the others their nominal size.
@pytest.mark.parametrize("name,memory_GiB,bandwidth_GBps,bf16_or_fp16", [
    ("A100-SXM4-40GB", 40, 1555, 312), ("A100-SXM4-80GB", 79.35, 2039, 312),
    ("H100-SXM5-80GB", 79.18, 3350, 989.4), ("H200-SXM-141GB", 141, 4800, 989.4),
    ("V100-SXM2-32GB", 32, 900, 125), ("T4-16GB", 16, 320, 65),
], ids=lambda v: str(v))
def test_spot_check_vendor_figures(name, memory_GiB, bandwidth_GBps, bf16_or_fp16):
    dev = BY_NAME[name]
    peaks = dev["peak_TFLOPS"]
    assert dev["memory_GiB"] == memory_GiB
    assert dev["memory_bandwidth_GBps"] == bandwidth_GBps
    assert peaks.get("bf16", peaks.get("fp16")) == pytest.approx(bf16_or_fp16)


# ------------------------------------------------------------------ clusters

@pytest.mark.parametrize("stem", REQUIRED_CLUSTERS, ids=REQUIRED_CLUSTERS)
def test_required_cluster_present(stem):
    assert (CLUSTERS_DIR / f"{stem}.json").is_file()


def _check_link(link, where):
    assert isinstance(link, dict), where
    assert set(link) <= LINK_FIELDS, (where, set(link) - LINK_FIELDS)
    assert _positive(link.get("bandwidth_GBps")), where
    assert _positive(link.get("latency_us", 5)), where


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=[p.stem for p in CLUSTER_FILES])
def test_cluster_file(path):
    data = json.loads(path.read_text())
    assert set(data) <= {"name", "description", "inter_node", "node_groups", "schema_version"}, set(data)
    assert isinstance(data.get("name"), str) and data["name"] == path.stem
    assert isinstance(data.get("description"), str) and data["description"]
    assert not re.search(r"https?://|www\.", path.read_text())
    if "inter_node" in data:
        _check_link(data["inter_node"], "inter_node")
    groups = data["node_groups"]
    assert isinstance(groups, list) and groups
    names = [g.get("name") for g in groups]
    assert len(set(names)) == len(names)
    for i, g in enumerate(groups):
        where = f"node_groups[{i}]"
        assert set(g) <= {"name", "device", "nodes", "gpus_per_node", "intra_node", "inter_node"}, where
        for key in ("nodes", "gpus_per_node"):
            assert isinstance(g[key], int) and not isinstance(g[key], bool) and g[key] >= 1, (where, key)
        dev = g["device"]
        if isinstance(dev, str):
            assert _resolve(dev) is not None, f"{where}.device {dev!r} is not in the catalog"
        else:
            assert isinstance(dev, dict), where
            assert isinstance(dev.get("name"), str)
            assert ("memory_GiB" in dev) != ("memory_GB" in dev), where
            assert _positive(dev.get("memory_GiB", dev.get("memory_GB")))
            assert _positive(dev["memory_bandwidth_GBps"])
            assert dev["peak_TFLOPS"] and set(dev["peak_TFLOPS"]) <= DTYPES
            assert all(_positive(v) for v in dev["peak_TFLOPS"].values())
        for key in ("intra_node", "inter_node"):
            if key in g:
                _check_link(g[key], f"{where}.{key}")


@pytest.mark.parametrize("stem,gpus,types", [
    ("dgx-a100-1node", 8, 1), ("dgx-h100-8nodes", 64, 1), ("selene-a100-128nodes", 1024, 1),
    ("mixed-v100-t4", 32, 2), ("mixed-a100-h100", 64, 2), ("mixed-three-types", 64, 3),
    ("cpu-4ranks", 4, 1), ("small-mixed-v100-t4", 8, 2),
], ids=lambda v: str(v))
def test_cluster_sizes(stem, gpus, types):
    data = json.loads((CLUSTERS_DIR / f"{stem}.json").read_text())
    groups = data["node_groups"]
    assert sum(g["nodes"] * g["gpus_per_node"] for g in groups) == gpus
    assert len({_resolve(g["device"])["name"] for g in groups}) == types
