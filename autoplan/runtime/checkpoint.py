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

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from autoplan.errors import ConfigError

LATEST = "latest.json"


def _step_dir(directory: Path, step: int) -> Path:
    return directory / f"step_{step:08d}"


def latest_checkpoint(directory: str | os.PathLike) -> tuple[int, Path] | None:
    """(step, path) of the last complete checkpoint in ``directory``, or None."""
    pointer = Path(directory) / LATEST
    if not pointer.is_file():
        return None
    try:
        meta = json.loads(pointer.read_text())
        step, path = int(meta["step"]), Path(directory) / meta["path"]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(str(pointer), f"is not a valid checkpoint pointer ({e})",
                          "delete it to start from scratch") from None
    if not (path / ".metadata").is_file():
        raise ConfigError(str(pointer), f"points at {path.name}, which has no DCP metadata",
                          "delete latest.json (and the incomplete step directory) to start from scratch")
    return step, path


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
    torch.save(rng, path / f"rng_rank{rank}.pt")
    if rank == 0:
        (path / "train_state.json").write_text(json.dumps({**train_state, "step": step}, indent=1) + "\n")
        if data_state is not None and "dataset" in data_state:
            torch.save(data_state["dataset"], path / "data_state.pt")
    dist.barrier()
    if rank == 0:
        # The pointer moves only once every rank's shards are on disk, so a run killed
        # mid-save resumes from the previous complete checkpoint.
        tmp = directory / (LATEST + ".tmp")
        tmp.write_text(json.dumps({"step": step, "path": path.name}) + "\n")
        os.replace(tmp, directory / LATEST)
    dist.barrier()
    return path


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer) -> tuple[dict, object | None]:
    """Load model and optimizer state from ``path`` (resharding to this plan); return
    (train_state, dataset_state or None). Collective."""
    path = Path(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    # Only the optimizer's per-parameter state is read back; its hyper-parameters
    # (param_groups) stay those this run was configured with. That lets a resumed run
    # change e.g. the learning rate, and sidesteps DCP not round-tripping tuple-valued
    # entries such as AdamW's betas (they come back missing).
    state = {"model": model_sd, "optim": {"state": optim_sd["state"]}}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict={"state": state["optim"]["state"], "param_groups": optim_sd["param_groups"]})
    train_state = json.loads((path / "train_state.json").read_text())
    rank_rng = path / f"rng_rank{dist.get_rank()}.pt"
    if train_state.get("world_size") == dist.get_world_size() and rank_rng.is_file():
        rng = torch.load(rank_rng, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    data_file = path / "data_state.pt"
    dataset_state = torch.load(data_file, weights_only=False) if data_file.is_file() else None
    return train_state, dataset_state
