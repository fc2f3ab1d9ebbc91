"""The benchmark: scenario files, the report's verdicts and figures, and one small
scenario end to end through the real search and baseline rules."""
from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest

import autoplan
from autoplan.cluster import Cluster
from autoplan.errors import ConfigError
from autoplan.plan import Plan
from benchmarks.bench import (BASELINES, MeasuredRun, MeasuredTrack, PlanResult, Scenario, ScenarioResult,
                              estimate_plan, load_scenarios, run_scenario, verdict, write_report)

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# ---------------------------------------------------------------------------------------------
GOOD = {"name": "s", "model": "gpt-tiny", "global_batch": 8,
        "cluster": {"device": "A100", "nodes": 1, "gpus_per_node": 4}}

SCENARIO_ERRORS = {
    "unknown-field": ({**GOOD, "globl_batch": 8}, "s.json.globl_batch"),
    "missing-model": ({k: v for k, v in GOOD.items() if k != "model"}, "s.json.model"),
    "cluster-file-missing": ({**GOOD, "cluster": "examples/clusters/nope.json"}, "s.json.cluster"),
    "unknown-device": ({**GOOD, "cluster": {"device": "B9000", "nodes": 1, "gpus_per_node": 4}}, "device"),
    "bad-cluster-key": ({**GOOD, "cluster": {"device": "A100", "nodes": 1, "gpus": 4}}, "s.json.cluster.gpus"),
    "batch-in-search": ({**GOOD, "search": {"global_batch": 4}}, "s.json.search.global_batch"),
    "zero-batch": ({**GOOD, "global_batch": 0}, "s.json.global_batch"),
}


