"""Checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout of a checkpoint directory::

    <dir>/latest.json              {"step": 20, "path": "step_00000020"}  (written last)
    <dir>/step_00000020/           DCP shards of {"model": ..., "optim": ...}
    <dir>/step_00000020/train_state.json   step, data position, plan, world size
    <dir>/step_00000020/rng_rank<r>.pt     each rank's RNG states
    <dir>/step_00000020/data_state.pt      a stateful user dataset's state (if any)

Model and optimizer states go through ``get_state_dict``/``set_state_dict``, which name
every tensor by its fully qualified name in the whole model and keep DTensor shards as
such; DCP then reshards on load. That is why a checkpoint written under one plan (say
dp=2) loads under another (tp=2, or a different pipeline split). RNG states are per rank
and are restored only when the world size is unchanged (the zoo models draw no random
numbers in training, so this only matters for user code that does).
"""
from __future__ import annotations

import io
import json
import os
import pickle
import re
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from autoplan.errors import ConfigError
from autoplan.fields import FieldReader, load_json
from autoplan.files import confined, write_bytes, write_text
from autoplan.limits import MAX_GPUS, MAX_STEPS

LATEST = "latest.json"
MAX_STATE_BYTES = 16 * 2**20
"""Largest train_state.json / latest.json read."""
_STEP_DIR = re.compile(r"step_\d{8,}")


def _step_dir(directory: Path, step: int) -> Path:
    return directory / f"step_{step:08d}"


# ------------------------------------------------------------- reading plain data only
# DCP writes its .metadata with pickle and reads it back with pickle.load, and its default
# planner unpickles any "bytes" entry with torch.load(weights_only=False): a planted file
# would run code on every rank of a resumed run. Checkpoints are therefore read through
# an unpickler that builds only DCP's own metadata classes, and byte entries through
# torch.load(weights_only=True).
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
     ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_CLASSES or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of checkpoint metadata")


def read_metadata(path: str | os.PathLike) -> Metadata:
    """The DCP metadata of checkpoint ``path``, unpickling nothing but metadata classes."""
    file = Path(path) / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:   # noqa: BLE001 - nothing but allowed classes is built, so any failure is a bad file
        # (a corrupt pickle can raise almost anything: EOFError, OverflowError, struct.error, ...)
        raise ConfigError(str(file), f"is not checkpoint metadata ({str(e)[:120]})",
                          "delete this checkpoint (or choose another --checkpoint-dir)") from None
    if not isinstance(metadata, Metadata):
        raise ConfigError(str(file), f"holds a {type(metadata).__name__}, not checkpoint metadata")
    return metadata


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with :func:`read_metadata` in place of ``pickle.load``."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading byte entries as plain data only."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise ConfigError(f"checkpoint entry {read_item.dest_index.fqn}", f"is not plain data ({str(e)[:120]})",
                              "delete this checkpoint") from None
        if self.flatten_state_dict:
            # The same private helper DefaultLoadPlanner.load_bytes uses.
            from torch.distributed.checkpoint._traverse import set_element
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def latest_checkpoint(directory: str | os.PathLike) -> tuple[int, Path] | None:
    """(step, path) of the last complete checkpoint in ``directory``, or None. The pointer's
    path must name a step directory directly inside ``directory`` (no other path is ever
    followed, whatever the pointer says)."""
    pointer = Path(directory) / LATEST
    if not pointer.is_file():
        return None
    r = FieldReader(load_json(pointer, "checkpoint pointer", "delete it to start from scratch",
                              max_bytes=MAX_STATE_BYTES), str(pointer))
    step = r.int("step", minimum=0, maximum=MAX_STEPS)
    name = r.str("path")
    if not _STEP_DIR.fullmatch(name) or name != _step_dir(Path(), step).name:
        raise ConfigError(r.path("path"), f"{name[:60]!r} is not the step directory of step {step} "
                          f"({_step_dir(Path(), step).name})", "delete latest.json to start from scratch")
    path = confined(directory, name, r.path("path"))
    if not (path / ".metadata").is_file():
        raise ConfigError(str(pointer), f"points at {path.name}, which has no DCP metadata",
                          "delete latest.json (and the incomplete step directory) to start from scratch")
    return step, path


