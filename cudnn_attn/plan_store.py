"""The persistent plan store: tuned choices and serialized plans on disk, across processes.

One file per plan, named by the SHA-256 of its key (the problem's canonical signature plus
the GPU, cuDNN and frontend versions). A file is a magic line, a SHA-256 of everything after
it, then the header length, a JSON header and the serialized plan. Writes go to a temporary
file in the same directory and are renamed into place, so readers in other processes see a
whole file or none. A truncated, corrupted or foreign file (files of format v1 included) is
ignored with a warning (and rewritten by the next build); an entry is used only when its
recorded platform equals this one.

Serialized plans carry native code, so every byte on disk is treated as hostile:

- the directory must be the user's own and not writable by group or others, checked (one
  stat) on every load, save, listing and clear, not once per process;
- only regular files are opened, never through a symbolic link, never a FIFO or device, and
  at most ``MAX_FILE_BYTES`` are read; the file too must be the user's own and private;
- keys are the library's own (64 lowercase hex digits, as ``entry_key`` makes): any other
  key (``"../x"``) is a programming error, and ``file_for``, ``load`` and ``save`` raise
  ValueError for it. Disk trouble never raises from ``load``/``save``: they warn and return
  None/False. Listing and clearing an unsafe directory raise ``UnsafeStoreError``.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import hashlib
import json
import logging
import os
import re
import stat
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

# No torch, no package imports at run time: a process that only reads or writes the store (a
# writer the fault tests kill) loads this file alone, in milliseconds.
if TYPE_CHECKING:
    from .core.problem import AttentionProblem

log = logging.getLogger("cudnn_attn.plan_store")

MAGIC = b"CUDNN_ATTN_PLAN v2\n"
SUFFIX = ".plan"
TMP_PREFIX = ".tmp-"
ENV = "CUDNN_ATTN_CACHE_DIR"
DEFAULT_DIR = Path("~/.cache/cudnn_attn")
MAX_FILE_BYTES = 256 << 20  # far above any plan; a larger file is refused unread
STALE_TMP_SECONDS = 600  # a temporary file this old was left by a crashed writer; younger ones are live saves
_KEY = re.compile(r"[0-9a-f]{64}")
# O_NOFOLLOW: a link could lead anywhere (/dev/zero, another user's file). O_NONBLOCK: opening a FIFO
# would otherwise wait for a writer forever. Neither changes how a regular file is read.
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


class UnsafeStoreError(Exception):
    """The plan store's directory cannot be used: not a directory, unreadable, or not private to this user.

    Stored plans carry native code, so a directory other users can write (or a link, or a
    file that is not regular) is refused. Plan lookups then go without the store (logged);
    listing and clearing it (``cudnn-attn cache ls``/``clear``) raise this. Fix the directory's
    owner and mode (``chmod 700``), or point ``CUDNN_ATTN_CACHE_DIR`` elsewhere (``""``: no store).

    Example:
        ```python
        from cudnn_attn.plan_store import UnsafeStoreError

        try:
            raise UnsafeStoreError("plan store /tmp/x refused: writable by others")
        except UnsafeStoreError as error:
            print(error)
        ```
    """


class _RefusedFileError(Exception):
    """A file that is not read: a link, not a regular file, not private, or too large."""


def default_path() -> Path | None:
    """The store's directory: ``$CUDNN_ATTN_CACHE_DIR``, ``~/.cache/cudnn_attn`` by default,
    None when the variable is set to the empty string."""
    value = os.environ.get(ENV)
    if value == "":
        return None
    return expanded(Path(value) if value else DEFAULT_DIR)


def expanded(path: Path) -> Path:
    """``path`` with ``~`` expanded; where the home directory cannot be found (a container's user
    without one), ``path`` as given: ``PlanStore`` then refuses it, with a warning, rather than
    every graph raising RuntimeError (or a literal ``./~`` being made)."""
    try:
        return path.expanduser()
    except RuntimeError:
        return path


def _plain(value: Any) -> Any:
    """A JSON-ready, canonical form of a problem field, nested frozen dataclasses included."""
    if isinstance(value, enum.Enum):  # before the plain types: our enums are also str
        return _plain(value.value)
    torch = sys.modules.get("torch")  # where torch is not imported, no value is a torch.dtype
    if torch is not None and isinstance(value, torch.dtype):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
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


@dataclasses.dataclass
class Listed:
    """One plan file as ``entries()`` found it."""

    path: Path
    size: int | None  # bytes read; None when the file was refused unread
    entry: Entry | None  # None when damaged or refused
    problem: str | None = None  # why ``entry`` is None


class PlanStore:
    """Files of built plans under one private directory."""

    def __init__(self, path: str | os.PathLike):
        self.path = expanded(Path(path))
        self._warned: str | None = None  # the last refusal logged, so one reason is not logged on every call
        # A "~" left unexpanded names no directory: refused, never made under the working directory.
        self._homeless = str(self.path).startswith("~")

    # ---- safety -------------------------------------------------------------------------

    def usable(self) -> bool:
        """Create the directory (mode 0700) if needed; False (with a warning) if it is not ours.

        Checked on every call (one stat): a directory made unsafe after the first use is refused too.
        """
        try:
            self._check_directory(create=True)
        except UnsafeStoreError as error:
            if str(error) != self._warned:
                log.warning("%s; plans are built in each process and not stored", error)
                self._warned = str(error)
            return False
        self._warned = None
        return True

    def _check_directory(self, create: bool) -> bool:
        """True if the directory is there and safe, False if absent (and not created); else UnsafeStoreError."""
        if self._homeless:
            raise UnsafeStoreError(f"plan store {self.path}: its home directory cannot be found")
        try:
            info = os.stat(self.path)
        except FileNotFoundError:
            if not create:
                return False
            try:
                self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
                info = os.stat(self.path)
            except OSError as error:
                raise UnsafeStoreError(f"plan store {self.path} is unusable: {error}") from None
        except OSError as error:
            raise UnsafeStoreError(f"plan store {self.path} is unusable: {error}") from None
        if not stat.S_ISDIR(info.st_mode):
            raise UnsafeStoreError(f"plan store {self.path} is unusable: not a directory")
        problem = _unsafe(info)
        if problem:
            raise UnsafeStoreError(f"plan store {self.path} refused: {problem} (serialized plans carry native code)")
        return True

    # ---- read / write ---------------------------------------------------------------------

    def file_for(self, key: str) -> Path:
        """The file of ``key``; ValueError unless ``key`` is a SHA-256 hex digest (what ``entry_key`` makes)."""
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(f"plan store key {key!r}: not a key made by entry_key (64 lowercase hex digits)")
        return self.path / f"{key}{SUFFIX}"

    def load(self, key: str, platform: dict[str, Any]) -> Entry | None:
        """The entry for ``key``, or None if absent, unsafe, damaged or from another platform.

        Raises ValueError for a key ``entry_key`` did not make; never raises for what is on disk.
        """
        file = self.file_for(key)
        if not self.usable():
            return None
        try:
            data = _read_private(file)
        except FileNotFoundError:
            return None
        except _RefusedFileError as error:
            log.warning("plan store: refusing %s: %s", file.name, error)
            return None
        except OSError as error:
            log.warning("plan store: cannot read %s (%s); ignoring it", file.name, error)
            return None
        entry = _decode(data)
        if entry is None:
            log.warning("plan store: %s is truncated, corrupted or not a plan file; ignoring it", file.name)
            return None
        if entry.header.get("key") != key or entry.header.get("platform") != platform:
            log.warning("plan store: %s was written for another key or platform; ignoring it", file.name)
            return None
        return entry

    def save(self, key: str, header: dict[str, Any], blob: bytes) -> bool:
        """Write atomically; returns False (with a warning) if the store cannot be written.

        Raises ValueError for a key ``entry_key`` did not make.
        """
        file = self.file_for(key)
        if not self.usable():
            return False
        data = _encode({**header, "key": key, "written": time.time()}, blob)
        if len(data) > MAX_FILE_BYTES:  # load would refuse it
            log.warning(
                "plan store: not storing %s: %d bytes, over the %d byte limit", file.name, len(data), MAX_FILE_BYTES
            )
            return False
        try:
            fd, tmp = tempfile.mkstemp(dir=self.path, prefix=TMP_PREFIX, suffix=SUFFIX)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, file)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as error:
            log.warning("plan store: cannot write %s: %s", self.path, error)
            return False
        return True

    # ---- listing / clearing ---------------------------------------------------------------

    def entries(self) -> Iterator[Listed]:
        """Every plan file, by name, with its decoded entry (None where damaged or refused).

        Temporary files of saves in progress are skipped, and so are files that vanish meanwhile
        (other processes save and clear beside us). Raises UnsafeStoreError for an unsafe directory.
        """
        if not self._check_directory(create=False):
            return iter(())
        return self._listing()

    def _listing(self) -> Iterator[Listed]:
        for name in self._names():
            if name.startswith(TMP_PREFIX):
                continue
            file = self.path / name
            try:
                data = _read_private(file)
            except FileNotFoundError:
                continue  # removed since the directory was read
            except (_RefusedFileError, OSError) as error:  # named by path: the listing shows names cut short
                reason = error.strerror if isinstance(error, OSError) and error.strerror else error
                yield Listed(file, None, None, f"{file}: {reason}")
                continue
            entry = _decode(data)
            yield Listed(file, len(data), entry, None if entry else "truncated, corrupted or not a plan file")

    def clear(self) -> int:
        """Remove every plan file, and temporary files abandoned by crashed writers; returns how many plans went.

        Only regular files are removed: links, directories and the like are left (with a warning).
        Temporary files younger than ``STALE_TMP_SECONDS`` belong to saves still running and are kept.
        Raises UnsafeStoreError for an unsafe directory.
        """
        if not self._check_directory(create=False):
            return 0
        now = time.time()
        removed = 0
        for name in self._names():
            if self._remove(name, now):
                removed += not name.startswith(TMP_PREFIX)
        return removed

    def _remove(self, name: str, now: float) -> bool:
        file = self.path / name
        try:
            info = os.lstat(file)  # lstat: judge the link itself, never where it points
            if not stat.S_ISREG(info.st_mode):
                log.warning("plan store: leaving %s: not a regular file", name)
                return False
            if name.startswith(TMP_PREFIX) and now - info.st_mtime < STALE_TMP_SECONDS:
                return False  # a save in progress: it renames this file into place soon
            file.unlink()
        except FileNotFoundError:
            return False  # removed or renamed by another process meanwhile
        except OSError as error:
            log.warning("plan store: cannot remove %s: %s", name, error)
            return False
        return True

    def _names(self) -> list[str]:
        try:
            return sorted(name for name in os.listdir(self.path) if name.endswith(SUFFIX))
        except FileNotFoundError:
            return []


# A header's ``choice``: the plan a build settled on, as ``autotune.Choice.as_record`` writes it. A
# load makes the Choice again from these fields (of these types); index and name have no default.
CHOICE_FIELDS: dict[str, tuple[type, ...]] = {
    "index": (int,),
    "name": (str,),
    "engine_id": (int, type(None)),
    "knobs": (dict,),
    "tuned": (bool,),
    "timings_ms": (dict,),
    "tuning_seconds": (int, float),
}
REQUIRED_CHOICE_FIELDS = ("index", "name")


def choice_problems(header: dict[str, Any]) -> list[str]:
    """What keeps ``header["choice"]`` from being a choice a load can use (``["choice.index is
    absent"]``); empty when it is one. Fields beyond ``CHOICE_FIELDS`` are ignored (a later version's).

    A stored plan with any problem is ignored and rebuilt, and ``cudnn-attn cache ls`` flags it.
    """
    if "choice" not in header:
        return ["choice is absent"]
    choice = header["choice"]
    if not isinstance(choice, dict):
        return [f"choice is {json_type(choice)}"]
    problems = [f"choice.{name} is absent" for name in REQUIRED_CHOICE_FIELDS if name not in choice]
    for name, types in CHOICE_FIELDS.items():
        value = choice.get(name)
        # bool is an int to isinstance, never to the record: True is no index
        wrong = not isinstance(value, types) or (isinstance(value, bool) and bool not in types)
        if name in choice and wrong:
            problems.append(f"choice.{name} is {json_type(value)}")
    return problems


def json_type(value: Any) -> str:
    """How JSON calls the type of ``value`` (for a header field of another type than expected)."""
    kinds = {type(None): "null", bool: "a boolean", str: "a string", dict: "an object", list: "a list"}
    return kinds.get(type(value), "a number")


def _unsafe(info: os.stat_result) -> str | None:
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return f"owned by uid {info.st_uid}, not by this user ({os.getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _read_private(file: Path) -> bytes:
    """The bytes of ``file``: a regular file (not a link), ours, private and at most MAX_FILE_BYTES long.

    Raises FileNotFoundError when absent, _RefusedFileError when refused, OSError when unreadable.
    """
    try:
        fd = os.open(file, _OPEN_FLAGS)
    except OSError as error:
        if error.errno == errno.ELOOP:  # what O_NOFOLLOW gives for a link
            raise _RefusedFileError("a symbolic link, not a regular file") from None
        raise
    try:
        # Judged on the descriptor before fdopen: fdopen refuses a directory with an error that
        # names the descriptor's number, not the file.
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _RefusedFileError(f"{_kind(info.st_mode)}, not a regular file")
        problem = _unsafe(info)
        if problem:
            raise _RefusedFileError(problem)
        if info.st_size > MAX_FILE_BYTES:
            raise _RefusedFileError(f"{info.st_size} bytes, over the {MAX_FILE_BYTES} byte limit")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_FILE_BYTES + 1)  # bounded: the file may have grown since fstat
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise _RefusedFileError(f"over the {MAX_FILE_BYTES} byte limit")
    return data


def _kind(mode: int) -> str:
    """What a file that is not regular is, in words."""
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), f"a file of mode {mode:o}")


# A file: MAGIC, the SHA-256 (64 hex digits) of everything after it, then the header length
# (8 bytes, little endian), the JSON header and the plan. The checksum covers the length too:
# a damaged length would otherwise move bytes between the header and the plan unnoticed.
_DIGEST = 64
_LENGTH = 8


def _encode(header: dict[str, Any], blob: bytes) -> bytes:
    head = json.dumps(header, sort_keys=True).encode()
    body = len(head).to_bytes(_LENGTH, "little") + head + blob
    return MAGIC + hashlib.sha256(body).hexdigest().encode() + body


def _decode(data: bytes) -> Entry | None:
    if not data.startswith(MAGIC):
        return None
    digest, body = data[len(MAGIC) : len(MAGIC) + _DIGEST], data[len(MAGIC) + _DIGEST :]
    if len(body) < _LENGTH or hashlib.sha256(body).hexdigest().encode() != digest:
        return None
    size = int.from_bytes(body[:_LENGTH], "little")
    if size > len(body) - _LENGTH:
        return None
    try:
        header = json.loads(body[_LENGTH : _LENGTH + size])
    except (ValueError, RecursionError):  # RecursionError: absurdly nested JSON
        return None
    return Entry(header, body[_LENGTH + size :]) if isinstance(header, dict) else None
