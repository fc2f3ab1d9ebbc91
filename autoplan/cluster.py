"""The cluster a plan runs on: groups of identical nodes and the links between them.

Ranks are numbered group by group, node by node, GPU by GPU, which is also the
order ``torchrun`` assigns them when the groups' hosts are listed in that order.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterable, Sequence

from autoplan.catalog import MAX_BANDWIDTH_GBps, MAX_LATENCY_us, DeviceSpec, Link, get_device
from autoplan.errors import ConfigError
from autoplan.fields import FieldReader, load_json
from autoplan.limits import MAX_GPUS, MAX_GPUS_PER_NODE, MAX_NODE_GROUPS
from autoplan.units import GB, GiB, TFLOPS, US

# When a cluster gives no inter-node link: one 100 Gbit/s NIC per GPU, a common
# cloud default, stated so that estimates are never silently optimistic.
DEFAULT_INTER_NODE = Link(bandwidth=12.5 * GB, latency=10 * US, name="100 Gbit/s (assumed)")


@dataclass(frozen=True)
class NodeGroup:
    """Identical nodes: same device type, GPU count and links."""

    name: str
    """Label used in reports and plans (e.g. 'v100')."""
    device: DeviceSpec
    """The accelerator in every node of the group."""
    nodes: int
    """Number of nodes."""
    gpus_per_node: int
    """Accelerators per node."""
    intra_node: Link
    """GPU-to-GPU link inside one node (per GPU, per direction)."""
    inter_node: Link | None = None
    """This group's NIC per GPU, overriding the cluster's default inter-node link."""

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class DeviceSlot:
    """Where one rank lives."""

    rank: int
    group: int
    """Index into ``Cluster.groups``."""
    node: int
    """Global node index across all groups."""
    local_rank: int
    device: DeviceSpec


@dataclass(frozen=True)
class Cluster:
    """Node groups plus the default inter-node link."""

    groups: tuple[NodeGroup, ...]
    """Groups of identical nodes, in rank order."""
    inter_node: Link = DEFAULT_INTER_NODE
    """Default per-GPU network link between nodes."""
    name: str = "cluster"
    description: str = ""

    def __post_init__(self):
        if not self.groups:
            raise ConfigError("node_groups", "a cluster needs at least one node group")
        if len(self.groups) > MAX_NODE_GROUPS:
            raise ConfigError("node_groups", f"{len(self.groups)} node groups, at most {MAX_NODE_GROUPS} allowed",
                              "put identical nodes in one group (its 'nodes' count)")
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ConfigError("node_groups", f"group names must be unique, {dup!r} is used twice")
        total = sum(g.num_gpus for g in self.groups)
        if total > MAX_GPUS:
            raise ConfigError("node_groups", f"the cluster has {total:,} GPUs, at most {MAX_GPUS:,} are supported",
                              "plan for a part of the cluster (plans rarely gain past a few thousand GPUs)")

    # ------------------------------------------------------------------ build
    @classmethod
    def load(cls, path: str | Path) -> "Cluster":
        """Read a cluster.json; every problem is reported as a ConfigError naming the field."""
        path = Path(path)
        return cls.from_dict(load_json(path), where=path.name)

    @classmethod
    def from_dict(cls, data: dict, where: str = "cluster") -> "Cluster":
        r = FieldReader(data, where)
        r.reject_unknown(("name", "description", "node_groups", "inter_node", "schema_version"))
        inter_r = r.sub("inter_node", None)
        groups = []
        r.list("node_groups", nonempty=True, max_len=MAX_NODE_GROUPS)
        for g in r.items("node_groups", nonempty=True):
            g.reject_unknown(("name", "device", "nodes", "gpus_per_node", "intra_node", "inter_node"))
            raw_device = g.raw("device")
            if isinstance(raw_device, str):
                device = get_device(raw_device, g.path("device"))
            else:
                device = DeviceSpec.read(g.sub("device"))
            intra_r = g.sub("intra_node", None)
            nic_r = g.sub("inter_node", None)
            groups.append(NodeGroup(
                name=g.str("name", f"group{len(groups)}"),
                device=device,
                nodes=g.int("nodes", 1, minimum=1, maximum=MAX_GPUS),
                gpus_per_node=g.int("gpus_per_node", minimum=1, maximum=MAX_GPUS_PER_NODE),
                intra_node=Link.read(intra_r) if intra_r else device.intra_node_link,
                inter_node=Link.read(nic_r) if nic_r else None,
            ))
        return cls(groups=tuple(groups),
                   inter_node=Link.read(inter_r) if inter_r else DEFAULT_INTER_NODE,
                   name=r.str("name", Path(where).stem), description=r.str("description", "", multiline=True))

    @classmethod
    def homogeneous(cls, device: str | DeviceSpec, nodes: int, gpus_per_node: int,
                    intra_node_GBps: float | None = None, inter_node_GBps: float | None = None,
                    intra_node_latency_us: float | None = None, inter_node_latency_us: float | None = None,
                    name: str | None = None) -> "Cluster":
        """``nodes`` identical nodes of ``gpus_per_node`` devices. Bandwidths are per GPU,
        per direction, in GB/s; None takes the device's catalog link for ``intra_node_GBps``
        and, for ``inter_node_GBps``, an *assumed* 100 Gbit/s NIC per GPU
        (:data:`DEFAULT_INTER_NODE`): give the real figure for a multi-node cluster, as
        the network often decides the best plan. The assumption is warned about and listed
        in :meth:`assumptions`."""
        from autoplan.fields import check_float
        dev = get_device(device) if isinstance(device, str) else device
        for field_name, v, top in (("nodes", nodes, MAX_GPUS), ("gpus_per_node", gpus_per_node, MAX_GPUS_PER_NODE)):
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= top:
                raise ConfigError(field_name, f"must be an integer in 1..{top}, got {v!r}")
        for field_name, v in (("intra_node_GBps", intra_node_GBps), ("inter_node_GBps", inter_node_GBps)):
            check_float(v, field_name, positive=True, maximum=MAX_BANDWIDTH_GBps)
        for field_name, v in (("intra_node_latency_us", intra_node_latency_us),
                              ("inter_node_latency_us", inter_node_latency_us)):
            check_float(v, field_name, minimum=0.0, maximum=MAX_LATENCY_us)
        intra = dev.intra_node_link
        if intra_node_GBps is not None or intra_node_latency_us is not None:
            intra = Link(bandwidth=(intra_node_GBps * GB if intra_node_GBps else intra.bandwidth),
                         latency=(intra_node_latency_us * US if intra_node_latency_us is not None else intra.latency),
                         name=intra.name)
        inter = DEFAULT_INTER_NODE
        if inter_node_GBps is not None or inter_node_latency_us is not None:
            inter = Link(bandwidth=(inter_node_GBps * GB if inter_node_GBps else inter.bandwidth),
                         latency=(inter_node_latency_us * US if inter_node_latency_us is not None else inter.latency),
                         name="inter-node")
        group = NodeGroup(name=dev.name, device=dev, nodes=nodes, gpus_per_node=gpus_per_node, intra_node=intra)
        cluster = cls(groups=(group,), inter_node=inter, name=name or f"{nodes}x{gpus_per_node}-{dev.name}")
        for note in cluster.assumptions():
            warnings.warn(f"Cluster.homogeneous: {note}", stacklevel=2)
        return cluster

    def assumptions(self) -> list[str]:
        """Figures this cluster takes on trust rather than from its description (today: the
        network of a multi-node cluster that names none), for reports to repeat."""
        out = []
        if self.num_nodes > 1 and any(g.inter_node is None for g in self.groups) and \
                self.inter_node is DEFAULT_INTER_NODE:
            out.append(f"no inter-node link given: assuming {DEFAULT_INTER_NODE.bandwidth / GB:g} GB/s "
                       "(100 Gbit/s) per GPU and 10 us latency; give inter_node for real figures")
        return out

    def to_dict(self) -> dict:
        out = {"name": self.name, "inter_node": self.inter_node.to_dict(), "node_groups": []}
        if self.description:
            out["description"] = self.description
        for g in self.groups:
            d = {"name": g.name, "device": g.device.to_dict(), "nodes": g.nodes,
                 "gpus_per_node": g.gpus_per_node, "intra_node": g.intra_node.to_dict()}
            if g.inter_node:
                d["inter_node"] = g.inter_node.to_dict()
            out["node_groups"].append(d)
        return out

    def save(self, path: str | Path) -> None:
        from autoplan.files import write_text
        write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    # ---------------------------------------------------------------- queries
    @cached_property
    def slots(self) -> tuple[DeviceSlot, ...]:
        """One entry per rank."""
        out, node = [], 0
        for gi, g in enumerate(self.groups):
            for _ in range(g.nodes):
                for local in range(g.gpus_per_node):
                    out.append(DeviceSlot(len(out), gi, node, local, g.device))
                node += 1
        return tuple(out)

    @property
    def num_gpus(self) -> int:
        return sum(g.num_gpus for g in self.groups)

    @property
    def num_nodes(self) -> int:
        return sum(g.nodes for g in self.groups)

    @property
    def is_homogeneous(self) -> bool:
        return len({g.device.name for g in self.groups}) == 1

    def device_types(self) -> list[DeviceSpec]:
        seen: dict[str, DeviceSpec] = {}
        for g in self.groups:
            seen.setdefault(g.device.name, g.device)
        return list(seen.values())

    def group_ranks(self, group: int) -> range:
        start = sum(g.num_gpus for g in self.groups[:group])
        return range(start, start + self.groups[group].num_gpus)

    def nic(self, group: int) -> Link:
        return self.groups[group].inter_node or self.inter_node

    def link(self, a: int, b: int) -> Link:
        """The link class between two ranks (intra-node, or the slower NIC of the two nodes)."""
        sa, sb = self.slots[a], self.slots[b]
        if sa.node == sb.node:
            return self.groups[sa.group].intra_node
        na, nb = self.nic(sa.group), self.nic(sb.group)
        return Link(bandwidth=min(na.bandwidth, nb.bandwidth), latency=max(na.latency, nb.latency),
                    name=na.name if na.bandwidth <= nb.bandwidth else nb.name)

    def nodes_spanned(self, ranks: Iterable[int]) -> int:
        return len({self.slots[r].node for r in ranks})

    def slowest_link(self, ranks: Sequence[int]) -> Link | None:
        """The bottleneck link of a ring over ``ranks`` (None for a single rank). A ring visits
        every node once, so it crosses the network iff the group spans nodes, and then
        runs at the slowest NIC among them; within one node it runs at the intra-node link."""
        ranks = list(ranks)
        if len(ranks) < 2:
            return None
        groups = {self.slots[r].group for r in ranks}
        if self.nodes_spanned(ranks) == 1:
            return self.groups[self.slots[ranks[0]].group].intra_node
        nics = [self.nic(g) for g in groups]
        slow = min(nics, key=lambda l: l.bandwidth)
        intra = min((self.groups[g].intra_node for g in groups), key=lambda l: l.bandwidth)
        # A NIC faster than the node's own fabric cannot be driven beyond that fabric.
        bw = min(slow.bandwidth, intra.bandwidth)
        return Link(bandwidth=bw, latency=max(l.latency for l in nics), name=slow.name)

    def summary(self) -> str:
        lines = [f"cluster {self.name}: {self.num_gpus} GPUs on {self.num_nodes} nodes"]
        if self.description:
            lines.append(f"  {self.description}")
        for g in self.groups:
            d = g.device
            # Name the dtype the half-precision peak really is (a V100 runs bf16 work as fp16).
            half = next(t for t in ("bf16", "fp16", "fp32") if t in d.peak_flops)
            nic = self.nic(self.groups.index(g))
            lines.append(
                f"  {g.name}: {g.nodes} x {g.gpus_per_node} {d.name}  {d.memory_bytes / GiB:.0f} GiB, "
                f"{d.peak_flops[half] / TFLOPS:.0f} TFLOP/s {half}, {d.memory_bandwidth / GB:.0f} GB/s HBM; "
                f"intra-node {g.intra_node.bandwidth / GB:g} GB/s, NIC {nic.bandwidth / GB:g} GB/s per GPU")
        lines += [f"  note: {a}" for a in self.assumptions()]
        return "\n".join(lines)
