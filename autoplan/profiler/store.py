"""Profile files and the store the cost model reads them through.

One JSON file per (device, dtype, torch version), named
``<device>_<dtype>_torch-<version>.json``::

    {"format": "autoplan-profile", "schema_version": 1,
     "device": "CPU", "dtype": "fp32", "torch_version": "2.13.0+cpu",
     "environment": {... torch version, hardware, threads, the command that made it ...},
     "settings": {"warmup": 3, "repeats": 10, "min_time_s": 0.05, "max_repeats": 200, "ops": true},
     "commands": ["autoplan profile --model gpt-tiny ..."],
     "shapes": {"<fingerprint>-s<tokens>": {"model", "kind", "seq_len", "fingerprint", "tokens",
                                             "config": {...}, "spec": {... LayerSpec ...}}},
     "layers": [{"shape", "tp", "micro_batch", "forward_ms", "backward_ms", "backward_input_ms",
                 "backward_weight_ms", "recompute_core_ms", "saved_bytes", ...}],
     "links": {"intra_node": {"backend", "world_size", "latency_us", "bandwidth_GBps", "by_op", "samples"}}}

:class:`ProfileStore` implements :class:`costmodel.compute.ProfileSource`: it matches
a LayerSpec to entries by :func:`shapes.shape_key`, interpolates linearly in the
micro-batch (extrapolating at most ``MAX_MB_EXTRAPOLATION`` times past the largest
measured one) and piecewise-linearly in sequence length between measured lengths
(never beyond them: attention grows quadratically), and answers None when the shape,
tensor-parallel degree, device or dtype was not measured, so the cost model falls
back to its roofline and says so.
"""
from __future__ import annotations

import json
import math
import re
from bisect import bisect_left
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Iterable

from autoplan.catalog import DeviceSpec, Link
from autoplan.errors import ConfigError
from autoplan.fields import FieldReader, check_float, check_text, load_json, parse_json_text
from autoplan.limits import MAX_GPUS, MAX_MICRO_BATCH, MAX_SEQ_LEN
from autoplan.models.spec import LayerSpec
from autoplan.profiler.environment import Environment
from autoplan.profiler.shapes import ShapeKey, shape_key, spec_from_dict
from costmodel.compute import LayerTiming
from costmodel.efficiency import Efficiency

FORMAT = "autoplan-profile"
SCHEMA_VERSION = 1
MAX_MB_EXTRAPOLATION = 2.0
"""A lookup may extrapolate the micro-batch line up to this multiple of the largest
measured micro-batch (layer time is affine in it until caches or memory saturate)."""
TIME_FIELDS = ("forward_ms", "backward_ms", "backward_input_ms", "recompute_core_ms")
MAX_PROFILE_FILES = 256
"""Profile files read from one directory."""
MAX_ENTRIES = 1_000_000
"""Layer entries (and shapes) in one profile file."""
MAX_MS = 1e9
"""Longest time a layer entry may record (11 days): larger is garbage, not a measurement."""


def file_name(device: str, dtype: str, torch_version: str) -> str:
    """``<device>_<dtype>_torch-<version>.json`` with unsafe characters replaced."""
    def slug(s: str) -> str:
        return re.sub(r"[^A-Za-z0-9.]+", "-", s).strip("-")
    return f"{slug(device)}_{slug(dtype)}_torch-{slug(torch_version)}.json"


