"""The persistent plan store: tuned choices and serialized plans on disk, across processes.

One file per plan, named by the SHA-256 of its key (the problem's canonical signature plus
the GPU, cuDNN and frontend versions). A file is a magic line, a JSON header and the
serialized plan, with a SHA-256 over both. Writes go to a temporary file in the same
directory and are renamed into place, so readers in other processes see a whole file or
none. A truncated, corrupted or foreign file is ignored with a warning (and rewritten by the
next build); an entry is used only when its recorded platform equals this one.

Serialized plans carry native code, so the directory must be the user's own: a directory or
file owned by someone else, or writable by group or others, is refused.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import logging
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .problem import AttentionProblem, TensorSpec

log = logging.getLogger("cudnn_attn.plan_store")

MAGIC = b"CUDNN_ATTN_PLAN v1\n"
SUFFIX = ".plan"
ENV = "CUDNN_ATTN_CACHE_DIR"
DEFAULT_DIR = Path("~/.cache/cudnn_attn")


def default_path() -> Path | None:
    """The store's directory: ``$CUDNN_ATTN_CACHE_DIR``, ``~/.cache/cudnn_attn`` by default,
    None when the variable is set to the empty string."""
    value = os.environ.get(ENV)
    if value == "":
        return None
    return Path(value).expanduser() if value else DEFAULT_DIR.expanduser()


def _plain(value: Any) -> Any:
    """A JSON-ready, canonical form of a problem field."""
    if isinstance(value, TensorSpec):
        return {
            "shape": list(value.shape),
            "stride": list(value.stride),
            "dtype": str(value.dtype),
            "device": value.device,
        }
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    return value


def signature(problem: AttentionProblem) -> dict[str, Any]:
    """The problem as canonical JSON data: every field, nothing else."""
    return {f.name: _plain(getattr(problem, f.name)) for f in dataclasses.fields(problem)}


def entry_key(problem: AttentionProblem, platform: dict[str, Any], variant: str) -> str:
    text = json.dumps({"problem": signature(problem), "platform": platform, "variant": variant}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclasses.dataclass
class Entry:
    header: dict[str, Any]
    blob: bytes


class PlanStore:
    """Files of built plans under one private directory."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()
        self._usable: bool | None = None

    # ---- safety -------------------------------------------------------------------------

    def usable(self) -> bool:
        """Create the directory (mode 0700) if needed; False (with a warning) if it is not ours."""
        if self._usable is None:
            self._usable = self._check_directory()
        return self._usable

    def _check_directory(self) -> bool:
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            info = self.path.stat()
        except OSError as error:
            log.warning("plan store %s is unusable: %s", self.path, error)
            return False
        problem = _unsafe(info)
        if problem:
            log.warning("plan store %s refused: %s (serialized plans carry native code)", self.path, problem)
            return False
        return True

    # ---- read / write ---------------------------------------------------------------------

    def file_for(self, key: str) -> Path:
        return self.path / f"{key}{SUFFIX}"

    def load(self, key: str, platform: dict[str, Any]) -> Entry | None:
        """The entry for ``key``, or None if absent, unsafe, damaged or from another platform."""
        if not self.usable():
            return None
        file = self.file_for(key)
        try:
            fd = os.open(file, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            return None
        except OSError as error:
            log.warning("plan store: cannot open %s (%s); ignoring it", file.name, error)
            return None
        with os.fdopen(fd, "rb") as f:
            problem = _unsafe(os.fstat(f.fileno()))
            if problem:
                log.warning("plan store: refusing %s: %s", file.name, problem)
                return None
            data = f.read()
        entry = _decode(data)
        if entry is None:
            log.warning("plan store: %s is truncated, corrupted or not a plan file; ignoring it", file.name)
            return None
        if entry.header.get("key") != key or entry.header.get("platform") != platform:
            log.warning("plan store: %s was written for another key or platform; ignoring it", file.name)
            return None
        return entry

    def save(self, key: str, header: dict[str, Any], blob: bytes) -> bool:
        """Write atomically; returns False (with a warning) if the store cannot be written."""
        if not self.usable():
            return False
        header = {**header, "key": key, "written": time.time()}
        data = _encode(header, blob)
        try:
            fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".tmp-", suffix=SUFFIX)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.file_for(key))
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as error:
            log.warning("plan store: cannot write %s: %s", self.path, error)
            return False
        return True

    def entries(self) -> Iterator[tuple[Path, Entry | None]]:
        """Every plan file and its decoded entry (None where damaged)."""
        if not self.path.is_dir():
            return
        for file in sorted(self.path.glob(f"*{SUFFIX}")):
            try:
                yield file, _decode(file.read_bytes())
            except OSError:
                yield file, None

    def clear(self) -> int:
        """Remove every plan file (and stray temporary files); returns how many plans went."""
        removed = 0
        if not self.path.is_dir():
            return 0
        for file in self.path.glob(f"*{SUFFIX}"):
            file.unlink(missing_ok=True)
            removed += not file.name.startswith(".tmp-")
        for file in self.path.glob(f".tmp-*{SUFFIX}"):
            file.unlink(missing_ok=True)
        return removed


def _unsafe(info: os.stat_result) -> str | None:
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return f"owned by uid {info.st_uid}, not by this user ({os.getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _encode(header: dict[str, Any], blob: bytes) -> bytes:
    head = json.dumps(header, sort_keys=True).encode()
    digest = hashlib.sha256(head + blob).hexdigest().encode()
    return MAGIC + len(head).to_bytes(8, "little") + digest + head + blob


def _decode(data: bytes) -> Entry | None:
    if not data.startswith(MAGIC):
        return None
    rest = data[len(MAGIC) :]
    if len(rest) < 8 + 64:
        return None
    size = int.from_bytes(rest[:8], "little")
    digest, body = rest[8:72], rest[72:]
    if size > len(body) or hashlib.sha256(body).hexdigest().encode() != digest:
        return None
    try:
        header = json.loads(body[:size])
    except ValueError:
        return None
    return Entry(header if isinstance(header, dict) else {}, body[size:])
