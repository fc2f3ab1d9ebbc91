"""Context parallelism in the search: chosen at long sequences when it wins, not offered
where parts would be too short, constraints honoured. (The llama3-8b 128k scenario on
the 8-node H100 cluster: benchmarks/context_parallel.py.)"""
from __future__ import annotations

import pytest

import autoplan
from autoplan.errors import ConfigError

H100X16 = autoplan.Cluster.homogeneous("H100", 2, 8)


@pytest.fixture(scope="module")
def long_model():
    return autoplan.models.get("llama3-8b", layers=4, seq_len=32768)


@pytest.fixture(scope="module")
def long_results(long_model):
    free = autoplan.search(long_model, H100X16, 4, progress=False)
    no_cp = autoplan.search(long_model, H100X16, 4, progress=False, cp=1)
    return free, no_cp


def test_cp_wins_at_long_sequences_and_fits(long_results, long_model):
    free, no_cp = long_results
    best = free.best
    assert best.plan.cp > 1 and best.estimate.fits
    best.plan.validate(long_model, H100X16)
    assert best.estimate.iteration_time_s < no_cp.best.estimate.iteration_time_s
    assert all(rp.plan.cp == 1 for rp in no_cp.ranked)
    assert "cp" in free.table(3).splitlines()[0].split()


def test_the_best_plan_round_trips_with_its_exchange(long_results, tmp_path):
    plan = long_results[0].best.plan
    plan.save(tmp_path / "plan.json")
    assert autoplan.Plan.load(tmp_path / "plan.json") == plan


def test_short_sequences_search_the_same_space_as_before():
    model = autoplan.models.get("llama-tiny", seq_len=4096)
    cluster = autoplan.Cluster.homogeneous("A100", 1, 8)
    free = autoplan.search(model, cluster, 8, progress=False, max_estimates=2)
    no_cp = autoplan.search(model, cluster, 8, progress=False, max_estimates=2, cp=1)
    assert free.stats.skeletons == no_cp.stats.skeletons and free.best.plan.cp == 1


def test_a_cp_constraint_is_honoured(long_model):
    r = autoplan.search(long_model, H100X16, 4, progress=False, cp=8, cp_comm="a2a", max_estimates=2)
    assert {(rp.plan.cp, rp.plan.cp_comm) for rp in r.ranked} == {(8, "a2a")}


BAD = {
    "unknown-exchange": (dict(cp_comm="ring"), "cp_comm"),
    "cp-not-positive": (dict(cp=0), "cp"),
    "cp-on-a-mixed-cluster": (dict(cp=2), "cp"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_cp_constraints_name_the_field(case):
    kw, field = BAD[case]
    cluster = autoplan.Cluster.load("examples/clusters/small-mixed-v100-t4.json") if "mixed" in case else H100X16
    with pytest.raises(ConfigError) as e:
        autoplan.search(autoplan.models.get("llama-tiny", seq_len=64), cluster, 4, progress=False, **kw)
    assert e.value.field == field
