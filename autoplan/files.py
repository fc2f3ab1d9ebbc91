"""Writing files safely, and keeping paths that come from files inside their directory.

Every file autoplan writes (plans, run records, checkpoint pointers and state, profiles,
exports, reports) goes through :func:`write_text` / :func:`write_bytes`: the content is
written to a fresh, unpredictably named file in the target's directory (created with
``O_EXCL``, so a link planted there is never followed), flushed, and renamed over the
target (a rename replaces a link at the target instead of writing through it). A reader
therefore sees either the old file or the whole new one, and a crash leaves no torn file.

Names that come from input files (a scenario's name, a checkpoint pointer's step
directory) become paths only through :func:`safe_name` / :func:`confined`.
"""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from autoplan.errors import ConfigError

_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")


def write_bytes(path: str | os.PathLike, data: bytes, mode: int = 0o666) -> Path:
    """Atomically replace ``path`` with ``data`` (permissions ``mode`` less the umask)."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, mode & ~umask)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    return path


def write_text(path: str | os.PathLike, text: str, mode: int = 0o666) -> Path:
    """Atomically replace ``path`` with ``text`` in UTF-8 (see :func:`write_bytes`)."""
    return write_bytes(path, text.encode("utf-8"), mode)


def safe_name(name: str, where: str) -> str:
    """``name`` if it can be one path component everywhere (letters, digits, '.', '_',
    '+', '-'; not starting with a dot; at most 128 characters), else a ConfigError:
    a name with a slash or '..' would write outside the directory it is meant for."""
    if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name):
        raise ConfigError(where, f"{str(name)[:60]!r} cannot be used as a file name",
                          "use letters, digits, '.', '_', '+' and '-' (not starting with '.')")
    return name


def confined(base: str | os.PathLike, name: str, where: str) -> Path:
    """``base / name`` for a single safe component ``name`` whose resolved path stays
    inside ``base`` (a symlink pointing elsewhere is refused)."""
    safe_name(name, where)
    base_path = Path(base).resolve()
    target = (base_path / name).resolve()
    if target.parent != base_path:
        raise ConfigError(where, f"{name!r} resolves outside {base}", "remove the link")
    return base_path / name


def check_writable(path: str | os.PathLike, what: str, flag: str) -> Path:
    """Check before any work that ``path`` can be written: its directory exists and is
    writable, and it is not a directory. ``flag`` names the option for the message."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(flag, f"{str(path)!r} is a directory, expected a {what} file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(flag, f"the directory {str(parent)!r} of {str(path)!r} does not exist",
                          "create it first or choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(flag, f"cannot write into {str(parent)!r}", "choose a writable directory")
    return path
