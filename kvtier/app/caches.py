"""The caches kvtier leaves on disk: which data dirs, how large, and removing them.

``kvtier cache ls`` / ``kvtier cache rm`` / ``kvtier clear`` (:mod:`.cache_cli`) are built on
:func:`known_data_dirs`, :func:`inspect_data_dir` and :func:`remove_caches`. The layout of a
data dir and its locks are described in :mod:`.datadir`.

Known data dirs: the default one, ``$KVTIER_DATA_DIR``, and every dir a ``kvtier demo`` or
``kvtier serve`` ran on, which the CLI appends to ``$XDG_STATE_HOME/kvtier/data-dirs``
(default ``~/.local/state/kvtier/data-dirs``); the library itself records nothing.

Removal deletes only what kvtier created (LMDB files, lock files, namespace specs), each DISK
tier's files while holding its lock (so no store can open it meanwhile), a daemon's
namespaces while holding ``serve.lock``; it refuses, in one line, a dir that a live process
holds. Torch-free (``lmdb`` reads the block counts).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.app.datadir import SERVE_LOCK, STORE_LOCK, DataDirError, describe_holder, hold_lock, lock_holder
from kvtier.config import ENV_PREFIX, default_data_dir

LMDB_FILES = ("data.mdb", "lock.mdb")
INDEX_DIR = "index"
"""The DISK tier's persisted index (an LMDB environment of its own: kvtier.tiers.disk_index)."""
SPEC_FILE = "spec.msgpack"  # kvtier.server.registry.SPEC_FILE (the registry imports torch)
TENANTS_DIR = "tenants"  # kvtier.server.layout.TENANTS_DIR
MARKER_FILE = "kvtier-namespace.msgpack"  # kvtier.server.layout.MARKER_FILE
_NAMESPACE_DIR = re.compile(r"[0-9a-f]{64}")


@dataclass
class CacheDir:
    """What one data dir holds."""

    path: Path
    kinds: list[str] = field(default_factory=list)
    """``"store"`` (``<dir>/disk``) and/or ``"daemon"`` (namespaces, ``serve.lock``); empty: no cache."""
    du_bytes: int = 0
    """Bytes allocated on disk, as ``du`` counts them (LMDB's map file is sparse)."""
    apparent_bytes: int = 0
    """Sum of file sizes, as ``ls -l`` shows them (up to the map size)."""
    blocks: int | None = 0
    """Blocks in its DISK tiers (``None``: a tier could not be read)."""
    namespaces: int = 0
    """The daemon's namespaces (models) in it."""
    holders: dict[str, int] = field(default_factory=dict)
    """Lock file (relative) -> pid of the live process that holds it (0: pid unknown)."""

    @property
    def exists(self) -> bool:
        return self.path.is_dir()


# -- known dirs ----------------------------------------------------------------------------------
def state_file() -> Path:
    """``$XDG_STATE_HOME/kvtier/data-dirs`` (default ``~/.local/state/kvtier/data-dirs``)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "kvtier" / "data-dirs"


def remember_data_dir(data_dir: str | os.PathLike) -> None:
    """Append ``data_dir`` (absolute) to :func:`state_file` if it is not listed; best effort."""
    path = str(Path(data_dir).expanduser().absolute())
    try:
        listed = _read_state()
        if path in listed:
            return
        state = state_file()
        state.parent.mkdir(parents=True, exist_ok=True)
        with open(state, "a") as f:  # O_APPEND: concurrent appends do not interleave lines
            f.write(path + "\n")
    except OSError:
        pass  # a read-only home: `kvtier cache ls DIR` still works


def _read_state() -> list[str]:
    try:
        return [line.strip() for line in state_file().read_text().splitlines() if line.strip()]
    except OSError:
        return []


def known_data_dirs(extra: list[str | os.PathLike] = ()) -> list[Path]:
    """``extra``, the default data dir, ``$KVTIER_DATA_DIR`` and the recorded ones, absolute,
    without duplicates; recorded dirs that no longer exist are left out."""
    env = os.environ.get(ENV_PREFIX + "DATA_DIR")
    candidates: list[tuple[str | os.PathLike, bool]] = [(p, True) for p in extra]
    candidates += [(default_data_dir(), True)] + ([(env, True)] if env else [])
    candidates += [(p, False) for p in _read_state()]
    seen: dict[Path, None] = {}
    for raw, always in candidates:
        path = Path(raw).expanduser().absolute()
        if path not in seen and (always or path.is_dir()):
            seen[path] = None
    return list(seen)


# -- inspection ----------------------------------------------------------------------------------
def namespace_dirs(data_dir: Path) -> list[Path]:
    """The daemon's namespace directories in ``data_dir`` (64 hex digits, with a spec file):
    ``tenants/<tenant>/<ns>`` (kvtier.server.layout; ``cache ls`` showed a daemon's dir as
    0 models before it looked there, 2026-12-03), and ``<ns>`` at the top, where daemons
    before tenants kept them."""
    parents = [data_dir, *_subdirs(data_dir / TENANTS_DIR)]
    return [p for parent in parents for p in _subdirs(parent)
            if _NAMESPACE_DIR.fullmatch(p.name) and (p / SPEC_FILE).is_file()]


def _subdirs(path: Path) -> list[Path]:
    try:
        return sorted(p for p in path.iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        return []


def inspect_data_dir(data_dir: str | os.PathLike) -> CacheDir:
    """Sizes, blocks, namespaces and lock holders of one data dir (nothing is changed)."""
    info = CacheDir(Path(data_dir).expanduser().absolute())
    if not info.exists:
        return info
    info.du_bytes, info.apparent_bytes = disk_usage(info.path)
    disks: list[Path] = []
    if (info.path / "disk").is_dir():
        info.kinds.append("store")
        disks.append(info.path / "disk")
    namespaces = namespace_dirs(info.path)
    if namespaces or (info.path / SERVE_LOCK).exists():
        info.kinds.append("daemon")
        info.namespaces = len(namespaces)
        disks += [ns / "disk" for ns in namespaces]
    info.holders = lock_holders(info.path)
    counts = [count_blocks(d) for d in disks]
    info.blocks = None if None in counts else sum(c for c in counts if c is not None)
    return info


def lock_holders(data_dir: Path) -> dict[str, int]:
    """Lock file (relative to ``data_dir``) -> pid of the live process holding it (0: unknown),
    over the store's lock, the daemon's and its namespaces'."""
    locks = [STORE_LOCK, SERVE_LOCK] + [ns.relative_to(data_dir) / STORE_LOCK for ns in namespace_dirs(data_dir)]
    holders = {str(lock): lock_holder(data_dir / lock) for lock in locks}
    return {lock: pid for lock, pid in holders.items() if pid is not None}


