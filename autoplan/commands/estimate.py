"""`autoplan estimate`: predicted iteration time and per-GPU memory of a plan."""
from __future__ import annotations

import json

from autoplan.commands._common import add_model_args, gib, load_model, load_profiles, table


def register(sub) -> None:
    p = sub.add_parser("estimate", help="predict iteration time and per-GPU memory of a plan")
    p.add_argument("--cluster", required=True, help="cluster.json")
    add_model_args(p)
    p.add_argument("--plan", required=True, help="plan.json (from `autoplan search --out`)")
    p.add_argument("--profiles", default=None,
                   help="folder of measured profiles (from `autoplan profile`); default: the shipped ones")
    p.add_argument("--no-overlap", action="store_true",
                   help="data-parallel gradient reduction does not overlap the backward (Megatron-LM before 2023)")
    p.add_argument("--timeline", default=None, metavar="PNG", help="draw the simulated schedule to this file")
    p.add_argument("--memory-plot", default=None, metavar="PNG", help="draw per-rank memory to this file")
    p.add_argument("--measured", default=None, metavar="RUN_JSON",
                   help="a measured-run record from `autoplan run --out`: print predicted vs measured")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from autoplan import Cluster, Plan, estimate
    cluster = Cluster.load(args.cluster)
    plan = Plan.load(args.plan)
    model = load_model(args, dtype=plan.dtype)
    est = estimate(model, cluster, plan, overlap_grad_reduce=not args.no_overlap,
                   profiles=load_profiles(args.profiles))
    if args.json:
        print(json.dumps(est.to_dict(), indent=2))
    else:
        print(f"model {model.describe()}")
        print(f"cluster {cluster.name}: {cluster.num_gpus} GPUs")
        print(est.summary())
        rows = []
        for g, (group, mem) in enumerate(zip(plan.groups, est.memory_by_group)):
            dev = cluster.slots[group.ranks[0]].device
            rows.append([str(g), f"{group.ranks[0]}-{group.ranks[-1]}", dev.name, gib(mem.weights),
                         gib(mem.gradients), gib(mem.optimizer), gib(mem.activations), gib(mem.transient),
                         gib(mem.overhead), gib(mem.total), gib(dev.memory_bytes)])
        print("\nmemory per GPU (GiB) by pipeline rank:")
        print(table(rows, ["pp", "ranks", "device", "weights", "grads", "optim", "activ", "temp", "other",
                           "total", "capacity"]))
        print("\ninputs: " + ", ".join(f"{d}: {s}" for d, s in est.sources.items()))
    if args.timeline or args.memory_plot:
        from autoplan import plots
        if args.timeline:
            plots.plot_timeline(est, args.timeline, title=f"{model.name} on {cluster.name}")
            print(f"wrote {args.timeline}")
        if args.memory_plot:
            plots.plot_memory(est, cluster, args.memory_plot)
            print(f"wrote {args.memory_plot}")
    if args.measured:
        from autoplan.runtime.record import compare_with_estimate, load_record
        print()
        print(compare_with_estimate(load_record(args.measured), est))
    return 0 if est.fits else 1