class ProfileFile:
    """One profile file in memory; :meth:`save` rewrites it atomically, so an interrupted
    run leaves the last complete version on disk."""

    def __init__(self, path: Path, environment: Environment, dtype: str, settings: dict | None = None):
        self.path = Path(path)
        self.environment = environment
        self.dtype = dtype
        self.settings = dict(settings or {})
        self.shapes: dict[str, dict] = {}
        self.layers: list[dict] = []
        self.links: dict[str, dict] = {}
        self.commands: list[str] = [environment.command] if environment.command else []
        """Every command that added entries (the environment names the first)."""
        self._index: dict[tuple, int] = {}

    # -------------------------------------------------------------- identity
    @property
    def device(self) -> str:
        return self.environment.device

    @property
    def torch_version(self) -> str:
        return self.environment.torch_version

    # ------------------------------------------------------------------ I/O
    @classmethod
    def load(cls, path: str | Path) -> "ProfileFile":
        path = Path(path)
        data = load_json(path, "profile file", fix="delete it and profile again")
        return cls.from_dict(data, path)

    @classmethod
    def from_dict(cls, data: dict, path: Path) -> "ProfileFile":
        """Validate a parsed profile file (see :func:`read_profile`) and hold it."""
        env, dtype, settings, commands, shapes, layers, links = read_profile(data, Path(path).name)
        f = cls(path, env, dtype, settings)
        f.shapes = shapes
        for e in layers:
            f._put(e)
        f.links = links
        f.commands = commands or f.commands
        return f

    def to_dict(self) -> dict:
        return {"format": FORMAT, "schema_version": SCHEMA_VERSION, "device": self.device,
                "dtype": self.dtype, "torch_version": self.torch_version,
                "environment": self.environment.to_dict(), "settings": self.settings,
                "commands": self.commands, "shapes": self.shapes, "layers": self.layers, "links": self.links}

    def save(self) -> None:
        from autoplan.files import write_text
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_text(self.path, json.dumps(self.to_dict(), indent=1, sort_keys=False) + "\n")

    # -------------------------------------------------------------- entries
    def _put(self, entry: dict) -> None:
        key = (entry["shape"], int(entry["tp"]), int(entry["micro_batch"]))
        if key in self._index:
            self.layers[self._index[key]] = entry
        else:
            self._index[key] = len(self.layers)
            self.layers.append(entry)

    def get(self, shape_id: str, tp: int, micro_batch: int) -> dict | None:
        i = self._index.get((shape_id, tp, micro_batch))
        return None if i is None else self.layers[i]

    def add(self, shape_id: str, shape: dict, entry: dict) -> None:
        self.shapes.setdefault(shape_id, shape)
        self._put({"shape": shape_id, **entry})


@dataclass
class _Series:
    """Entries of one fingerprint and tensor-parallel degree: tokens -> micro-batch -> entry."""

    by_tokens: dict[int, dict[int, dict]] = field(default_factory=dict)
    """Sequence length -> micro-batch -> entry (in the store's statistic)."""


def _interp_mb(points: dict[int, dict], mb: int, name: str) -> float | None:
    xs = sorted(b for b in points if name in points[b])
    if not xs:
        return None
    if mb in points and name in points[mb]:
        return float(points[mb][name])
    if len(xs) == 1:
        return None
    if mb > xs[-1]:
        if mb > MAX_MB_EXTRAPOLATION * xs[-1]:
            return None
        lo, hi = xs[-2], xs[-1]
    elif mb < xs[0]:
        lo, hi = xs[0], xs[1]
    else:
        i = bisect_left(xs, mb)
        lo, hi = xs[i - 1], xs[i]
    y0, y1 = float(points[lo][name]), float(points[hi][name])
    y = y0 + (y1 - y0) * (mb - lo) / (hi - lo)
    # Extrapolating down a noisy line must not give a negative time: it is held at a quarter
    # of the nearer measured time (a floor, not a model: below the smallest micro-batch
    # measured the profile says little).
    return max(y, 0.25 * min(y0, y1))


def _interp(series: _Series, tokens: int, mb: int, name: str) -> float | None:
    if tokens in series.by_tokens:
        return _interp_mb(series.by_tokens[tokens], mb, name)
    ts = sorted(series.by_tokens)
    if not ts or not ts[0] < tokens < ts[-1]:
        return None
    i = bisect_left(ts, tokens)
    lo, hi = ts[i - 1], ts[i]
    y0 = _interp_mb(series.by_tokens[lo], mb, name)
    y1 = _interp_mb(series.by_tokens[hi], mb, name)
    if y0 is None or y1 is None:
        return None
    return y0 + (y1 - y0) * (tokens - lo) / (hi - lo)


