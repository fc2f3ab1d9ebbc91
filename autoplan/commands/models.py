"""`autoplan models`: the zoo with parameter counts."""
from __future__ import annotations

from autoplan.commands._common import table


def register(sub) -> None:
    p = sub.add_parser("models", help="list the model zoo with parameter counts")
    p.add_argument("--filter", default="", help="only names containing this text")
    p.set_defaults(func=run)


def run(args) -> int:
    from autoplan import models
    from autoplan.models.presets import get_config
    rows = []
    for name in models.list_presets():
        if args.filter and args.filter.lower() not in name.lower():
            continue
        cfg = get_config(name)
        spec = models.from_config(cfg)
        shape = (f"{cfg.layers} x {cfg.hidden}, {cfg.heads} heads" if hasattr(cfg, "hidden")
                 else f"swin {'-'.join(map(str, cfg.depths))}, dim {cfg.embed_dim}")
        rows.append([name, cfg.arch, f"{spec.num_params / 1e9:.3f}B", shape, str(spec.seq_len)])
    print(table(rows, ["model", "arch", "params", "shape", "seq"]))
    return 0