def read_train_state(path: str | os.PathLike) -> dict:
    """The validated ``train_state.json`` of checkpoint ``path``."""
    file = Path(path) / "train_state.json"
    data = load_json(file, "checkpoint train state", "delete this checkpoint", max_bytes=MAX_STATE_BYTES)
    r = FieldReader(data, str(file))
    r.int("step", minimum=0, maximum=MAX_STEPS)
    r.int("world_size", minimum=1, maximum=MAX_GPUS)
    r.int("seed", 0, minimum=0)
    d = r.sub("data", {})
    d.int("position", 0, minimum=0, maximum=MAX_STEPS)
    d.str("kind", "")
    m = r.sub("model", None)
    if m is not None:
        m.str("name", "")
        m.int("num_params", 0, minimum=0)
        m.sub("shapes", {})
    return data


def save_checkpoint(directory: str | os.PathLike, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, train_state: dict, data_state: dict | None = None) -> Path:
    """Write a checkpoint of the state after ``step`` completed steps; collective."""
    directory = Path(directory)
    path = _step_dir(directory, step)
    rank = dist.get_rank()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    write_bytes(path / f"rng_rank{rank}.pt", _to_bytes(rng))
    if rank == 0:
        write_text(path / "train_state.json", json.dumps({**train_state, "step": step}, indent=1) + "\n")
        if data_state is not None and "dataset" in data_state:
            blob = _to_bytes(data_state["dataset"])
            try:
                torch.load(io.BytesIO(blob), weights_only=True)
            except pickle.UnpicklingError:
                raise ConfigError("data", "the dataset's state_dict() is not plain data (tensors, numbers, "
                                  "strings, lists, dicts), so a checkpoint could not be read back safely",
                                  "return plain data from state_dict()") from None
            write_bytes(path / "data_state.pt", blob)
    dist.barrier()
    if rank == 0:
        # The pointer moves only once every rank's shards are on disk, so a run killed
        # mid-save resumes from the previous complete checkpoint.
        write_text(directory / LATEST, json.dumps({"step": step, "path": path.name}) + "\n")
    dist.barrier()
    return path


def _to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def check_compatible(path: str | os.PathLike, model_sd: dict, model_name: str) -> None:
    """Raise a ConfigError when checkpoint ``path`` was written for another model: a
    parameter missing, or of another shape, names the first difference."""
    metadata = read_metadata(path)
    entries = metadata.state_dict_metadata
    for fqn, value in model_sd.items():
        key = f"model.{fqn}"
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
        md = entries.get(key)
        if md is None:
            raise ConfigError(str(path), f"has no parameter {fqn!r}: it was written for another model than "
                              f"{model_name!r}", "use another --checkpoint-dir, or --no-resume")
        if shape is not None and isinstance(md, TensorStorageMetadata) and tuple(md.size) != shape:
            raise ConfigError(str(path), f"holds {fqn} with shape {list(md.size)}, model {model_name!r} has "
                              f"{list(shape)}: the checkpoint is of another model",
                              "use another --checkpoint-dir, or --no-resume")


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, model_name: str = "the model") -> tuple[dict, object | None]:
    """Load model and optimizer state from ``path`` (resharding to this plan); return
    (train_state, dataset_state or None). Collective. Reads only plain data."""
    path = Path(path)
    train_state = read_train_state(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    check_compatible(path, model_sd, model_name)
    # Only the optimizer's per-parameter state is read back; its hyper-parameters
    # (param_groups) stay those this run was configured with. That lets a resumed run
    # change e.g. the learning rate, and sidesteps DCP not round-tripping tuple-valued
    # entries such as AdamW's betas (they come back missing).
    state = {"model": model_sd, "optim": {"state": optim_sd["state"]}}
    dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner())
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict={"state": state["optim"]["state"], "param_groups": optim_sd["param_groups"]})
    rank_rng = path / f"rng_rank{dist.get_rank()}.pt"
    if train_state.get("world_size") == dist.get_world_size() and rank_rng.is_file():
        rng = _load_plain(rank_rng)
        if isinstance(rng, dict) and isinstance(rng.get("cpu"), torch.Tensor):
            torch.set_rng_state(rng["cpu"])
            if isinstance(rng.get("cuda"), torch.Tensor) and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
    data_file = path / "data_state.pt"
    dataset_state = _load_plain(data_file) if data_file.is_file() else None
    return train_state, dataset_state


def _load_plain(file: Path):
    """torch.load of tensors and plain Python data only; anything else is a ConfigError."""
    try:
        return torch.load(file, weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as e:
        raise ConfigError(str(file), f"is not plain checkpoint data ({str(e).splitlines()[0][:120]})",
                          "delete this checkpoint (or choose another --checkpoint-dir)") from None
