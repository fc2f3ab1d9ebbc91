"""Searched plans for each engine, exported and loaded by the engine's own code.

    python benchmarks/engine_exports.py [--out benchmarks/results/engine_exports.md]

For the README's example cluster (mixed V100 + T4) and eight DGX H100, and Llama-3 8B,
Llama-3 70B and Mixtral-8x7B: ``search --for ENGINE`` (timed), ``export --to ENGINE`` with
the cluster, then the export is loaded by the engine:

* Megatron-LM: the flag and validate_args table of autoplan/data/engines/megatron-lm.json;
  with MEGATRON_LM_PATH set, also Megatron-LM's own parse_args/validate_args
  (tests/engine_checks/megatron_validate.py);
* DeepSpeed: ``deepspeed.runtime.config.DeepSpeedConfig`` with the plan's data-parallel size;
* torchtitan 0.3: its ``ConfigManager`` (a model it ships) or the plan applied to its llama3
  config (a model it does not), then ``ParallelDims`` and the schedule lookup; with
  TORCHTITAN_0_2_PATH set, also the 0.2 TOML through torchtitan 0.2's ConfigManager.

Writes a Markdown table of plans, predicted iteration times, search times and verdicts.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autoplan  # noqa: E402
from autoplan.engines import get_engine  # noqa: E402
from autoplan.errors import AutoplanError, NoPlanFitsError  # noqa: E402
from autoplan.export import export  # noqa: E402
from autoplan.megatron_rules import broken_rules, parse_script, table  # noqa: E402

CLUSTERS = {"examples/clusters/mixed-v100-t4.json": 256, "examples/clusters/dgx-h100-8nodes.json": 512}
MODELS = ("llama3-8b", "llama3-70b", "mixtral-8x7b")
TARGETS = ("megatron", "deepspeed", "torchtitan")


def load_megatron(out, plan) -> str:
    argv, env = parse_script(out.text)
    broken = broken_rules(argv, env, world_size=plan.num_gpus, arch=9)
    if broken:
        return f"REFUSED by rule {broken[0].rule}"
    verdict = f"accepted by the table (@{table()['commit'][:7]})"
    path = os.environ.get("MEGATRON_LM_PATH")
    if path:
        proc = subprocess.run([sys.executable, str(ROOT / "tests/engine_checks/megatron_validate.py"),
                               str(plan.num_gpus)], input=out.text, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([path, os.environ.get("PYTHONPATH", "")])})
        verdict += "; validate_args: " + ("accepted" if "ACCEPTED" in proc.stdout
                                          else "REFUSED " + proc.stderr.strip().splitlines()[-1][:120])
    return verdict


def load_deepspeed(out, plan) -> str:
    from deepspeed.runtime import config as ds_config

    class DataParallel:
        def get_data_parallel_world_size(self):
            return plan.dp

    ds_config.dist.get_rank = lambda *a, **k: 0   # no process group in this script; the mpu gives dp
    cfg = ds_config.DeepSpeedConfig(json.loads(out.text), mpu=DataParallel())
    half = "bf16" if cfg.bfloat16_config.enabled else "fp16" if cfg.float16_config.enabled else "fp32"
    return (f"DeepSpeedConfig accepted (batch {cfg.train_batch_size} = {cfg.train_micro_batch_size_per_gpu} x "
            f"{cfg.gradient_accumulation_steps} x {plan.dp}, ZeRO-{cfg.zero_optimization_stage}, {half})")


def load_torchtitan(out, plan, workdir: Path, n: int) -> str:
    from torch.distributed.pipelining.schedules import get_schedule_class
    from torchtitan.config import ConfigManager
    from torchtitan.distributed.parallel_dims import ParallelDims
    module = f"autoplan_job_{n}"
    (workdir / f"{module}.py").write_text(out.text)
    if "def autoplan_plan():" in out.text:
        config = ConfigManager().parse_args(["--module", module, "--config", "autoplan_plan"])
        how = "ConfigManager accepted"
    else:
        config = ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_debugmodel"])
        config = importlib.import_module(module).apply_autoplan(config)
        config.__post_init__()   # Trainer.Config's own validation, on the settings applied
        how = "applied to torchtitan's llama3 config and validated (it ships no such model)"
    ParallelDims.from_config(config.parallelism, plan.num_gpus)
    get_schedule_class(config.parallelism.pipeline_parallel_schedule)
    return f"{how}; ParallelDims and schedule accepted"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/engine_exports.md"))
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--note", default="", help="a sentence added to the report's header (how it was run)")
    args = p.parse_args(argv)
    workdir = Path(tempfile.mkdtemp())
    sys.path.insert(0, str(workdir))
    import deepspeed
    import torchtitan  # noqa: F401
    versions = {"deepspeed": deepspeed.__version__, "torchtitan": importlib.metadata.version("torchtitan"),
                "megatron": f"main @ {table()['commit'][:7]} (table)"}
    rows, n = [], 0
    t_all = time.perf_counter()
    for cluster_file, gb in CLUSTERS.items():
        cluster = autoplan.Cluster.load(ROOT / cluster_file)
        for name in args.models.split(","):
            for target in TARGETS:
                n += 1
                engine = get_engine(target)
                t0 = time.perf_counter()
                try:
                    result = autoplan.search(autoplan.models.get(name), cluster, gb, target=target, progress=False)
                except NoPlanFitsError as e:
                    rows.append([cluster.name, name, target, "no plan fits", "–", f"{time.perf_counter() - t0:.0f}",
                                 str(e).split(". ")[1][:140] + "..."])
                    print(rows[-1], flush=True)
                    continue
                secs = time.perf_counter() - t0
                plan = result.best.plan
                model = autoplan.models.get(name, dtype=plan.dtype)
                try:
                    out = export(plan, target, model, cluster=cluster)
                    if target == "megatron":
                        verdict = load_megatron(out, plan)
                    elif target == "deepspeed":
                        verdict = load_deepspeed(out, plan)
                    else:
                        verdict = load_torchtitan(out, plan, workdir, n)
                except (AutoplanError, AssertionError, ValueError) as e:
                    verdict = f"FAILED: {e}"
                rows.append([cluster.name, name, f"{engine.title} {versions[target]}",
                             f"`{plan.describe()}` ({out.suffix}, {plan.dtype})",
                             f"{result.best.estimate.iteration_time_s:.3g}", f"{secs:.0f}", verdict])
                print(rows[-1], flush=True)
    import torch
    lines = ["# Searched plans exported to the engines and loaded by them", "",
             f"Generated by `python benchmarks/engine_exports.py` in {time.perf_counter() - t_all:.0f} s with torch "
             f"{torch.__version__}, Python {platform.python_version()}, DeepSpeed {versions['deepspeed']}, torchtitan "
             f"{versions['torchtitan']}, Megatron-LM flags and validate_args rules from commit {table()['commit']}"
             + (" and its own validate_args (MEGATRON_LM_PATH)" if os.environ.get("MEGATRON_LM_PATH") else "") + ".",
             "Iteration times are cost-model estimates (the engine's stack) for the searched plan; search time is "
             "this 2-core machine's wall time." + (f" {args.note}" if args.note else ""), "",
             "| cluster | model | engine | searched plan (`search --for`) | iteration (s) | search (s) | "
             "loaded by the engine |", "|---|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
