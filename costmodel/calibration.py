"""A calibration: a small, named set of cost-model parameters fitted from measured runs of
one training stack on given devices, with the leave-one-out error of the fit.

The cost model is computed from first principles (peaks, efficiencies, bytes); a
calibration only scales what the measurements show the principles miss on a machine:
per device, how much slower compute runs than modelled and what each kernel launch
costs (dominant on CPUs and for small layers); per stack, how much more (or less) the
dynamic memory is and a constant overhead per rank. ``autoplan calibrate`` fits one
(:mod:`autoplan.calibrate`); ``estimate(..., calibration=)`` applies it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from autoplan.errors import ConfigError
from autoplan.fields import FieldReader, load_json
from autoplan.units import GiB
from autoplan.catalog import is_accelerator

SCHEMA_VERSION = 2
"""2: an accelerator's costs per kernel and per step are its host's, beside the device
(``costmodel.host``); version 1 added them to the device's time."""
KIND = "autoplan-calibration"


@dataclass(frozen=True)
class DeviceCalibration:
    """Fitted compute parameters of one device type."""

    compute_scale: float = 1.0
    """Measured over modelled compute time of the roofline (kernels' FLOPs and bytes)."""
    launch_s: float | None = None
    """Fixed cost per kernel in seconds: on a CPU part of its compute, on an accelerator
    the host's, beside the device (``costmodel.host``). None: the device family's launch
    cost (CPU) or the stack's host cost (accelerator)."""
    step_overhead_s: float | None = None
    """Fixed host-side seconds per training step the roofline does not see (Python, the
    optimizer's per-tensor loops, synchronisation); as ``launch_s``, beside an
    accelerator's work. None: the stack's host cost per step (accelerator), none (CPU)."""


@dataclass(frozen=True)
class Calibration:
    """Parameters fitted from measured runs, and how well they predict runs left out."""

    stack: str
    """The training stack the runs used; applying it to another stack is refused."""
    devices: dict[str, DeviceCalibration]
    """Per device name (catalog spelling): its compute parameters."""
    activation_scale: float = 1.0
    """Measured over modelled dynamic memory (activations, temporaries)."""
    memory_overhead_bytes: float = 0.0
    """Extra bytes per rank the measurements show beyond the model (may be negative)."""
    time_error: tuple[float, float] = (0.0, 0.0)
    """10th and 90th percentile of measured/predicted - 1 for step time, leave-one-out."""
    memory_error: tuple[float, float] = (0.0, 0.0)
    """The same for peak memory (0, 0 when no run measured memory)."""
    runs: int = 0
    """Measured runs the parameters were fitted on."""
    loo_time_mape: float = 0.0
    """Mean absolute relative error of step time predicted for each run by a calibration
    fitted on all the others."""
    loo_memory_mape: float | None = None
    """The same for peak memory (None when the runs measured none)."""
    source: dict = field(default_factory=dict, compare=False, hash=False)
    """What it was fitted from: command, run files, date."""

    def device(self, name: str) -> DeviceCalibration | None:
        return self.devices.get(name)

    def check(self, devices: list[str], stack: str) -> None:
        """Refuse a calibration fitted on other devices or another stack."""
        if stack != self.stack:
            raise ConfigError("calibration.stack", f"was fitted for stack {self.stack!r}, the estimate uses "
                              f"{stack!r}", f"pass --stack {self.stack} or calibrate on runs of {stack}")
        if not any(d in self.devices for d in devices):
            raise ConfigError("calibration.devices", f"fitted for {', '.join(sorted(self.devices))}, but the "
                              f"cluster has {', '.join(sorted(set(devices)))}",
                              "calibrate on runs of these devices, or leave the calibration out")

    def to_dict(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, "kind": KIND, "stack": self.stack,
                "devices": {n: {"compute_scale": d.compute_scale,
                                **({"step_overhead_ms": d.step_overhead_s * 1e3}
                                   if d.step_overhead_s is not None else {}),
                                **({"launch_us": d.launch_s * 1e6} if d.launch_s is not None else {})}
                            for n, d in sorted(self.devices.items())},
                "activation_scale": self.activation_scale,
                "memory_overhead_GiB": self.memory_overhead_bytes / GiB,
                "time_error": list(self.time_error), "memory_error": list(self.memory_error),
                "runs": self.runs, "loo_time_mape": self.loo_time_mape, "loo_memory_mape": self.loo_memory_mape,
                "source": self.source}

    def save(self, path: str | Path) -> None:
        from autoplan.fields import write_text_atomic
        write_text_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: dict, where: str = "calibration") -> "Calibration":
        r = FieldReader(data, where)
        r.reject_unknown(("schema_version", "kind", "stack", "devices", "activation_scale", "memory_overhead_GiB",
                          "time_error", "memory_error", "runs", "loo_time_mape", "loo_memory_mape", "source"))
        if r.str("kind", KIND) != KIND:
            raise ConfigError(r.path("kind"), f"is {r.str('kind')!r}, not a calibration ({KIND!r})",
                              "make one with `autoplan calibrate`")
        version = r.int("schema_version", SCHEMA_VERSION)
        if version > SCHEMA_VERSION:
            raise ConfigError(r.path("schema_version"), "is newer than this autoplan understands", "upgrade autoplan")
        devices = {}
        dev_r = r.sub("devices")
        if not dev_r.data:
            raise ConfigError(r.path("devices"), "must name at least one device")
        for name in dev_r.data:
            d = dev_r.sub(name)
            if version < 2 and is_accelerator(str(name)):
                raise ConfigError(r.path("schema_version"), f"is {version}: its {name} costs per kernel and "
                                  "per step were fitted as added to the device's time, now the host's beside it",
                                  "recalibrate with `autoplan calibrate`")
            d.reject_unknown(("compute_scale", "launch_us", "step_overhead_ms"))
            launch = d.float("launch_us", None, minimum=0.0)
            step = d.float("step_overhead_ms", None, minimum=0.0)
            scale = d.float("compute_scale", 1.0, positive=True)
            if scale > 1e3:
                raise ConfigError(d.path("compute_scale"), f"{scale:g} is not a plausible slowdown", "recalibrate")
            devices[str(name)] = DeviceCalibration(compute_scale=scale,
                                                   launch_s=None if launch is None else launch * 1e-6,
                                                   step_overhead_s=None if step is None else step * 1e-3)

        def pair(key):
            v = r.list(key, [0.0, 0.0])
            if len(v) != 2 or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
                raise ConfigError(r.path(key), f"must be two numbers [low, high], got {v!r}")
            if not all(abs(x) < 10 for x in v) or v[0] > v[1]:
                raise ConfigError(r.path(key), f"must be [low <= high] relative errors, got {v!r}")
            return (float(v[0]), float(v[1]))
        return cls(stack=r.str("stack"), devices=devices,
                   activation_scale=r.float("activation_scale", 1.0, positive=True),
                   memory_overhead_bytes=r.float("memory_overhead_GiB", 0.0) * GiB,
                   time_error=pair("time_error"), memory_error=pair("memory_error"),
                   runs=r.int("runs", 0, minimum=0), loo_time_mape=r.float("loo_time_mape", 0.0, minimum=0.0),
                   loo_memory_mape=r.float("loo_memory_mape", None, minimum=0.0),
                   source=dict(r.raw("source", {})) if isinstance(r.raw("source", {}), dict) else {})

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        path = Path(path)
        return cls.from_dict(load_json(path, "calibration file", "make one with `autoplan calibrate`"),
                             where=path.name)
