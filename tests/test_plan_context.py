"""Context parallelism in the plan: the rank layout of a (dp x cp x tp) group, JSON, and the
one validation that checks the sequence and heads split as the exchange needs."""
from __future__ import annotations

import json

import pytest

import autoplan
from autoplan.plan import DeviceGroup, Plan


@pytest.fixture(scope="module")
def model():
    return autoplan.models.get("llama-tiny", seq_len=64)   # 4 heads, 2 kv heads, causal


@pytest.fixture(scope="module")
def cluster():
    return autoplan.Cluster.homogeneous("H100", 2, 8)


def test_group_layout_is_dp_major_then_cp_then_tp():
    g = DeviceGroup(ranks=tuple(range(8)), tp=2, cp=2)
    assert g.dp == 2
    assert g.tp_groups() == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert g.cp_groups() == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert g.dp_groups() == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert g.dp_cp_groups() == [(0, 2, 4, 6), (1, 3, 5, 7)]
    plain = DeviceGroup(ranks=tuple(range(4)), tp=2)
    assert plain.cp == 1 and plain.cp_groups() == [(0,), (1,), (2,), (3,)]
    assert plain.dp_cp_groups() == plain.dp_groups() == [(0, 2), (1, 3)]


def test_uniform_plan_with_cp_round_trips(model, cluster, tmp_path):
    plan = Plan.uniform(model, cluster, tp=2, cp=4, pp=2, dp=1, micro_batch=1, global_batch=4,
                        cp_comm="all_gather")
    assert plan.cp == 4 and plan.num_gpus == 16 and plan.global_batch == 4 and plan.dp == 1
    assert plan.groups[1].ranks == tuple(range(8, 16))
    assert "cp=4(all_gather)" in plan.describe()
    plan.save(tmp_path / "p.json")
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["groups"][0]["cp"] == 4 and data["cp_comm"] == "all_gather"
    assert Plan.load(tmp_path / "p.json") == plan


def test_plans_without_cp_keep_their_json_and_version_1_files_load(model, cluster):
    plan = Plan.uniform(model, cluster, tp=2, pp=1, dp=2, micro_batch=1, global_batch=4)
    d = plan.to_dict()
    assert "cp_comm" not in d and "cp" not in d["groups"][0] and "cp=" not in plan.describe()
    d["schema_version"] = 1
    assert Plan.from_dict(d) == plan and plan.cp == 1


BASE = dict(tp=1, cp=2, pp=1, dp=1, micro_batch=1, global_batch=2)
# name -> (model overrides, plan changes, field named, words in the message)
BAD = {
    "zig-zag-needs-2cp-chunks": ({"seq_len": 36}, dict(cp=4), "groups[0].cp", "not divisible by 8"),
    "a2a-needs-cp-chunks": ({"seq_len": 66}, dict(cp=4, cp_comm="a2a"), "groups[0].cp", "by 4"),
    "a2a-needs-heads": ({}, dict(cp=4, cp_comm="a2a"), "groups[0].cp", "2 kv heads"),
    "a2a-heads-per-tp-rank": ({}, dict(tp=2, cp=2, cp_comm="a2a"), "groups[0].cp", "1 kv heads"),
    "unknown-exchange": ({}, dict(cp_comm="ring"), "cp_comm", "'ring'"),
    "cp-not-positive": ({}, dict(cp=0), "cp", "positive"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_cp_names_the_field(model, cluster, case):
    overrides, change, field, words = BAD[case]
    m = autoplan.models.get("llama-tiny", **overrides) if overrides else model
    with pytest.raises(autoplan.ConfigError) as e:
        Plan.uniform(m, cluster, **{**BASE, **change})
    assert e.value.field == field and words in str(e.value)


def test_ring_cp_on_a_bidirectional_model_needs_cp_chunks_only(cluster):
    bert = autoplan.models.get("bert-tiny", seq_len=36)   # 36 = 4 * 9: no zig-zag for non-causal
    assert Plan.uniform(bert, cluster, **{**BASE, "cp": 4}).cp == 4


def test_cp_needs_a_transformer(cluster):
    swin = autoplan.models.get("swin-tiny-test")
    with pytest.raises(autoplan.ConfigError, match="no attention heads"):
        Plan.uniform(swin, cluster, **{**BASE, "cp": 2})


BAD_FILES = {
    "cp-differs-between-groups": (lambda d: d["groups"][1].update(cp=1, ranks=d["groups"][1]["ranks"][:2]),
                                  "groups[1].cp"),
    "cp-not-dividing-ranks": (lambda d: d["groups"][0].update(cp=3), "groups[0].cp"),
}


@pytest.mark.parametrize("case", BAD_FILES, ids=list(BAD_FILES))
def test_bad_cp_in_a_file_names_the_field(model, cluster, case):
    edit, field = BAD_FILES[case]
    d = Plan.uniform(model, cluster, **{**BASE, "pp": 2, "dp": 2}).to_dict()
    edit(d)
    with pytest.raises(autoplan.ConfigError) as e:
        Plan.from_dict(d)
    assert field in str(e.value)