class ProfileStore:
    """Measured profiles of one or more devices; a :class:`costmodel.compute.ProfileSource`.

        store = ProfileStore.load("profiles/")        # a directory, a file, or several
        est = autoplan.estimate(model, cluster, plan, profiles=store)
    """

    def __init__(self, files: Iterable[ProfileFile] = (), statistic: str | None = None):
        if statistic is not None and statistic not in ("median", "p10", "min"):
            raise ConfigError("statistic", f"{statistic!r} is not 'median', 'p10' or 'min'")
        self.statistic = statistic
        """Which summary of the repeats to read ('median', 'p10'); None = each file's own."""
        self.files: list[ProfileFile] = []
        self._series: dict[tuple[str, str], dict[tuple[str, int], _Series]] = {}
        self._keys: dict[LayerSpec, ShapeKey] = {}
        self._timings: dict[tuple, LayerTiming | None] = {}
        self._fits: dict[str, object] = {}
        self._efficiencies: dict[str, Efficiency | None] = {}
        for f in files:
            self.add(f)

    # -------------------------------------------------------------- loading
    @classmethod
    def load(cls, *paths: str | Path, statistic: str | None = None) -> "ProfileStore":
        """Profiles from files and directories (every ``*.json`` in a directory). A later
        file's entry replaces an earlier one with the same device, dtype and key."""
        files = []
        for p in paths:
            p = Path(p)
            if p.is_dir():
                found = sorted(p.glob("*.json"))
                if len(found) > MAX_PROFILE_FILES:
                    raise ConfigError(str(p), f"holds {len(found)} profile files, at most {MAX_PROFILE_FILES} "
                                      "are read", "keep one file per device, dtype and torch version")
                files += [ProfileFile.load(q) for q in found]
            elif p.exists():
                files.append(ProfileFile.load(p))
            else:
                raise ConfigError(str(p), "no such profile file or directory",
                                  "run `autoplan profile --model ... --out DIR` first")
        return cls(_prefer_current_torch(files), statistic)

    @classmethod
    def shipped(cls, statistic: str | None = None) -> "ProfileStore":
        """The profiles shipped in the package (``autoplan/data/profiles``): CPU profiles of
        the small zoo models, so the measured path is exercised in tests and CI."""
        root = resources.files("autoplan").joinpath("data/profiles")
        files = []
        if root.is_dir():
            for entry in sorted(root.iterdir(), key=lambda e: e.name):
                if entry.name.endswith(".json"):
                    files.append(ProfileFile.from_dict(parse_json_text(entry.read_text(), entry.name),
                                                       Path(entry.name)))
        return cls(_prefer_current_torch(files), statistic)

    def add(self, f: ProfileFile) -> None:
        self.files.append(f)
        dev = (f.device.lower(), f.dtype)
        series = self._series.setdefault(dev, {})
        for e in f.layers:
            shape = f.shapes[e["shape"]]
            fp, tokens = shape["fingerprint"], int(shape["tokens"])
            s = series.setdefault((fp, int(e["tp"])), _Series())
            s.by_tokens.setdefault(tokens, {})[int(e["micro_batch"])] = self._view(e)
        self._timings.clear()
        self._fits.clear()
        self._efficiencies.clear()

    def _view(self, e: dict) -> dict:
        """The entry with its times in this store's statistic."""
        alt = (e.get("statistics") or {}).get(self.statistic) if self.statistic else None
        return {**e, **alt} if alt else e

    # -------------------------------------------------------------- queries
    def _files_for(self, device: DeviceSpec) -> list[ProfileFile]:
        names = {device.name.lower(), *(a.lower() for a in device.aliases)}
        return [f for f in self.files if f.device.lower() in names]

    def _device_key(self, device: DeviceSpec, dtype: str) -> tuple[str, str] | None:
        for name in (device.name, *device.aliases):
            if (name.lower(), dtype) in self._series:
                return name.lower(), dtype
        return None

    def key(self, layer: LayerSpec) -> ShapeKey:
        k = self._keys.get(layer)
        if k is None:
            k = self._keys[layer] = shape_key(layer)
        return k

    def _series_of(self, device: DeviceSpec, key: ShapeKey, tp: int, dtype: str) -> "_Series | None":
        """The measurements of one layer shape at one tensor-parallel degree, if any."""
        dev = self._device_key(device, dtype)
        return None if dev is None else self._series[dev].get((key.fingerprint, tp))

    def _lookup(self, device: DeviceSpec, layer: LayerSpec, micro_batch: int, tp: int, dtype: str,
                names: tuple[str, ...]) -> dict[str, float] | None:
        k = self.key(layer)
        series = self._series_of(device, k, tp, dtype)
        if series is None:
            return None
        out = {}
        for name in names:
            v = _interp(series, k.tokens, micro_batch, name)
            if v is None:
                return None
            out[name] = v
        return out

    def layer_timing(self, device: DeviceSpec, layer: LayerSpec, micro_batch: int, tp: int,
                     sequence_parallel: bool, dtype: str) -> LayerTiming | None:
        """Measured seconds of ``layer`` on one rank, or None when not covered.

        Sequence parallelism is answered with the measurement without it: on one rank it
        only shortens the norms and residual adds (the replicated part) to s/t tokens, a
        small share of a layer, so this over-estimates an SP layer slightly."""
        memo = (device.name, layer, micro_batch, tp, dtype)
        if memo in self._timings:
            return self._timings[memo]
        got = self._lookup(device, layer, micro_batch, tp, dtype, TIME_FIELDS)
        timing = None
        if got is not None:
            f, b = got["forward_ms"] / 1e3, got["backward_ms"] / 1e3
            bi = min(got["backward_input_ms"] / 1e3, b)
            timing = LayerTiming(forward=f, backward=b, backward_input=bi, backward_weight=b - bi,
                                 recompute_selective=got["recompute_core_ms"] / 1e3, source="measured")
        self._timings[memo] = timing
        return timing

    def saved_bytes(self, device: DeviceSpec, layer: LayerSpec, micro_batch: int, tp: int, dtype: str,
                    recompute: str = "none") -> float | None:
        """Measured bytes autograd keeps for backward of one micro-batch on one rank
        (parameters excluded), by recompute mode, or None when not measured."""
        if recompute == "none":
            got = self._lookup(device, layer, micro_batch, tp, dtype, ("saved_bytes",))
            return None if got is None else got["saved_bytes"]
        k = self.key(layer)
        series = self._series_of(device, k, tp, dtype)
        if series is None:
            return None
        flat = _Series({t: {b: {"saved_bytes": e["recompute"][recompute]["saved_bytes"]}
                            for b, e in pts.items() if recompute in e.get("recompute", {})}
                        for t, pts in series.by_tokens.items()})
        return _interp(flat, k.tokens, micro_batch, "saved_bytes")

    def measured_layers(self, device: DeviceSpec) -> list:
        """Every entry of ``device`` as :class:`fit.MeasuredLayer` (any dtype)."""
        from autoplan.profiler.fit import MeasuredLayer
        out = []
        for f in self._files_for(device):
            specs = {sid: spec_from_dict(s["spec"]) for sid, s in f.shapes.items()}
            for e in map(self._view, f.layers):
                out.append(MeasuredLayer(
                    spec=specs[e["shape"]], tp=int(e["tp"]), micro_batch=int(e["micro_batch"]), dtype=f.dtype,
                    forward_s=e["forward_ms"] / 1e3, backward_s=e["backward_ms"] / 1e3,
                    ops_forward=e.get("ops_forward") or {}, ops_backward=e.get("ops_backward") or {}))
        return out

    def profiled_devices(self) -> list[DeviceSpec]:
        """Catalog specs of the devices with profiles (files naming unknown devices are skipped)."""
        from autoplan.catalog import get_device
        out, seen = [], set()
        for f in self.files:
            try:
                d = get_device(f.device)
            except ConfigError:
                continue
            if d.name not in seen:
                seen.add(d.name)
                out.append(d)
        return out

    def efficiency_fit(self, device: DeviceSpec):
        """The :class:`fit.EfficiencyFit` of a profiled device (cached), else None."""
        from autoplan.profiler.fit import fit_efficiency
        if device.name not in self._fits:
            self._fits[device.name] = fit_efficiency(device, self.measured_layers(device))
        return self._fits[device.name]

    def efficiency(self, device: DeviceSpec) -> Efficiency | None:
        """Roofline efficiencies for ``device``: fitted to its own measured layers when it
        was profiled; for a device never profiled, its catalog defaults scaled as the
        profiled devices of its vendor and class deviate from theirs
        (:func:`fit.transfer_efficiency`); None when nothing applies."""
        # Asked once per layer the profile does not cover: cache per device.
        if device.name in self._efficiencies:
            return self._efficiencies[device.name]
        fit = self.efficiency_fit(device)
        if fit is not None:
            eff = fit.efficiency
        else:
            from autoplan.profiler.fit import calibrates, transfer_efficiency
            peers = []
            for d in self.profiled_devices():
                if d.name != device.name and calibrates(d, device):
                    f = self.efficiency_fit(d)
                    if f is not None:
                        peers.append((d, f))
            eff = transfer_efficiency(device, peers)
        self._efficiencies[device.name] = eff
        return eff

    def link(self, device: DeviceSpec, link_class: str = "intra_node") -> Link | None:
        """The measured alpha-beta link among ``device``'s local ranks (achieved bandwidth,
        efficiency included), or None when no link benchmark was saved."""
        for f in reversed(self._files_for(device)):
            rec = f.links.get(link_class)
            bw = rec.get("bandwidth_GBps") if rec else None
            if isinstance(bw, (int, float)) and math.isfinite(bw) and bw > 0:
                return Link(bandwidth=rec["bandwidth_GBps"] * 1e9, latency=rec["latency_us"] * 1e-6,
                            name=f"measured {rec.get('backend', '')} {link_class}".strip())
        return None

    def summary(self) -> str:
        lines = []
        for f in self.files:
            models = sorted({s.get("model", "?") for s in f.shapes.values()})
            tps = sorted({int(e["tp"]) for e in f.layers})
            mbs = sorted({int(e["micro_batch"]) for e in f.layers})
            seqs = sorted({int(s.get("seq_len", 0)) for s in f.shapes.values()})
            lines.append(f"{f.path.name}: {f.environment.describe()}")
            lines.append(f"  {len(f.layers)} layer entries; models {', '.join(models) or '-'}; "
                         f"tp {tps}; micro-batch {mbs}; seq {seqs}")
            for cls_name, rec in f.links.items():
                bw = rec.get("bandwidth_GBps")
                bw_text = f"{bw:.2f} GB/s" if bw is not None else "bandwidth not resolvable at the sizes measured"
                lines.append(f"  link {cls_name}: {rec['latency_us']:.1f} us + {bw_text} "
                             f"({rec.get('backend', '?')}, {rec.get('world_size', '?')} ranks)")
            if f.environment.command:
                lines.append(f"  made by: {f.environment.command}")
        return "\n".join(lines) if lines else "no profiles"


