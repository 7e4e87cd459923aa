"""The daemon's files: where each lives, who may read it, and the one way a directory goes away.

::

    <data_dir>/                                    0700, owned by the daemon's user
    <data_dir>/serve.lock                          0600, flock: one daemon per data directory
    <data_dir>/secret                              0600, key of the opaque namespace labels
    <data_dir>/tenants/<tenant>/<namespace hex>/   0700, one per (tenant, namespace)
        kvtier-namespace.msgpack                   0600, {"tenant", "namespace"}: written first
        spec.msgpack                               0600, {"block_shape", "dtype"}
        disk/                                      the namespace's LMDB (files 0600)

Every path is computed from parsed names (:func:`kvtier.checks.parse_tenant`,
:func:`~kvtier.checks.namespace_hex`), never from the text of a request. A directory is
removed only by :func:`remove_namespace_dir`, and only when it is one the daemon created: the
path it computes for (tenant, namespace), a real directory (no symlink) whose resolved parent
is ``<data_dir>/tenants/<tenant>``, whose name parses back to the namespace, holding the
marker that names the same tenant and namespace (issue 12: a namespace that decoded to ``b""``
once named the data directory itself, and its cleanup deleted every namespace).

Files are created owner-only (mode 0600, directories 0700; the daemon also runs with umask
077), the lock file is opened with ``O_NOFOLLOW`` inside the 0700 directory: another local user
can neither read a block nor hold the lock. A data directory owned by another user is refused.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import msgpack

from kvtier.checks import namespace_hex, parse_display_name, parse_namespace, parse_tenant
from kvtier.types import KVSpec
from kvtier.wire import pack_spec, unpack_spec

logger = logging.getLogger(__name__)

LOCK_FILE = "serve.lock"
SECRET_FILE = "secret"
TENANTS_DIR = "tenants"
MARKER_FILE = "kvtier-namespace.msgpack"
SPEC_FILE = "spec.msgpack"
_OPEN_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW


def prepare_data_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` (0700) or check it: a directory of this user, made 0700. Returns the
    resolved path. Raises ``RuntimeError`` for a directory of another user or not a directory."""
    path = Path(path).expanduser()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = path.resolve()
    st = path.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"data directory {path} is not a directory")
    if st.st_uid != os.geteuid():
        raise RuntimeError(f"data directory {path} belongs to uid {st.st_uid}, not to this user ({os.geteuid()})")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def lock(data_dir: Path) -> int:
    """An exclusive ``flock`` on ``<data_dir>/serve.lock`` (0600, ``O_NOFOLLOW``); returns its
    fd (close it to unlock). Raises ``RuntimeError`` when another daemon holds it."""
    path = data_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _OPEN_FLAGS, 0o600)
    except OSError as exc:
        raise RuntimeError(f"cannot open the lock file {path} ({exc.strerror}); a symlink is refused") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise RuntimeError(f"lock file {path} is not a regular file of this user")
        os.fchmod(fd, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise RuntimeError(f"another kvtier serve uses {data_dir} (it holds {path})") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def secret(data_dir: Path) -> bytes:
    """32 random bytes kept in ``<data_dir>/secret`` (created once): the key of the opaque
    labels, so that a namespace keeps its label across restarts."""
    path = data_dir / SECRET_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600)
    except FileExistsError:
        fd = os.open(path, os.O_RDONLY | _OPEN_FLAGS)
        with os.fdopen(fd, "rb") as f:
            data = f.read(64)
        if len(data) == 32:
            return data
        raise RuntimeError(f"{path}: expected 32 bytes, got {len(data)}; delete it to make a new one") from None
    data = os.urandom(32)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return data


def namespace_dir(data_dir: Path, tenant: str, namespace: bytes) -> Path:
    """``<data_dir>/tenants/<tenant>/<namespace hex>`` from the parsed names."""
    return data_dir / TENANTS_DIR / parse_tenant(tenant) / namespace_hex(namespace)