def disk_usage(path: Path) -> tuple[int, int]:
    """``(allocated, apparent)`` bytes under ``path``: ``du`` and ``du --apparent-size``
    (hard links counted once, symlinks not followed)."""
    allocated = apparent = 0
    seen: set[tuple[int, int]] = set()
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            allocated += st.st_blocks * 512
            apparent += st.st_size
    return allocated, apparent


def count_blocks(disk_dir: Path) -> int | None:
    """Records in the LMDB environment at ``disk_dir`` (0 when there is none; ``None`` when it
    cannot be read). Read-only; LMDB's own reader lock makes this safe beside the owner."""
    if not (disk_dir / "data.mdb").is_file():
        return 0
    try:
        import lmdb

        env = lmdb.open(str(disk_dir), readonly=True, lock=True, max_readers=512, max_dbs=0)
    except Exception:  # ImportError, lmdb.Error: not an environment we can read
        return None
    try:
        return int(env.stat()["entries"])
    except Exception:
        return None
    finally:
        env.close()


# -- removal -------------------------------------------------------------------------------------
def remove_caches(data_dir: str | os.PathLike) -> int:
    """Remove every kvtier cache in ``data_dir`` (its DISK tier, the daemon's namespaces and
    lock files; other files stay), then the dir itself if that left it empty.

    Returns:
        bytes freed (allocated, as ``du`` counts them).

    Raises:
        DataDirError: a live process holds the dir (nothing is removed), or a file could not
            be removed (the message names it; what was removed before stays removed).
    """
    root = Path(data_dir).expanduser().absolute()
    if not root.is_dir():
        return 0
    before = disk_usage(root)[0]
    busy = lock_holders(root)
    if busy:
        lock, pid = next(iter(busy.items()))
        raise DataDirError(f"{root / Path(lock).parent} is in use by {describe_holder(pid)}; nothing removed: "
                           "stop it (or wait for it to end) and try again")
    try:
        if (root / "disk").is_dir():
            _remove_disk_tier(root / "disk")
        if (root / SERVE_LOCK).exists() or namespace_dirs(root):
            with hold_lock(root / SERVE_LOCK):
                for ns in namespace_dirs(root):
                    _remove_disk_tier(ns / "disk")
                    _unlink(ns / SPEC_FILE)
                    _unlink(ns / MARKER_FILE)
                    _rmdir(ns)
                for tenant in _subdirs(root / TENANTS_DIR):
                    _rmdir(tenant)
                _rmdir(root / TENANTS_DIR)
                _unlink(root / SERVE_LOCK)
        _rmdir(root)
    except OSError as exc:
        raise DataDirError(f"cannot remove {exc.filename or root}: {exc.strerror or exc}") from None
    return before - (disk_usage(root)[0] if root.exists() else 0)


def _remove_disk_tier(disk_dir: Path) -> None:
    """Delete one DISK tier's files while holding its lock (no store can open it meanwhile);
    the lock file goes last, still held, so a store that opens the path next starts anew."""
    if not disk_dir.is_dir():
        return
    with hold_lock(disk_dir / "kvtier.lock"):
        for name in LMDB_FILES:
            _unlink(disk_dir / name)
            _unlink(disk_dir / INDEX_DIR / name)
        _rmdir(disk_dir / INDEX_DIR)
        _unlink(disk_dir / "kvtier.lock")
    _rmdir(disk_dir)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _rmdir(path: Path) -> None:
    """Remove ``path`` if it is empty (what is left in it is not kvtier's)."""
    try:
        path.rmdir()
    except OSError:
        pass

