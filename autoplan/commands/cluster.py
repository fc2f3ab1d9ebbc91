"""`autoplan cluster show FILE`: what a cluster.json describes."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("cluster", help="inspect a cluster.json")
    csub = p.add_subparsers(dest="cluster_command", metavar="ACTION", required=True)
    show = csub.add_parser("show", help="summarize devices, memory, peak FLOP/s and links")
    show.add_argument("file", help="path to cluster.json")
    show.set_defaults(func=run)


def run(args) -> int:
    from autoplan.cluster import Cluster
    print(Cluster.load(args.file).summary())
    return 0