def create_namespace_dir(data_dir: Path, tenant: str, namespace: bytes, spec: KVSpec, name: str | None = None) -> Path:
    """Make the namespace's directory (0700), its marker (with the display name given at
    registration, if any), then its spec file (both 0600). A directory already there is
    reused only if the daemon made it (a namespace being reset, or left by a delete that
    failed halfway); anything else there raises ``RuntimeError`` and is left alone."""
    path = namespace_dir(data_dir, tenant, namespace)
    for d in (data_dir / TENANTS_DIR, path.parent):
        d.mkdir(mode=0o700, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        if not is_namespace_dir(data_dir, tenant, namespace):
            raise RuntimeError(f"{path} exists and is not a namespace directory this daemon made: "
                               "leaving it alone") from None
    _mark(path, tenant, namespace, spec, name)
    return path


def _mark(path: Path, tenant: str, namespace: bytes, spec: KVSpec, name: str | None) -> None:
    """Write the marker, then the spec (this registration's: DISK records of another spec
    left there are refused on read, CORRUPT)."""
    marker = {"tenant": tenant, "namespace": namespace, "name": name}
    _write(path / MARKER_FILE, msgpack.packb(marker, use_bin_type=True))
    _write(path / SPEC_FILE, pack_spec(spec))


def is_namespace_dir(data_dir: Path, tenant: str, namespace: bytes) -> bool:
    """Whether the daemon made ``namespace_dir(data_dir, tenant, namespace)`` (module doc)."""
    path = namespace_dir(data_dir, tenant, namespace)
    try:
        st = path.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            return False
        if path.resolve().parent != (data_dir.resolve() / TENANTS_DIR / tenant) or parse_namespace(path.name) != namespace:
            return False
        marker = _marker(path)
    except (OSError, ValueError, msgpack.UnpackException):
        return False
    return marker.get("tenant") == tenant and marker.get("namespace") == namespace


def _marker(path: Path) -> dict:
    marker = msgpack.unpackb(_read(path / MARKER_FILE, 512), raw=False)
    if not isinstance(marker, dict):
        raise ValueError("expected a map")
    return marker


def remove_namespace_dir(data_dir: Path, tenant: str, namespace: bytes) -> bool:
    """Delete the namespace's directory, only if the daemon made it; ``False`` otherwise."""
    path = namespace_dir(data_dir, tenant, namespace)
    if not is_namespace_dir(data_dir, tenant, namespace):
        logger.error("not deleting %s: not a namespace directory this daemon created", path)
        return False
    shutil.rmtree(path, ignore_errors=True)  # fd-based on Linux: never follows a symlink out
    return True


def wipe_blocks(data_dir: Path, tenant: str, namespace: bytes) -> bool:
    """Delete the namespace's DISK tier (``disk/``), keeping its marker and spec."""
    if not is_namespace_dir(data_dir, tenant, namespace):
        return False
    shutil.rmtree(namespace_dir(data_dir, tenant, namespace) / "disk", ignore_errors=True)
    return True


def tighten(path: Path) -> None:
    """Make every file under ``path`` 0600 and every directory 0700 (the LMDB files the store
    created, whatever the umask was)."""
    for root, dirs, files in os.walk(path):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o700, follow_symlinks=False)
        for f in files:
            p = os.path.join(root, f)
            if not os.path.islink(p):
                os.chmod(p, 0o600)


def find_namespaces(data_dir: Path) -> Iterator[tuple[str, bytes, Path, KVSpec, str | None]]:
    """``(tenant, namespace, path, spec, display name)`` of every namespace directory the
    daemon made (the name given at registration, if any, and still well-formed)."""
    root = data_dir / TENANTS_DIR
    if not root.is_dir():
        return
    for tenant_dir in sorted(root.iterdir()):
        try:
            tenant = parse_tenant(tenant_dir.name)
        except ValueError:
            continue
        for path in sorted(tenant_dir.iterdir()) if tenant_dir.is_dir() and not tenant_dir.is_symlink() else ():
            try:
                namespace = parse_namespace(path.name)
            except ValueError:
                continue
            spec = read_spec(path) if is_namespace_dir(data_dir, tenant, namespace) else None
            if spec is not None:
                name = _marker(path).get("name")
                try:
                    name = None if name is None else parse_display_name(name)
                except ValueError:
                    name = None
                yield tenant, namespace, path, spec, name


def migrate_legacy(data_dir: Path, tenant: str) -> int:
    """Move namespace directories of the layout before tenants (``<data_dir>/<hex>/`` with a
    spec file) to ``tenants/<tenant>/``; returns how many moved."""
    moved = 0
    for path in sorted(data_dir.iterdir()):
        try:
            namespace = parse_namespace(path.name)
        except ValueError:
            continue
        spec = read_spec(path) if path.is_dir() and not path.is_symlink() else None
        target = namespace_dir(data_dir, tenant, namespace)
        if spec is None or target.exists():
            continue
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.rename(path, target)
        _mark(target, tenant, namespace, spec, None)
        tighten(target)
        moved += 1
    return moved


def read_spec(path: Path) -> KVSpec | None:
    """The spec saved in a namespace directory, or ``None``."""
    try:
        return unpack_spec(_read(path / SPEC_FILE, 4096))
    except FileNotFoundError:
        return None
    except (ValueError, OSError) as exc:
        logger.warning("ignoring %s: unreadable %s (%s)", path, SPEC_FILE, exc)
        return None


def _read(path: Path, limit: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | _OPEN_FLAGS)
    with os.fdopen(fd, "rb") as f:
        return f.read(limit)


def _write(path: Path, data: bytes) -> None:
    """Atomically (write, fsync, rename), mode 0600: a crash leaves the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _OPEN_FLAGS, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
