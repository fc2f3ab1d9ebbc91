"""Cluster files: good ones load with the right figures, bad ones name the broken field."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import autoplan
from autoplan.units import GB, GiB

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples/clusters").glob("*.json"))
assert EXAMPLES, "no example clusters found"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples_load_and_round_trip(path, tmp_path):
    c = autoplan.Cluster.load(path)
    assert c.num_gpus == len(c.slots) > 0
    c.save(tmp_path / "c.json")
    again = autoplan.Cluster.load(tmp_path / "c.json")
    assert again.num_gpus == c.num_gpus
    assert [g.device.name for g in again.groups] == [g.device.name for g in c.groups]


@pytest.mark.parametrize("alias,name", [("a100", "A100-SXM4-80GB"), ("H100", "H100-SXM5-80GB"),
                                        ("v100-16gb", "V100-SXM2-16GB"), ("T4", "T4-16GB")])
def test_device_aliases(alias, name):
    assert autoplan.get_device(alias).name == name


def test_unknown_device_suggests_closest():
    with pytest.raises(autoplan.ConfigError, match="did you mean") as e:
        autoplan.get_device("A100-96GB")
    assert "A100" in str(e.value)


def test_homogeneous_and_links():
    c = autoplan.Cluster.homogeneous("H100", nodes=2, gpus_per_node=8, inter_node_GBps=50)
    assert c.num_gpus == 16 and c.is_homogeneous
    assert c.link(0, 7).bandwidth == c.groups[0].intra_node.bandwidth
    assert c.link(0, 8).bandwidth == 50 * GB
    assert c.slots[9].node == 1 and c.slots[9].local_rank == 1


def test_mixed_cluster_nic_override_bounds_cross_group_link():
    c = autoplan.Cluster.load("examples/clusters/mixed-v100-t4.json")
    v100, t4 = c.group_ranks(0)[0], c.group_ranks(1)[0]
    assert c.link(v100, t4).bandwidth == min(c.nic(0).bandwidth, c.nic(1).bandwidth)


def test_inline_device():
    c = autoplan.Cluster.from_dict({"node_groups": [{"device": {
        "name": "MyAccel", "memory_GB": 32, "peak_TFLOPS": {"bf16": 100}, "memory_bandwidth_GBps": 1000},
        "nodes": 1, "gpus_per_node": 4}]})
    assert c.groups[0].device.memory_bytes == 32 * GB
    assert c.groups[0].device.peak("fp16") == 100e12  # falls back to bf16


GOOD = {"name": "x", "inter_node": {"bandwidth_GBps": 25, "latency_us": 5},
        "node_groups": [{"name": "a", "device": "A100", "nodes": 2, "gpus_per_node": 8}]}

BAD = [
    ("no-groups", {"node_groups": []}, "node_groups"),
    ("gpus-zero", {"node_groups": [{"device": "A100", "gpus_per_node": 0}]}, "node_groups[0].gpus_per_node"),
    ("gpus-string", {"node_groups": [{"device": "A100", "gpus_per_node": "8"}]}, "node_groups[0].gpus_per_node"),
    ("nodes-float", {"node_groups": [{"device": "A100", "gpus_per_node": 8, "nodes": 1.5}]}, "node_groups[0].nodes"),
    ("unknown-device", {"node_groups": [{"device": "B300", "gpus_per_node": 8}]}, "node_groups[0].device"),
    ("missing-device", {"node_groups": [{"gpus_per_node": 8}]}, "node_groups[0].device"),
    ("typo-field", {"node_groups": [{"device": "A100", "gpus_per_node": 8, "gpu_per_node": 8}]},
     "node_groups[0].gpu_per_node"),
    ("negative-bw", {**GOOD, "inter_node": {"bandwidth_GBps": -1}}, "inter_node.bandwidth_GBps"),
    ("bw-unit-missing", {**GOOD, "inter_node": {"bandwidth": 25}}, "inter_node.bandwidth"),
    ("inline-no-memory", {"node_groups": [{"device": {"name": "X", "peak_TFLOPS": {"bf16": 1},
                                                       "memory_bandwidth_GBps": 1}, "gpus_per_node": 1}]},
     "node_groups[0].device.memory_GiB"),
    ("inline-bad-dtype", {"node_groups": [{"device": {"name": "X", "memory_GB": 1, "peak_TFLOPS": {"bf17": 1},
                                                       "memory_bandwidth_GBps": 1}, "gpus_per_node": 1}]},
     "node_groups[0].device.peak_TFLOPS.bf17"),
    ("duplicate-names", {"node_groups": [{"name": "a", "device": "A100", "gpus_per_node": 8},
                                         {"name": "a", "device": "T4", "gpus_per_node": 4}]}, "node_groups"),
    ("not-object", [1, 2], "c.json"),
]


@pytest.mark.parametrize("data,field", [(d, f) for _, d, f in BAD], ids=[n for n, _, _ in BAD])
def test_bad_cluster_names_field(tmp_path, data, field):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    with pytest.raises(autoplan.ConfigError) as e:
        autoplan.Cluster.load(path)
    assert field in str(e.value)


@pytest.mark.parametrize("text,expect", [("{", "not valid JSON"), ("", "not valid JSON")], ids=["truncated", "empty"])
def test_unparseable_cluster_file(tmp_path, text, expect):
    path = tmp_path / "c.json"
    path.write_text(text)
    with pytest.raises(autoplan.ConfigError, match=expect):
        autoplan.Cluster.load(path)


def test_cluster_summary_mentions_memory_and_links():
    text = autoplan.Cluster.load("examples/clusters/dgx-a100-1node.json").summary()
    assert "A100" in text and "GiB" in text and "GB/s" in text
    assert autoplan.get_device("A100-80GB").memory_bytes == pytest.approx(79.35 * GiB)   # usable of 80 GB


@pytest.mark.parametrize("path, expect", [
    ("examples/clusters/dgx-a100-1node.json", "312 TFLOP/s bf16"),
    # Volta and Turing have no bf16 units: the summary names the fp16 peak they run at.
    ("examples/clusters/mixed-v100-t4.json", "125 TFLOP/s fp16"),
], ids=["a100-bf16", "v100-fp16"])
def test_cluster_summary_names_the_dtype_of_its_peak(path, expect):
    assert expect in autoplan.Cluster.load(path).summary()