def _prefer_current_torch(files: list[ProfileFile]) -> list[ProfileFile]:
    """Of files for the same device and dtype, keep those of the running torch version
    when there are any (kernels change between versions), else all of them."""
    try:
        import torch
        current = torch.__version__
    except ImportError:  # pragma: no cover - torch is a dependency
        return files
    groups: dict[tuple[str, str], list[ProfileFile]] = {}
    for f in files:
        groups.setdefault((f.device.lower(), f.dtype), []).append(f)
    keep = []
    for fs in groups.values():
        same = [f for f in fs if f.torch_version == current]
        keep += same or fs
    return [f for f in files if f in keep]


# ----------------------------------------------------------------------- validation
def _non_negative_numbers(value, where: str) -> None:
    """Every number in an entry is a measured time, size, count or spread: finite and
    >= 0 (a negative layer time is garbage, never a measurement)."""
    stack = [(value, where)]
    while stack:
        node, at = stack.pop()
        if isinstance(node, bool) or node is None or isinstance(node, str):
            continue
        if isinstance(node, (int, float)):
            check_float(node, at, minimum=0.0, maximum=MAX_MS if at.endswith("_ms") else None)
        elif isinstance(node, dict):
            stack += [(v, f"{at}.{k}") for k, v in node.items()]
        elif isinstance(node, list):
            stack += [(v, f"{at}[{i}]") for i, v in enumerate(node)]


