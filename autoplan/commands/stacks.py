"""`autoplan stacks`: the training stacks the cost model knows, and what each assumes."""
from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("stacks", help="list the training stacks (software a plan runs on) and their figures")
    p.add_argument("name", nargs="?", help="show one stack in full, with the source of every figure")
    p.add_argument("--json", action="store_true", help="print as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from autoplan.commands._common import table
    from autoplan.stacks import get_stack, stack_names
    if args.name:
        stack = get_stack(args.name)
        data = stack.to_dict()
        if args.json:
            print(json.dumps(data, indent=2))
            return 0
        print(f"{stack.name}: {stack.description}\n  version: {stack.version}")
        for key, value in data.items():
            if key in ("schema_version", "name", "description", "version", "sources"):
                continue
            field = {"cuda_context_GiB": "cuda_context_bytes", "nccl_MiB_per_group": "nccl_bytes_per_group",
                     "dp_buffer_MiB": "dp_buffer_bytes"}.get(key, key)
            source = stack.sources.get(field) or stack.sources.get(key) or ""
            print(f"  {key} = {value:g}" if isinstance(value, float) else f"  {key} = {value}")
            if source:
                print(f"      {source}")
        return 0
    stacks = [get_stack(n) for n in stack_names()]
    if args.json:
        print(json.dumps([s.to_dict() for s in stacks], indent=2))
        return 0
    rows = [[s.name, s.attention, f"{s.state_bytes_per_param(1, 0):g}", f"{s.loss_peak_bytes_per_logit:g}",
             "yes" if s.overlap_grad_reduce else "no", s.description[:70]] for s in stacks]
    print(table(rows, ["stack", "attention", "state B/param", "loss B/logit", "DP overlap", "what"]))
    print("\n`autoplan stacks NAME` shows every figure with its source; pass --stack NAME to estimate/search.")
    return 0
