"""`autoplan export plan.json --to megatron|deepspeed|torchtitan`: a plan as another
engine's configuration (see autoplan.export and docs/export.md)."""
from __future__ import annotations

import sys

from autoplan.commands._common import add_model_args


def register(sub) -> None:
    from autoplan.export import TARGETS
    p = sub.add_parser("export", help="write a plan as a Megatron-LM launch script, a DeepSpeed config or a "
                                      "torchtitan config",
                       description="Write a plan as the configuration of another training engine. Plans "
                                   "the engine cannot express are refused with the field and the nearest plan "
                                   "it can run (autoplan search --for ENGINE finds only such plans).")
    p.add_argument("plan", help="plan.json written by `autoplan search --out`")
    p.add_argument("--to", required=True, choices=TARGETS, help="target engine")
    add_model_args(p, required=False)
    p.add_argument("--cluster", default=None,
                   help="cluster.json the plan was made for: picks the devices' dtype (fp16 on V100/T4)")
    p.add_argument("--engine-version", default=None,
                   help="engine release (torchtitan: 0.3, a Python config, the default; 0.2, TOML)")
    p.add_argument("--out", default=None, help="output file (default: print to stdout)")
    p.set_defaults(func=run)


def run(args) -> int:
    from autoplan import Cluster
    from autoplan.commands._common import load_model
    from autoplan.export import export
    from autoplan.plan import Plan

    from autoplan.files import check_writable, write_text
    if args.out:
        check_writable(args.out, "export", "--out")
    plan = Plan.load(args.plan)
    cluster = Cluster.load(args.cluster) if args.cluster else None
    model = load_model(args, dtype=plan.dtype) if args.model else None
    result = export(plan, args.to, model, cluster=cluster, engine_version=args.engine_version)
    if args.out:
        write_text(args.out, result.text)
        print(f"wrote {args.out} ({args.to} {result.engine_version})", file=sys.stderr)
    else:
        sys.stdout.write(result.text)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    return 0
