"""The Megatron-LM and DeepSpeed rules produce the plans their recipes prescribe, and the
search beats them where the rules are blind (mixed clusters)."""
from __future__ import annotations

import pytest

import autoplan
from autoplan import Cluster, Plan, baselines, models
from autoplan.errors import ConfigError

DGX2 = Cluster.homogeneous("A100-80GB", 2, 8, inter_node_GBps=25)
SMALL_MIXED = Cluster.load("examples/clusters/small-mixed-v100-t4.json")


def fits(model, cluster, plan: Plan) -> bool:
    return autoplan.estimate(model, cluster, plan).fits


# name: (model, cluster, global batch, expected tp, expected pp, expected schedule)
V100_2x8 = Cluster.homogeneous("V100-16GB", 2, 8)
MEGATRON = {
    "small-model-one-stage": ("gpt3-1.3b", DGX2, 64, 8, 1, "1f1b"),
    "6.7b-needs-a-pipeline": ("gpt3-6.7b", V100_2x8, 64, 8, 2, "interleaved-1f1b"),
    "mixed-cluster-tp4": ("gpt2-medium", SMALL_MIXED, 16, 4, 1, "1f1b"),
}


@pytest.mark.parametrize("case", MEGATRON, ids=list(MEGATRON))
def test_megatron_rule(case):
    name, cluster, gb, tp, pp, schedule = MEGATRON[case]
    model = models.get(name)
    plan = baselines.megatron(model, cluster, gb)
    plan.validate(model, cluster)
    assert plan.tp == tp and plan.pp == pp and plan.schedule == schedule
    assert plan.micro_batch == 1 and plan.num_gpus == cluster.num_gpus and plan.zero == 0
    assert plan.sequence_parallel == (tp > 1)
    assert fits(model, cluster, plan)
    # Fewest stages: one stage fewer (with the same layout rule) would not fit.
    if pp > 1:
        smaller = Plan.uniform(model, cluster, tp=tp, pp=pp // 2, dp=cluster.num_gpus // (tp * pp // 2),
                               micro_batch=1, global_batch=gb, recompute="full", sequence_parallel=True)
        assert not fits(model, cluster, smaller)
    # Even split, embedding first, head last.
    sizes = [s.num_layers for s in plan.stages]
    assert max(sizes) - min(sizes) <= 2


def test_megatron_recomputes_only_when_it_must():
    # One 4-GPU node leaves no room for more stages: long sequences need recomputation.
    # Judged on Megatron's own stack (bf16 weights, vocabulary-parallel loss).
    model = models.get("gpt3-2.7b", seq_len=8192)
    cluster = Cluster.homogeneous("V100-16GB", 1, 4)
    plan = baselines.megatron(model, cluster, 16, stack="megatron-core")
    assert plan.recompute in ("selective", "full")
    assert autoplan.estimate(model, cluster, plan, stack="megatron-core").fits
    roomy = baselines.megatron(model, DGX2, 16, stack="megatron-core")
    assert roomy.recompute == "none"


def test_deepspeed_zero3_takes_the_largest_micro_batch_that_fits():
    model = models.get("gpt3-1.3b")
    plan = baselines.deepspeed(model, DGX2, 256, variant="zero3")
    assert plan.zero == 3 and plan.tp == 1 and plan.pp == 1 and plan.dp == 16
    assert fits(model, DGX2, plan)
    per_replica = 256 // 16
    bigger = [b for b in range(plan.micro_batch + 1, per_replica + 1) if per_replica % b == 0]
    for b in bigger:
        trial = Plan.uniform(model, DGX2, tp=1, pp=1, dp=16, micro_batch=b, global_batch=256, zero=3,
                             recompute=plan.recompute)
        assert not fits(model, DGX2, trial)


@pytest.mark.parametrize("model,cluster", [("gpt3-13b", DGX2), ("gpt3-6.7b", V100_2x8)], ids=["dgx2", "v100"])
def test_deepspeed_3d_recipe(model, cluster):
    spec = models.get(model)
    plan = baselines.deepspeed(spec, cluster, 64, variant="3d")
    assert plan.zero == (1 if plan.dp > 1 else 0) and plan.schedule == "1f1b" and plan.tp == 8
    assert plan.micro_batch == 1 and not plan.sequence_parallel and fits(spec, cluster, plan)
    if plan.pp > 1:
        fewer = Plan.uniform(spec, cluster, tp=8, pp=plan.pp // 2, dp=cluster.num_gpus // (4 * plan.pp),
                             micro_batch=1, global_batch=64, zero=1, recompute="full")
        assert not fits(spec, cluster, fewer)


def test_rules_return_a_plan_that_does_not_fit_rather_than_nothing():
    model = models.get("gpt3-175b")
    cluster = Cluster.homogeneous("T4", 1, 4)
    for plan in (baselines.megatron(model, cluster, 8), baselines.deepspeed(model, cluster, 8),
                 baselines.deepspeed(model, cluster, 8, variant="3d")):
        plan.validate(model, cluster)
        assert not fits(model, cluster, plan)


def test_unknown_variant_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        baselines.deepspeed("gpt-tiny", DGX2, 16, variant="zero++")
    assert err.value.field == "variant"


@pytest.mark.parametrize("cluster_file,model,gb,margin", [
    ("examples/clusters/small-mixed-v100-t4.json", "gpt3-1.3b", 64, 1.3),
    ("examples/clusters/mixed-v100-t4.json", "gpt3-6.7b", 128, 1.5),
], ids=["small-mixed-v100-t4", "mixed-v100-t4"])
def test_search_beats_megatron_on_mixed_clusters(cluster_file, model, gb, margin):
    spec = models.get(model)
    cluster = Cluster.load(cluster_file)
    rule = autoplan.estimate(spec, cluster, baselines.megatron(spec, cluster, gb))
    found = autoplan.search(spec, cluster, gb, progress=False).best.estimate
    assert found.tokens_per_s >= margin * rule.tokens_per_s, (found.summary(), rule.summary())
