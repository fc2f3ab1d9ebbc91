"""Where a profile was measured: the device it stands for in the catalog and the software
and hardware around it. Recorded in every profile file, because a timing means nothing
without the library version, the processor and the thread count that produced it."""
from __future__ import annotations

import datetime
import os
import platform
import re
from dataclasses import asdict, dataclass

from autoplan.catalog import DeviceSpec, devices, get_device
from autoplan.errors import ConfigError

DEVICE_KINDS = ("cpu", "cuda")


@dataclass(frozen=True)
class Environment:
    """The measuring machine."""

    device: str
    """Catalog device name the measurements stand for (e.g. 'A100-SXM4-80GB', 'CPU')."""
    device_kind: str
    """'cpu' or 'cuda' (torch device type the kernels ran on)."""
    hardware: str
    """Processor model: the GPU's name as the driver reports it, or the CPU model."""
    torch_version: str
    """torch.__version__ of the measuring process."""
    threads: int
    """torch intra-op threads (what bounds CPU kernels)."""
    cpu_model: str = ""
    """Host CPU model (also recorded for GPU runs: it bounds kernel launch overhead)."""
    cuda_version: str = ""
    """CUDA runtime torch was built with ('' on CPU builds)."""
    python_version: str = ""
    """Python of the measuring process."""
    platform: str = ""
    """OS and architecture."""
    command: str = ""
    """The command or call that produced the file, so it can be re-run."""
    created: str = ""
    """UTC time the file was started, ISO 8601."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "environment") -> "Environment":
        from autoplan.fields import FieldReader
        return cls.read(FieldReader(d, where))

    @classmethod
    def read(cls, r) -> "Environment":
        """From a :class:`~autoplan.fields.FieldReader` over a profile's ``environment``;
        every field typed (unknown ones, from newer versions, are ignored)."""
        text = {"command": True}
        values = {}
        for name in cls.__dataclass_fields__:
            if name == "threads":
                values[name] = r.int(name, minimum=0, maximum=1_000_000)
            elif name in ("device", "device_kind", "hardware", "torch_version"):
                values[name] = r.str(name)
            else:
                values[name] = r.str(name, "", multiline=text.get(name, False))
        return cls(**values)

    def same_machine(self, other: "Environment") -> bool:
        """Whether measurements of ``other`` may be merged with ours in one file."""
        return (self.device == other.device and self.hardware == other.hardware
                and self.torch_version == other.torch_version and self.threads == other.threads)

    def describe(self) -> str:
        return (f"{self.device} ({self.hardware}), torch {self.torch_version}, {self.threads} threads"
                + (f", CUDA {self.cuda_version}" if self.cuda_version else ""))


def cpu_model() -> str:
    """The CPU's marketing name, from /proc/cpuinfo where there is one."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _normalise(name: str) -> str:
    text = name.upper().replace(" ", "-").replace("_", "-")
    for prefix in ("NVIDIA-", "TESLA-", "AMD-INSTINCT-", "AMD-", "GEFORCE-"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    return text


def catalog_device_for_gpu(gpu_name: str, memory_bytes: float) -> DeviceSpec:
    """The catalog entry a GPU the driver names ``gpu_name`` stands for.

    Driver names ('NVIDIA H100 80GB HBM3', 'NVIDIA A100-SXM4-80GB', 'Tesla V100-SXM2-32GB')
    do not follow the catalog's spelling, so: an exact name or alias first, else the
    catalog devices whose family (the name's first dash-separated word, e.g. 'H100')
    appears in the driver's name, PCIe or not as the driver says, nearest in memory."""
    text = _normalise(gpu_name)
    try:
        return get_device(text)
    except ConfigError:
        pass
    words = set(re.split(r"[-\s]+", text))
    pcie = "PCIE" in text
    candidates = []
    for d in devices():
        family = d.name.split("-")[0].upper()
        if family in words or family in text.replace("-", ""):
            if ("PCIE" in d.name.upper()) == pcie:
                candidates.append(d)
    if not candidates:
        raise ConfigError("device_name", f"the GPU {gpu_name!r} matches no catalog device",
                          "pass --device-name with a catalog name (see `autoplan devices`)")
    return min(candidates, key=lambda d: abs(d.memory_bytes - memory_bytes))


def resolve_device(device: str, device_name: str | None = None) -> tuple[str, DeviceSpec]:
    """(torch device string, catalog DeviceSpec) for ``--device`` and ``--device-name``."""
    import torch

    kind = device.split(":")[0].lower()
    if kind not in DEVICE_KINDS:
        raise ConfigError("device", f"{device!r} is not one of {list(DEVICE_KINDS)}")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device", "cuda was asked for but torch sees no GPU",
                              "use --device cpu, or a CUDA build of torch on a GPU machine")
        index = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
        torch_device = f"cuda:{index}"
        if device_name:
            return torch_device, get_device(device_name, "device_name")
        props = torch.cuda.get_device_properties(index)
        return torch_device, catalog_device_for_gpu(props.name, props.total_memory)
    return "cpu", get_device(device_name or "CPU", "device_name")


def capture(torch_device: str, spec: DeviceSpec, command: str = "") -> Environment:
    """The environment of this process measuring on ``torch_device``."""
    import torch

    cpu = cpu_model()
    if torch_device.startswith("cuda"):
        hardware = torch.cuda.get_device_name(torch.device(torch_device))
    else:
        hardware = cpu
    return Environment(
        device=spec.name, device_kind=torch_device.split(":")[0], hardware=hardware,
        torch_version=torch.__version__, threads=torch.get_num_threads(), cpu_model=cpu,
        cuda_version=torch.version.cuda or "", python_version=platform.python_version(),
        platform=f"{platform.system()} {platform.machine()}", command=command,
        created=datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat())


def available_memory_bytes(torch_device: str) -> float:
    """Memory a profile run may use on the device: free GPU memory, or the host's
    available RAM (MemAvailable) on CPU."""
    import torch

    if torch_device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(torch_device))
        return float(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
