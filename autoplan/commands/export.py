"""`autoplan export plan.json --to megatron|deepspeed|torchtitan`: a plan as another
framework's configuration (see autoplan.export and docs/export.md)."""
from __future__ import annotations

import sys

from autoplan.commands._common import add_model_args


def register(sub) -> None:
    from autoplan.export import TARGETS
    p = sub.add_parser("export", help="write a plan as Megatron-LM flags, a DeepSpeed config or a torchtitan TOML",
                       description="Write a plan as the configuration of another training framework. Plans "
                                   "the target cannot express are refused with the reason.")
    p.add_argument("plan", help="plan.json written by `autoplan search --out`")
    p.add_argument("--to", required=True, choices=TARGETS, help="target framework")
    add_model_args(p, required=False)
    p.add_argument("--out", default=None, help="output file (default: print to stdout)")
    p.set_defaults(func=run)


def run(args) -> int:
    from autoplan.commands._common import load_model
    from autoplan.export import export
    from autoplan.plan import Plan

    from autoplan.files import check_writable, write_text
    if args.out:
        check_writable(args.out, "export", "--out")
    plan = Plan.load(args.plan)
    model = load_model(args) if args.model else None
    result = export(plan, args.to, model)
    if args.out:
        write_text(args.out, result.text)
        print(f"wrote {args.out} ({args.to})", file=sys.stderr)
    else:
        sys.stdout.write(result.text)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    return 0