@pytest.mark.parametrize("data,field", SCENARIO_ERRORS.values(), ids=list(SCENARIO_ERRORS))
def test_bad_scenario_files_name_the_field(data, field, tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as err:
        Scenario.load(path)
    assert err.value.field == field


SCENARIO_OK = {
    "homogeneous-spec": (GOOD, 4, "homogeneous"),
    "cluster-file": ({**GOOD, "cluster": "examples/clusters/small-mixed-v100-t4.json"}, 8,
                     "examples/clusters/small-mixed-v100-t4.json"),
}


@pytest.mark.parametrize("data,gpus,source", SCENARIO_OK.values(), ids=list(SCENARIO_OK))
def test_scenario_cluster_sources(data, gpus, source, tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    sc = Scenario.load(path)
    assert (sc.cluster.num_gpus, sc.cluster_source) == (gpus, source)


def test_suite_covers_the_required_scenarios():
    scenarios = load_scenarios(ROOT / "benchmarks" / "scenarios")
    models = {s.model for s in scenarios}
    assert {"gpt3-1.3b", "gpt3-13b", "gpt3-175b", "llama3-8b", "llama3-70b", "swin-b"} <= models
    devices = {d.name for s in scenarios for d in s.cluster.device_types()}
    assert {"A100-SXM4-80GB", "H100-SXM5-80GB"} <= devices
    sizes = [s.cluster.num_gpus for s in scenarios]
    assert min(sizes) == 8 and max(sizes) == 1024
    assert sum(s.mixed for s in scenarios) >= 2
    from autoplan.models.presets import get_config
    assert any(get_config(s.model).arch == "moe" for s in scenarios)
    quick = load_scenarios(ROOT / "benchmarks" / "scenarios", quick=True)
    assert 0 < len(quick) < len(scenarios) and all(s.quick for s in quick)
    assert [s.name for s in load_scenarios(ROOT / "benchmarks" / "scenarios", only=[quick[0].name])] == \
        [quick[0].name]
    with pytest.raises(ConfigError):
        load_scenarios(ROOT / "benchmarks" / "scenarios", only=["no-such-scenario"])


# ---------------------------------------------------------------------------------------------
# Reports from plans built here (no search needed): the verdicts follow the estimates.
A100x8 = Cluster.homogeneous("A100", 1, 8)


@cache
def model():
    return autoplan.models.get("gpt3-6.7b")


@cache
def plans() -> dict[str, PlanResult]:
    """Named plans of gpt3-6.7b on 8 A100s with what they cost."""
    shapes = {"fast": dict(tp=2, pp=1, dp=4, zero=1), "slow": dict(tp=8, pp=1, dp=1),
              "oom": dict(tp=1, pp=1, dp=8)}
    out = {name: estimate_plan(name, model(), A100x8,
                               lambda kw=kw: Plan.uniform(model(), A100x8, micro_batch=1, global_batch=32, **kw))
           for name, kw in shapes.items()}
    out["none"] = PlanResult("none", error="no plan fits in memory")
    # The cases below rely on these facts of the cost model; check them, not assume them.
    assert out["fast"].fits and out["slow"].fits and not out["oom"].fits
    assert out["fast"].time < out["slow"].time
    return out


def result(searched: str, baselines: list[str]) -> ScenarioResult:
    p = plans()
    sc = Scenario(name="t", model="gpt3-6.7b", cluster=A100x8, cluster_source="homogeneous", global_batch=32)
    s = PlanResult("searched", p[searched].plan, p[searched].estimate, p[searched].error, seconds=0.5)
    bs = [PlanResult(n, p[b].plan, p[b].estimate, p[b].error) for n, b in zip(BASELINES, baselines)]
    return ScenarioResult(scenario=sc, model=model(), searched=s, baselines=bs)


VERDICTS = {
    "searched-fastest": ("fast", ["slow", "oom", "none"], "yes", True),
    "searched-slower-than-a-baseline": ("slow", ["fast", "oom", "none"], "**NO**", False),
    "no-baseline-fits": ("fast", ["oom", "none", "oom"], "yes (no baseline fits)", True),
    "search-found-nothing": ("none", ["fast", "slow", "oom"], "no searched plan fits", None),
}


@pytest.mark.parametrize("searched,baselines,text,ok", VERDICTS.values(), ids=list(VERDICTS))
def test_verdicts(searched, baselines, text, ok):
    res = result(searched, baselines)
    assert verdict(res) == text
    assert res.at_least_as_fast() is ok


def test_report_states_speedups_shortfalls_and_figures(tmp_path):
    res = result("fast", ["slow", "oom", "none"])
    track = MeasuredTrack(model="gpt-tiny", ranks=2, steps=4,
                          runs=[MeasuredRun("megatron", res.baselines[0].plan, 0.010, 0.012, "measured/x.json")])
    path = write_report([res], tmp_path, track)
    text = path.read_text()
    p = plans()
    speedup = p["slow"].time / p["fast"].time
    assert f"{speedup:.2f}x" in text
    short = res.shortfall(res.baselines[1])
    assert short.needed == pytest.approx(p["oom"].estimate.peak_memory_bytes)
    assert f"needs {short.needed / 2**30:.1f} GiB per GPU, {short.available / 2**30:.1f} GiB available" in text
    assert "DeepSpeed 3D: the rule produced no plan: no plan fits in memory" in text
    assert "at least as fast as every baseline that fits" in text
    assert "| 1.20 |" in text  # measured / predicted of the measured track
    for png in ("speedup.png", "search_time.png", "t-timeline.png", "t-memory.png", "measured.png"):
        assert (tmp_path / png).read_bytes()[:8] == PNG_MAGIC, png
        assert f"({png})" in text


def test_mixed_cluster_margin_and_headroom_are_reported(tmp_path):
    cluster = Cluster.load(ROOT / "examples" / "clusters" / "small-mixed-v100-t4.json")
    spec = autoplan.models.get("gpt3-350m")

    def make(**kw):
        return lambda: Plan.uniform(spec, cluster, micro_batch=1, global_batch=16, **kw)
    fast = estimate_plan("searched", spec, cluster, make(tp=1, pp=2, dp=4))
    slow = estimate_plan("megatron", spec, cluster, make(tp=4, pp=2, dp=1))
    assert fast.fits and slow.fits and fast.time < slow.time
    sc = Scenario(name="mixed", model="gpt3-350m", cluster=cluster, cluster_source="x", global_batch=16)
    res = ScenarioResult(scenario=sc, model=spec, searched=fast,
                         baselines=[slow, PlanResult("deepspeed-zero3", error="x"), PlanResult("deepspeed-3d", error="y")])
    text = write_report([res], tmp_path, MeasuredTrack("gpt-tiny", 2, 4, skipped="runtime not available")).read_text()
    assert f"margin {slow.time / fast.time - 1:+.1%} over the best fitting baseline (Megatron-LM)" in text
    rooms = res.headroom(fast)
    assert [h.devices for h in rooms] == ["v100", "t4"] and all(h.used == 4 for h in rooms)
    assert all(h.margin == pytest.approx(h.capacity - h.peak) for h in rooms)
    assert "Memory margin of the searched plan per device type" in text
    assert "skipped: runtime not available" in text


# ---------------------------------------------------------------------------------------------
def _search_and_baselines_present() -> bool:
    import importlib.util
    return (importlib.util.find_spec("search") is not None and hasattr(__import__("search"), "search")
            and importlib.util.find_spec("autoplan.baselines") is not None)


@pytest.mark.skipif(not _search_and_baselines_present(), reason="search/ or autoplan/baselines.py not present yet")
def test_small_scenario_end_to_end(tmp_path):
    path = tmp_path / "small.json"
    path.write_text(json.dumps({"name": "small", "model": "gpt3-125m", "global_batch": 32, "top_k": 2,
                                "cluster": {"device": "A100", "nodes": 1, "gpus_per_node": 4}}))
    res = run_scenario(Scenario.load(path))
    assert res.searched.fits, res.searched.error
    assert [b.name for b in res.baselines] == list(BASELINES)
    assert any(b.fits for b in res.baselines)
    assert res.at_least_as_fast() is True
    for b in res.baselines:
        if b.fits:
            assert res.searched.time <= b.time * (1 + 1e-9)
    # The same scenario through the command line writes the report with its figures.
    from autoplan.cli import main as cli_main
    assert cli_main(["bench", "--scenarios", str(tmp_path), "--out", str(tmp_path / "report"),
                     "--no-measured"]) == 0
    text = (tmp_path / "report" / "report.md").read_text()
    assert "the searched plan is at least as fast as every baseline that fits" in text
    assert "Not run (`--no-measured`)" in text
    # Per engine: the plan searched for it against its own rule (torchtitan builds no GPT).
    section = text.split("## Per engine")[1].split("\n## ")[0]
    assert "| small | Megatron-LM" in section and "| small | DeepSpeed 0.19.8" in section
    assert "gpt model, which torchtitan does not build" in section
    for png in ("speedup.png", "search_time.png", "small-timeline.png", "small-memory.png"):
        assert (tmp_path / "report" / png).read_bytes()[:8] == PNG_MAGIC, png
