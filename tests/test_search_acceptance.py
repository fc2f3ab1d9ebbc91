"""The search's acceptance checks: same optimum as brute force on a small space, a useful
explanation when nothing fits, and a clear win over Megatron-LM's rule on a mixed cluster."""
from __future__ import annotations

import itertools

import pytest

import autoplan
from autoplan import baselines
from autoplan.plan import DeviceGroup, Plan, Stage


def _splits(n_units: int, stages: int):
    for cuts in itertools.combinations(range(1, n_units), stages - 1):
        bounds = (0, *cuts, n_units)
        yield [(bounds[i], bounds[i + 1]) for i in range(stages)]


def _brute_force(model, cluster, global_batch, micro_batches, schedule):
    best = None
    n = cluster.num_gpus
    for tp in model.tp_degrees(n):
        for pp in range(1, model.num_layers + 1):
            if n % (tp * pp):
                continue
            dp = n // (tp * pp)
            for mb in micro_batches:
                if global_batch % (mb * dp):
                    continue
                groups = tuple(DeviceGroup(tuple(range(p * tp * dp, (p + 1) * tp * dp)), tp) for p in range(pp))
                for split in _splits(model.num_layers, pp):
                    plan = Plan(groups=groups, stages=tuple(Stage(a, b, i) for i, (a, b) in enumerate(split)),
                                micro_batch=mb, num_micro_batches=global_batch // (mb * dp), schedule=schedule)
                    est = autoplan.estimate(model, cluster, plan)
                    if est.fits and (best is None or est.iteration_time_s < best.iteration_time_s):
                        best = est
    return best


@pytest.mark.parametrize("model_name,gpus,global_batch", [("gpt-tiny", 4, 8), ("llama-tiny", 4, 16),
                                                          ("gpt-tiny", 2, 4)],
                         ids=["gpt-4gpu", "llama-4gpu", "gpt-2gpu"])
def test_search_finds_brute_force_optimum(model_name, gpus, global_batch):
    model = autoplan.models.get(model_name)
    cluster = autoplan.Cluster.homogeneous("A100-80GB", 1, gpus)
    micro_batches = (1, 2, 4)
    result = autoplan.search(model, cluster, global_batch, schedules=("1f1b",), recompute=("none",), zero=(0,),
                             sequence_parallel=(False,), micro_batch=micro_batches, use_all_gpus=True,
                             progress=False)
    best = _brute_force(model, cluster, global_batch, micro_batches, "1f1b")
    assert result.best.estimate.iteration_time_s == pytest.approx(best.iteration_time_s, rel=1e-6)


def test_search_is_deterministic():
    model = autoplan.models.get("gpt2-small")
    cluster = autoplan.Cluster.load("examples/clusters/small-mixed-v100-t4.json")
    a = autoplan.search(model, cluster, 32, progress=False)
    b = autoplan.search(model, cluster, 32, progress=False)
    assert [r.plan for r in a.ranked] == [r.plan for r in b.ranked]


def test_nothing_fits_explains_memory():
    cluster = autoplan.Cluster.homogeneous("T4", 1, 2)
    with pytest.raises(autoplan.NoPlanFitsError) as e:
        autoplan.search("llama3-70b", cluster, 8, progress=False)
    text = str(e.value)
    assert "GiB" in text and "T4" in text
    assert any(word in text for word in ("more GPUs", "recompute", "ZeRO", "sequence"))


def test_mixed_cluster_beats_megatron_rule():
    cluster = autoplan.Cluster.load("examples/clusters/small-mixed-v100-t4.json")
    model = autoplan.models.get("gpt2-large")
    searched = autoplan.search(model, cluster, 64, progress=False).best.estimate
    rule = autoplan.estimate(model, cluster, baselines.megatron(model, cluster, 64))
    assert searched.fits
    assert searched.iteration_time_s < 0.8 * rule.iteration_time_s  # a clear margin, not noise


def test_searched_plan_round_trips_to_estimate(tmp_path):
    cluster = autoplan.Cluster.load("examples/clusters/dgx-a100-1node.json")
    result = autoplan.search("gpt3-1.3b", cluster, 64, progress=False)
    path = tmp_path / "plan.json"
    result.best.plan.save(path, extra={"estimate": result.best.estimate.to_dict()})
    again = autoplan.estimate("gpt3-1.3b", cluster, Plan.load(path))
    assert again.iteration_time_s == pytest.approx(result.best.estimate.iteration_time_s, rel=1e-9)
    ranked_times = [r.estimate.iteration_time_s for r in result.ranked]
    assert ranked_times == sorted(ranked_times)
