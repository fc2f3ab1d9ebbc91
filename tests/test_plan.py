"""Plans: uniform construction, JSON round trip, and validation that names the field."""
from __future__ import annotations

import json

import pytest

import autoplan
from autoplan.plan import even_split


@pytest.fixture(scope="module")
def model():
    return autoplan.models.get("gpt2-small")  # 12 blocks + embedding + head, 12 heads


@pytest.fixture(scope="module")
def cluster():
    return autoplan.Cluster.homogeneous("A100", 2, 8)


@pytest.mark.parametrize("stages,expected", [
    (1, [14]), (2, [7, 7]), (3, [5, 4, 5]), (4, [4, 3, 3, 4]), (12, [2] + [1] * 10 + [2]),
], ids=["1", "2", "3", "4", "12"])
def test_even_split(model, stages, expected):
    bounds = even_split(model, stages)
    assert [b - a for a, b in bounds] == expected
    assert bounds[0][0] == 0 and bounds[-1][1] == model.num_layers


def test_uniform_plan_and_round_trip(model, cluster, tmp_path):
    plan = autoplan.Plan.uniform(model, cluster, tp=2, pp=2, dp=4, micro_batch=2, global_batch=64,
                                 schedule="interleaved-1f1b", virtual_stages=2, recompute="selective",
                                 sequence_parallel=True, zero=1)
    assert plan.num_gpus == 16 and plan.num_micro_batches == 8 and plan.global_batch == 64
    assert plan.groups[1].ranks == tuple(range(8, 16))
    assert plan.groups[0].tp_groups()[1] == (2, 3)
    assert plan.groups[0].dp_groups()[0] == (0, 2, 4, 6)
    plan.save(tmp_path / "p.json", extra={"estimate": {"iteration_time_s": 1.0}})
    assert autoplan.Plan.load(tmp_path / "p.json") == plan


BASE = dict(tp=2, pp=2, dp=2, micro_batch=2, global_batch=32)
BAD_UNIFORM = [
    ("tp-heads", dict(tp=5, dp=1), "groups[0].tp"),
    ("batch", dict(global_batch=30), "global_batch"),
    ("too-many-gpus", dict(dp=8), "ranks"),
    ("too-many-stages", dict(pp=16, dp=1, tp=1), "pp"),
    ("virtual-without-interleave", dict(virtual_stages=2), "virtual_stages"),
    ("zero-stage", dict(zero=4), "zero"),
    ("schedule", dict(schedule="pipedream"), "schedule"),
    ("recompute", dict(recompute="some"), "recompute"),
    ("negative", dict(micro_batch=0), "micro_batch"),
]


@pytest.mark.parametrize("change,field", [(c, f) for _, c, f in BAD_UNIFORM], ids=[n for n, _, _ in BAD_UNIFORM])
def test_bad_uniform_plan_names_field(model, cluster, change, field):
    with pytest.raises(autoplan.ConfigError) as e:
        autoplan.Plan.uniform(model, cluster, **{**BASE, **change})
    assert field in str(e.value)


def _plan_dict(model, cluster):
    return autoplan.Plan.uniform(model, cluster, **BASE).to_dict()


def _edit(d, path, value):
    d = json.loads(json.dumps(d))
    target = d
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return d


BAD_FILES = [
    ("missing-micro-batch", ("micro_batch",), KeyError, "micro_batch"),
    ("gap-in-layers", ("stages", 1, "layers"), [8, 14], "stages[1].start"),
    ("empty-stage", ("stages", 0, "layers"), [0, 0], "stages[0]"),
    ("wrong-group", ("stages", 1, "group"), 0, "stages[1].group"),
    ("duplicate-rank", ("groups", 1, "ranks"), [0, 1, 2, 3], "groups[1].ranks"),
    ("tp-not-dividing", ("groups", 0, "tp"), 3, "groups[0].tp"),
    ("rank-not-int", ("groups", 0, "ranks"), [0, "1", 2, 3], "groups[0].ranks[1]"),
    ("global-batch-mismatch", ("global_batch",), 999, "global_batch"),
    ("future-schema", ("schema_version",), 99, "schema_version"),
    ("unknown-field", ("tensor_parallel",), 2, "tensor_parallel"),
    ("bad-schedule", ("schedule",), "1f1bb", "schedule"),
    ("bool-not-bool", ("sequence_parallel",), "yes", "sequence_parallel"),
]


