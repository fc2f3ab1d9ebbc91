"""`autoplan search`: the best parallel plans for a model on a cluster."""
from __future__ import annotations

import json
import sys
import textwrap

import argparse

from autoplan.commands._common import add_cost_model_args, add_model_args, cost_model_options, int_in, load_model
from autoplan.limits import MAX_GLOBAL_BATCH, MAX_TOP_K


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} lists no integers, e.g. 1,2,4")
    return values   # ranges are checked by search.space.Constraints (--zero takes 0)


def _words(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def register(sub) -> None:
    p = sub.add_parser("search", help="find the fastest plans that fit (searched, then ranked by the cost model)")
    p.add_argument("--cluster", required=True, help="cluster.json")
    add_model_args(p)
    p.add_argument("--global-batch", type=int_in(1, MAX_GLOBAL_BATCH), required=True,
                   help="samples (sequences) per iteration")
    p.add_argument("--top-k", type=int_in(1, MAX_TOP_K), default=5, help="plans to show (default 5)")
    p.add_argument("--out", default=None, metavar="PLAN_JSON",
                   help="write the best plan (with its estimate) for `autoplan estimate` / `autoplan run`")
    p.add_argument("--explain", action="store_true", help="say why the best plan beats the runner-up")
    p.add_argument("--json", action="store_true", help="print the ranking as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="return the best plan found within this many seconds, with how far from optimal it may be")
    g = p.add_argument_group("narrow the search space (comma-separated lists)")
    g.add_argument("--tp", type=_ints, default=None, help="tensor-parallel degrees, e.g. 4,8")
    g.add_argument("--pp", type=_ints, default=None, help="pipeline depths")
    g.add_argument("--dp", type=_ints, default=None, help="data-parallel degrees")
    g.add_argument("--ep", type=_ints, default=None, help="expert-parallel degrees (mixture-of-experts models)")
    g.add_argument("--cp", type=_ints, default=None,
                   help="context-parallel degrees (default: 1 and those leaving each rank >= 4096 tokens)")
    g.add_argument("--cp-comm", type=_words, default=None,
                   help="context-parallel exchanges: p2p,all_gather,a2a (default: all)")
    g.add_argument("--micro-batch", type=_ints, default=None, help="micro-batch sizes")
    g.add_argument("--schedules", type=_words, default=None,
                   help="gpipe,1f1b,interleaved-1f1b,zero-bubble (default: all)")
    g.add_argument("--recompute", type=_words, default=None, help="none,selective,full (default: all)")
    g.add_argument("--zero", type=_ints, default=None, help="ZeRO stages, e.g. 0,1 (default: 0-3)")
    g.add_argument("--no-sequence-parallel", action="store_true", help="never use sequence parallelism")
    g.add_argument("--use-all-gpus", action="store_true", help="only plans that use every GPU")
    g.add_argument("--layouts", action="store_true",
                   help="also search every operator's layout on the tensor-parallel axis (CP-SAT over "
                        "DTensor's strategies), with co-shard and interlaced variants; see docs/operators.md")
    e = p.add_argument_group("target engine")
    from autoplan.engines import ENGINE_NAMES
    e.add_argument("--for", dest="target", default="autoplan", choices=ENGINE_NAMES,
                   help="search only plans this engine can run, with its stack unless --stack says otherwise "
                        "(default: autoplan's own runtime)")
    e.add_argument("--engine-version", default=None,
                   help="release of the --for engine (torchtitan: 0.3, the default, or 0.2)")
    add_cost_model_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from autoplan import Cluster
    from autoplan.errors import NoPlanFitsError
    from search import search

    if args.out:
        from autoplan.files import check_writable
        check_writable(args.out, "plan", "--out")   # before the search, not after it
    cluster = Cluster.load(args.cluster)
    if args.stack is None and args.target != "autoplan":
        from autoplan.stacks import TARGET_STACKS
        args.stack = TARGET_STACKS[args.target]   # the engine's stack unless --stack says otherwise
    options = cost_model_options(args)
    model = load_model(args)
    constraints = {"progress": not args.no_progress and not args.json, "options": options}
    for name in ("tp", "pp", "dp", "cp", "cp_comm", "ep", "micro_batch", "schedules", "recompute", "zero"):
        value = getattr(args, name)
        if value is not None:
            constraints[name] = value
    if args.no_sequence_parallel:
        constraints["sequence_parallel"] = [False]
    if args.use_all_gpus:
        constraints["use_all_gpus"] = True
    constraints["target"] = args.target
    if args.engine_version:
        constraints["engine_version"] = args.engine_version
    if args.time_limit is not None:
        constraints["time_limit"] = args.time_limit
    if args.layouts:
        from autoplan.errors import ConfigError
        from search.operators import search_operator_plans
        if args.target != "autoplan":
            raise ConfigError("--for", f"per-operator layouts run on autoplan's runtime only, not {args.target}",
                              "drop --layouts or --for")
        constraints.pop("sequence_parallel", None)

        def search(model, cluster, global_batch, **c):  # noqa: F811 - the operator-level search
            return search_operator_plans(model.config if model.config is not None else args.model, cluster,
                                         global_batch, **c)
    try:
        result = search(model, cluster, args.global_batch, **constraints)
    except NoPlanFitsError as e:
        print(textwrap.fill(f"autoplan search: {e}", width=100), file=sys.stderr)
        return 2
    best = result.best
    if args.out:
        best.plan.save(args.out, extra={"estimate": best.estimate.to_dict()})
    if args.json:
        print(json.dumps({"model": model.name, "cluster": cluster.name, "global_batch": args.global_batch,
                          "target": result.target, "stack": options.stack.name,
                          "ranked": [{"rank": rp.rank, "plan": rp.plan.to_dict(),
                                      "estimate": rp.estimate.to_dict(), "gpus_used": rp.gpus_used}
                                     for rp in result.ranked[:args.top_k]],
                          "notes": list(result.notes),
                          "stats": {k: v for k, v in vars(result.stats).items() if k != "placement"}},
                         indent=2, default=str))
        return 0
    print(f"model {model.describe()}")
    print(f"cluster {cluster.name}: {cluster.num_gpus} GPUs, global batch {args.global_batch}; "
          f"stack {options.stack.name}" + (", calibrated" if options.calibration else ""))
    if result.target != "autoplan":
        from autoplan.engines import get_engine
        eng = get_engine(result.target, args.engine_version)
        print(f"plans {eng.title} {eng.version} can run (autoplan export --to {eng.name})")
    for note in (*cluster.assumptions(), *result.notes):
        print(f"note: {note}")
    print()
    print(result.table(args.top_k))
    print()
    print(result.stats.summary())
    if args.explain:
        print()
        print(result.explain())
    if args.out:
        print(f"\nwrote {args.out} (best plan: {best.plan.describe()})")
    return 0
