"""A data dir checked before a command loads anything, and the locks that guard it.

What lives in a data dir (``StoreConfig.data_dir``: ``--data-dir``, ``KVTIER_DATA_DIR``,
default ``$XDG_CACHE_HOME/kvtier`` or ``~/.cache/kvtier``)::

    <dir>/disk/                      a store's DISK tier (kvtier demo, the library):
        data.mdb, lock.mdb           the LMDB environment (data.mdb is sparse: ls -l shows
                                     the map size, disk_bytes * 1.25 + 192 MiB; du what is used)
        index/                       its index (hash -> footprint, fingerprint, order), an
                                     LMDB environment of its own: opening reads it, not the records
        kvtier.lock                  flock'ed (exclusive) by the one process that has it open
    <dir>/serve.lock                 flock of the `kvtier serve` daemon that owns the dir
    <dir>/<64 hex digits>/           one of the daemon's namespaces (a model):
        spec.msgpack, disk/          its block shape, its DISK tier (as above)

The lock protocol is the one of :func:`kvtier.tiers.disk._lock_directory` and
:meth:`kvtier.server.registry.Registry.open`: ``flock(LOCK_EX | LOCK_NB)`` on the lock file,
held for the owner's lifetime (the kernel drops it when the process dies, so a held lock
always means a live process). This module probes it without importing torch, so that
``kvtier demo`` refuses a data dir in use in well under a second instead of after its model
load (issue 16: a 37-line traceback after 90 s).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

STORE_LOCK = Path("disk") / "kvtier.lock"
"""A store's lock file, relative to its data dir."""
SERVE_LOCK = Path("serve.lock")
"""The daemon's lock file, relative to its data dir."""
MIN_FREE_BYTES = 256 << 20
"""Below this much free space a DISK tier is refused: LMDB needs room for its own pages and
:class:`~kvtier.tiers.disk.DiskTier` stops writing 64 MiB before the filesystem is full."""
HINT = "use another one: --data-dir DIR or KVTIER_DATA_DIR=DIR"


class DataDirError(Exception):
    """The data dir cannot be used; the message is one line that says what to do.
    ``in_use``: a live process holds it (the dir itself is a good one)."""

    def __init__(self, message: str, in_use: bool = False) -> None:
        super().__init__(message)
        self.in_use = in_use


def check_data_dir(data_dir: str | os.PathLike, lock: Path = STORE_LOCK, disk_bytes: int = 0) -> list[str]:
    """Check that a command can use ``data_dir``, creating the directory of ``lock`` in it.

    Checks, in order: not a file (nor under one), creatable, writable (a probe file is
    created and removed), ``data_dir / lock`` not held by another process, and, when
    ``disk_bytes`` > 0, at least :data:`MIN_FREE_BYTES` free on its filesystem.

    Args:
        data_dir: the data dir (``~`` expanded).
        lock: the lock file the command will take, relative to ``data_dir``
            (:data:`STORE_LOCK` or :data:`SERVE_LOCK`).
        disk_bytes: the DISK tier's cap in bytes (0: no DISK tier, no space check).

    Returns:
        warnings, one line each (less free space than ``disk_bytes``).

    Raises:
        DataDirError: one of the checks failed.
    """
    root = Path(data_dir).expanduser().absolute()
    work = (root / lock).parent
    _check_not_a_file(root, work)
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataDirError(f"cannot create data dir {work}: {_reason(exc)}; {HINT}") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvtier-probe-", dir=work)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise DataDirError(f"cannot write to data dir {work}: {_reason(exc)}; {HINT}") from None
    holder = lock_holder(root / lock)
    if holder is not None:
        raise DataDirError(f"data dir {work} is in use by {describe_holder(holder)}; wait for it to end, or {HINT}",
                           in_use=True)
    warnings: list[str] = []
    if disk_bytes > 0:
        stat = os.statvfs(work)
        free = stat.f_bavail * stat.f_frsize
        if free < MIN_FREE_BYTES:
            raise DataDirError(
                f"only {format_bytes(free)} free on the filesystem of {work} (the DISK tier needs "
                f">= {format_bytes(MIN_FREE_BYTES)}): free some space, pass --disk-bytes 0, or {HINT}"
            )
        if free < disk_bytes:
            warnings.append(
                f"{format_bytes(free)} free at {work}, less than the DISK cap {format_bytes(disk_bytes)}: "
                "the DISK tier stops growing when the filesystem is nearly full (--disk-bytes sets the cap)"
            )
    return warnings


def _check_not_a_file(root: Path, work: Path) -> None:
    for path in (work, *work.parents):
        if path.exists() or path.is_symlink():
            if not path.is_dir():
                what = "is a file" if path in (root, work) else f"is under a file, {path}"
                raise DataDirError(f"data dir {root} {what}, not a directory; {HINT}")
            return


def _reason(exc: OSError) -> str:
    if exc.errno == errno.EROFS:
        return "read-only filesystem"
    return exc.strerror or str(exc)


# -- locks ---------------------------------------------------------------------------------------
def lock_holder(lock_path: str | os.PathLike) -> int | None:
    """Whether a process holds ``lock_path``: ``None`` when it is free (or absent), else the
    holder's pid as ``/proc/locks`` reports it (0 where that cannot be read, e.g. macOS).

    Probes with ``flock(LOCK_EX | LOCK_NB)`` on a new open file description, released at once.
    """
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError:
        return None  # unreadable: the write probe of check_data_dir speaks for it
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _proc_locks_pid(os.fstat(fd)) or 0
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _proc_locks_pid(st: os.stat_result) -> int | None:
    """The pid of the process holding a lock on the file of ``st``, from ``/proc/locks``
    (lines like ``2: FLOCK  ADVISORY  WRITE 1360 fe:00:2146390 0 EOF``; waiters have ``->``)."""
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            lines = f.readlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[1] != "->" and fields[5] == inode:
            try:
                return int(fields[4])
            except ValueError:
                return None
    return None


def describe_holder(pid: int) -> str:
    """``"pid 1234 (kvtier demo --quick)"``; ``"another process"`` when the pid is unknown."""
    if not pid:
        return "another process"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return f"pid {pid}"
    words = [os.path.basename(argv[0])] + argv[1:] if argv else []
    if len(words) > 2 and words[0].startswith("python") and words[1] == "-m":
        words = words[2:]  # python -m kvtier demo -> kvtier demo
    elif len(words) > 1 and words[0].startswith("python") and not words[1].startswith("-"):
        words = [os.path.basename(words[1])] + words[2:]  # python3 .venv/bin/kvtier serve -> kvtier serve
    command = " ".join(" ".join(words).split())  # one line: newlines of `python -c` collapsed
    return f"pid {pid} ({command[:57] + '...' if len(command) > 60 else command})" if command else f"pid {pid}"


@contextlib.contextmanager
def hold_lock(lock_path: str | os.PathLike) -> Iterator[None]:
    """Hold ``lock_path`` exclusively (created if missing) for the ``with`` block, as the DISK
    tier and the daemon do while they own a dir, so neither can open it meanwhile.

    Raises:
        DataDirError: another process holds it.
    """
    lock_path = Path(lock_path)
    with open(lock_path, "a+b") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _proc_locks_pid(os.fstat(f.fileno())) or 0
            raise DataDirError(f"{lock_path.parent} is in use by {describe_holder(holder)}; "
                               "stop it (or wait for it to end) and try again", in_use=True) from None
        yield


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; binary units, 3 significant digits."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or n >= 100 else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