@pytest.mark.parametrize("path,value,field", [(p, v, f) for _, p, v, f in BAD_FILES],
                         ids=[n for n, _, _, _ in BAD_FILES])
def test_bad_plan_file_names_field(model, cluster, tmp_path, path, value, field):
    d = _edit(_plan_dict(model, cluster), path, value)
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(d))
    with pytest.raises(autoplan.ConfigError) as e:
        autoplan.Plan.load(f).validate(model, cluster)
    assert field in str(e.value)


def test_plan_not_covering_model(model, cluster, tmp_path):
    d = _plan_dict(model, cluster)
    d["stages"][-1]["layers"][1] -= 1
    with pytest.raises(autoplan.ConfigError, match="every unit needs a stage"):
        autoplan.Plan.from_dict(d).validate(model, cluster)


# -------------------------------------------------------------- expert parallelism
@pytest.fixture(scope="module")
def moe():
    return autoplan.models.get("mixtral-8x7b")  # 8 experts, 8 kv heads


def test_expert_parallel_groups(moe, cluster):
    plan = autoplan.Plan.uniform(moe, cluster, tp=2, pp=1, dp=8, micro_batch=1, global_batch=16, ep=4)
    g = plan.groups[0]
    # dp-major layout, tp fastest: replica d, shard t is rank 2d + t. Experts go to runs of 4
    # consecutive replicas (per tensor shard); the same experts sit 4 replicas apart.
    assert g.ep_groups(4) == [(0, 2, 4, 6), (8, 10, 12, 14), (1, 3, 5, 7), (9, 11, 13, 15)]
    assert g.expert_dp_groups(4) == [(0, 8), (2, 10), (4, 12), (6, 14), (1, 9), (3, 11), (5, 13), (7, 15)]
    assert "ep=4" in plan.describe() and "ep=" not in autoplan.Plan.uniform(
        moe, cluster, tp=2, pp=1, dp=8, micro_batch=1, global_batch=16).describe()


BAD_EP = [
    ("ep-over-dp", dict(tp=2, dp=2, ep=4), "ep", "does not divide the 2 data-parallel"),
    ("ep-not-dividing-experts", dict(tp=1, dp=12, ep=12), "ep", "8 experts"),
    ("ep-zero", dict(tp=2, dp=2, ep=0), "ep", "positive integer"),
]


@pytest.mark.parametrize("change,field,words", [c[1:] for c in BAD_EP], ids=[c[0] for c in BAD_EP])
def test_bad_expert_parallel_degree_names_field(moe, cluster, change, field, words):
    with pytest.raises(autoplan.ConfigError) as e:
        autoplan.Plan.uniform(moe, cluster, pp=1, micro_batch=1, global_batch=24, **change)
    assert e.value.field == field and words in str(e.value)


def test_expert_parallel_needs_experts(model, cluster):
    with pytest.raises(autoplan.ConfigError, match="has no routed experts"):
        autoplan.Plan.uniform(model, cluster, tp=1, pp=1, dp=4, micro_batch=1, global_batch=4, ep=2)


def test_schema_version_1_files_read_with_ep_1(moe, cluster, tmp_path):
    plan = autoplan.Plan.uniform(moe, cluster, tp=2, pp=1, dp=4, micro_batch=1, global_batch=8, ep=2)
    d = plan.to_dict()
    assert d["schema_version"] == 2 and d["ep"] == 2
    assert autoplan.Plan.from_dict(d) == plan
    old = {k: v for k, v in d.items() if k != "ep"}
    old["schema_version"] = 1
    assert autoplan.Plan.from_dict(old).ep == 1
