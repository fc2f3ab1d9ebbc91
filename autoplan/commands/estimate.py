"""`autoplan estimate`: predicted iteration time and per-GPU memory of a plan."""
from __future__ import annotations

import json

from autoplan.commands._common import add_cost_model_args, add_model_args, cost_model_options, gib, load_model, table


def register(sub) -> None:
    p = sub.add_parser("estimate", help="predict iteration time and per-GPU memory of a plan")
    p.add_argument("--cluster", required=True, help="cluster.json")
    add_model_args(p)
    p.add_argument("--plan", required=True, help="plan.json (from `autoplan search --out`)")
    p.add_argument("--timeline", default=None, metavar="PNG", help="draw the simulated schedule to this file")
    p.add_argument("--memory-plot", default=None, metavar="PNG", help="draw per-rank memory to this file")
    p.add_argument("--measured", default=None, metavar="RUN_JSON",
                   help="a measured-run record from `autoplan run --out`: print predicted vs measured")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    add_cost_model_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from autoplan import Cluster, Plan
    from autoplan.files import check_writable
    from costmodel import estimate
    for flag, path in (("--timeline", args.timeline), ("--memory-plot", args.memory_plot)):
        if path:
            check_writable(path, "figure", flag)   # before the work, not after it
    cluster = Cluster.load(args.cluster)
    plan = Plan.load(args.plan)
    options = cost_model_options(args)
    model = load_model(args, dtype=plan.dtype)
    est = estimate(model, cluster, plan, options)
    if args.json:
        print(json.dumps(est.to_dict(), indent=2))
    else:
        print(f"model {model.describe()}")
        print(f"cluster {cluster.name}: {cluster.num_gpus} GPUs")
        for note in cluster.assumptions():
            print(f"note: {note}")
        print(est.summary())
        rows = []
        for g, (group, mem) in enumerate(zip(plan.groups, est.memory_by_group)):
            dev = cluster.slots[group.ranks[0]].device
            rows.append([str(g), f"{group.ranks[0]}-{group.ranks[-1]}", dev.name, gib(mem.weights),
                         gib(mem.gradients), gib(mem.optimizer), gib(mem.activations), gib(mem.transient),
                         gib(mem.buffers + mem.nccl), gib(mem.context), gib(mem.fragmentation), gib(mem.total),
                         gib(dev.memory_bytes), gib(dev.memory_bytes - mem.total)])
        print(f"\nmemory per GPU (GiB) by pipeline rank, stack {est.stack}:")
        print(table(rows, ["pp", "ranks", "device", "weights", "grads", "optim", "activ", "temp", "comm buf",
                           "context", "frag", "total", "capacity", "free"]))
        if est.tight:
            print(f"tight: less than {est.memory_margin:.0%} of a device's memory stays free; the prediction's "
                  "own error could tip it over (see the 80% range)")
        print("\ninputs: " + "; ".join(f"{k}: {v}" for k, v in est.inputs.items()))
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