def _read_entry(r: FieldReader, shapes: dict) -> dict:
    shape = r.str("shape")
    if shape not in shapes:
        raise ConfigError(r.path("shape"), f"{shape[:60]!r} is not in shapes")
    r.int("tp", minimum=1, maximum=MAX_GPUS)
    r.int("micro_batch", minimum=1, maximum=MAX_MICRO_BATCH)
    _non_negative_numbers(dict(r.data), r.where)
    for name in ("forward_ms", "backward_ms"):
        r.float(name, positive=True)
    for sub in ("statistics", "recompute", "ops_forward", "ops_backward"):
        table = r.sub(sub, None)
        for key in (table.data if table else ()):
            if sub in ("statistics", "recompute"):
                table.sub(key)
    stats = r.sub("statistics", None)
    for name in (stats.data if stats else ()):
        view = stats.sub(name)
        for t in ("forward_ms", "backward_ms"):
            if view.has(t):
                view.float(t, positive=True)
    rec = r.sub("recompute", None)
    for mode in (rec.data if rec else ()):
        if mode not in ("none", "selective", "full"):
            raise ConfigError(rec.path(mode), "is not a recompute mode", "none, selective or full")
        rec.sub(mode).float("saved_bytes", 0.0, minimum=0.0)
    return dict(r.data)


def _read_shape(r: FieldReader) -> dict:
    r.str("fingerprint")
    r.int("tokens", minimum=0, maximum=MAX_SEQ_LEN)
    r.int("seq_len", 0, minimum=0, maximum=MAX_SEQ_LEN)
    r.str("model", "")
    r.str("kind", "")
    r.sub("config", {})
    spec_from_dict(r.raw("spec"), r.path("spec"))
    return dict(r.data)


def _read_link(r: FieldReader) -> dict:
    r.str("backend", "")
    r.int("world_size", 2, minimum=1, maximum=MAX_GPUS)
    r.float("latency_us", minimum=0.0)
    # null: the sweep could not resolve a bandwidth (times did not grow with size).
    if r.has("bandwidth_GBps"):
        r.float("bandwidth_GBps", positive=True)
    _non_negative_numbers({k: v for k, v in r.data.items() if k not in ("unsupported",)}, r.where)
    return dict(r.data)


def read_profile(data, where: str) -> tuple:
    """(environment, dtype, settings, commands, shapes, layers, links) of a parsed profile
    file, every field checked: types, ranges, finite non-negative times and sizes, every
    entry's shape present. A problem is a ConfigError naming the field."""
    r = FieldReader(data, where)
    if r.raw("format", None) != FORMAT:
        raise ConfigError(where, f"is not an autoplan profile (format must be {FORMAT!r})")
    version = r.raw("schema_version", None)
    if version != SCHEMA_VERSION or isinstance(version, bool):
        raise ConfigError(r.path("schema_version"), f"{str(version)[:20]!r} is not supported (this autoplan "
                          f"reads version {SCHEMA_VERSION})", "profile again with this version")
    r.reject_unknown(("format", "schema_version", "device", "dtype", "torch_version", "environment", "settings",
                      "commands", "shapes", "layers", "links"))
    device, dtype, torch_version = r.str("device"), r.str("dtype", choices=("fp32", "bf16", "fp16")), \
        r.str("torch_version")
    env = Environment.read(r.sub("environment"))
    if env.device != device or env.torch_version != torch_version:
        raise ConfigError(r.path("environment"), "disagrees with the file's device or torch_version")
    settings = r.sub("settings", {})
    for key in settings.data:
        value = settings.data[key]
        if isinstance(value, str):
            settings.str(key)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            settings.float(key, minimum=0.0)
        elif not isinstance(value, bool) and value is not None:
            raise ConfigError(settings.path(key), "must be a number, a string or true/false")
    commands = [c for c in (r.list("commands", [], max_len=10_000))]
    for i, c in enumerate(commands):
        check_text(c, f"{r.path('commands')}[{i}]", multiline=True)
    shapes_r = r.sub("shapes")
    if len(shapes_r.data) > MAX_ENTRIES:
        raise ConfigError(shapes_r.where, f"has more than {MAX_ENTRIES:,} shapes")
    shapes = {sid: _read_shape(shapes_r.sub(sid)) for sid in shapes_r.data}
    layers = [_read_entry(e, shapes) for e in r.items("layers")] if r.list("layers", max_len=MAX_ENTRIES) else []
    links_r = r.sub("links", {})
    links = {name: _read_link(links_r.sub(name)) for name in links_r.data}
    return env, dtype, dict(settings.data), commands, shapes, layers, links
