"""Host (CPU) copies with streaming stores: a hit's gather into a transformers cache and a DISK
record's payload into its destination, compiled from ``host_copy.c`` on first use.

Why: a CPU hit copies a prefix's blocks (tens to hundreds of MiB, past every cache) from pool
slots into per-layer K/V tensors, in pieces of one head's ``block_size x head_dim`` (4 KiB
for SmolLM2-135M in fp32). With ordinary stores each destination line is first read into the
cache (a read for ownership), then written back: three memory passes per byte. Streaming
stores (SSE2 ``MOVNTDQ``) write whole lines to memory: two. glibc's ``memcpy`` streams only
copies past its non-temporal threshold (a fraction of the L3 size: pieces of 4 KiB never are;
on the test VM, whose hypervisor reports a 320 MiB L3, not even one copy of 45 MiB), and
numpy and torch copy through it or through ordinary vector stores. Measured on the 2-core test
VM (AMD EPYC, 2026-12-03, bench/results/2026-12-03-nt-gather): 64 blocks of 720 KiB gathered
into their places in 4 KiB pieces take 1.29x a ``memcpy`` of the same 45 MiB with memcpy
per piece, 0.62x with streaming stores (in C, both); 256 blocks 1.38x vs 0.70x. LMCache's
CPU kernels (``lmcache.c_ops``) and vLLM's ``swap_blocks`` are compiled extensions for the
same reason; kvtier compiles its ~180 lines of C with the system's C compiler the first time a
process needs them (as torch.compile's CPU backend and Triton's launchers do), caches the
library under ``$XDG_CACHE_HOME/kvtier/kernels`` (``~/.cache/kvtier/kernels``), and loads it
with ctypes (which releases the GIL for the call: the copies of the DISK reads' I/O threads
run in parallel).

A DISK read verifies each record's xxh3 checksum as it copies it (:func:`hash_copy_rows`,
:func:`hash_copy_blocks`: each 64 KiB hashed, then copied from cache, all of a read job's
blocks in one call) with python-xxhash's own xxh3 functions, which its extension module
exports (:func:`_bind_xxh3` checks them against ``xxhash.xxh3_64`` at load); through
python-xxhash each block cost two GIL round trips, hash then copy, that the I/O threads and the
caller contended for (bench/results/2026-12-03-fused-hash, 2026-12-03-block-places).

Without a C compiler, on a machine other than x86-64 (plain ``memcpy`` there: the C file
compiles without streaming stores), or with ``KVTIER_HOST_KERNELS=off``, every function
returns ``False`` and the caller copies with numpy as before: the same bytes, slower.

Streaming stores leave the destination out of the cache: right for a copy larger than the
caches or one whose reader comes later (a DISK read into a pool slot, gathered by a later
hit), wrong for a small one whose reader follows at once. Copy calls of fewer than
:data:`STREAMING_MIN_NBYTES` use ordinary stores (``memcpy``) in the same loops.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sysconfig
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

ENV = "KVTIER_HOST_KERNELS"
"""``off`` disables the compiled copies (numpy copies everywhere); anything else, or unset: on
where they compile."""

CACHE_ENV = "KVTIER_KERNEL_CACHE"
"""Directory for the compiled library (default ``$XDG_CACHE_HOME/kvtier/kernels``, else
``~/.cache/kvtier/kernels``)."""

STREAMING_MIN_NBYTES = 256 << 10
"""A copy call of at least this many bytes uses streaming stores; a smaller one ``memcpy``
(its destination stays in cache for a reader that follows)."""

_SOURCE = Path(__file__).with_name("host_copy.c")
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_loaded = False
_hashing = False  # the kvt_hash_copy_* functions have python-xxhash's xxh3 (_bind_xxh3)
_I64 = ctypes.c_int64
_NO_PREFIX = np.empty(0, dtype=np.uint8)  # hash_copy_rows' default: the payload alone
_PTR = ctypes.c_void_p


def library() -> ctypes.CDLL | None:
    """The compiled copies, compiling them on the first call (``None``, logged once, when
    they cannot be built or loaded, or :data:`ENV` is ``off``). Thread-safe."""
    global _library, _loaded
    if _loaded:
        return _library
    with _lock:
        if not _loaded:
            try:
                _library = _load()
            except Exception as exc:  # never into a caller: a bad $CC, a library missing a symbol, ...
                logger.warning("kvtier: host copy kernels unavailable (%s: %s): numpy copies", type(exc).__name__,
                               _short(exc))
                _library = None
            finally:
                _loaded = True
    return _library


def available() -> bool:
    """Whether :func:`gather_blocks` and :func:`copy_into` copy (else they return ``False``)."""
    return library() is not None


def hashing_available() -> bool:
    """Whether :func:`hash_copy_rows` and :func:`hash_copy_blocks` run here (the compiled
    kernels load, with python-xxhash's exported xxh3 bound), compiling on the first call."""
    return library() is not None and _hashing


def _load() -> ctypes.CDLL | None:
    if os.environ.get(ENV, "").strip().lower() == "off":
        logger.info("kvtier: host copy kernels off (%s=off): numpy copies", ENV)
        return None
    try:
        path = _build()
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:  # RuntimeError: no home directory
        logger.warning("kvtier: host copy kernels not built (%s): CPU hits and DISK reads use numpy copies "
                       "(slower; bench/results/2026-12-03-nt-gather)", _short(exc))
        return None
    if path is None:
        logger.info("kvtier: no C compiler found for the host copy kernels: numpy copies")
        return None
    untrusted = _untrusted(path)
    if untrusted:
        logger.warning("kvtier: host copy kernels not loaded: %s (set %s to a directory only you can write): "
                       "numpy copies", untrusted, CACHE_ENV)
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:  # a damaged library (a truncated file): built again, once
        path.unlink(missing_ok=True)
        try:
            lib = ctypes.CDLL(str(_build()))
        except (OSError, subprocess.SubprocessError) as exc:
            logger.warning("kvtier: host copy kernels not loaded (%s): numpy copies", _short(exc))
            return None
    lib.kvt_copy_rows.restype = None
    lib.kvt_copy_rows.argtypes = [_PTR, _I64, _PTR, _I64, _I64, _I64, ctypes.c_int]
    lib.kvt_gather_blocks.restype = None
    lib.kvt_gather_blocks.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, ctypes.c_int]
    lib.kvt_bind_xxh3.restype = None
    lib.kvt_bind_xxh3.argtypes = [_PTR] * 5
    lib.kvt_hash_copy_rows.restype = ctypes.c_int
    lib.kvt_hash_copy_rows.argtypes = [ctypes.POINTER(ctypes.c_uint64), _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64,
                                       ctypes.c_int]
    lib.kvt_hash_copy_blocks.restype = ctypes.c_int
    lib.kvt_hash_copy_blocks.argtypes = [_PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, ctypes.c_int]
    global _hashing
    _hashing = _bind_xxh3(lib)
    return lib


_XXH3_SYMBOLS = (
    ("XXH3_createState",),
    ("XXH3_freeState",),
    ("XXH3_64bits_reset",),
    ("XXH3_64bits_update_dispatch", "XXH3_64bits_update"),  # the dispatching one: AVX2/AVX-512 where the CPU has them
    ("XXH3_64bits_digest",),
)


def _bind_xxh3(lib: ctypes.CDLL) -> bool:
    """Give the C library python-xxhash's own xxh3 functions (its extension module exports
    xxHash's C API) and check them: a known input must hash and copy as ``xxhash.xxh3_64``
    and numpy do. ``False`` (logged; :func:`hash_copy_rows` then returns ``None``) when the
    module does not export them or the check fails. The system's libxxhash is not used: the
    Debian build hashes at 10.6 GB/s where python-xxhash's dispatching build does 51 GB/s
    (2026-12-03 VM)."""
    import xxhash

    try:
        import xxhash._xxhash as extension

        exported = ctypes.CDLL(extension.__file__)  # loaded already by the import: the same handle
        addresses = []
        for names in _XXH3_SYMBOLS:
            found = next((name for name in names if hasattr(exported, name)), None)
            if found is None:
                raise AttributeError(f"python-xxhash exports none of {names}")
            addresses.append(ctypes.cast(getattr(exported, found), ctypes.c_void_p).value)
    except (ImportError, OSError, AttributeError) as exc:
        logger.info("kvtier: DISK reads hash with python-xxhash, then copy (%s)", _short(exc))
        lib.kvt_bind_xxh3(None, None, None, None, None)
        return False
    lib.kvt_bind_xxh3(*addresses)
    rng = np.random.default_rng(17)
    prefix = rng.integers(0, 256, 120, dtype=np.uint8)
    src = rng.integers(0, 256, 3 * 70_001, dtype=np.uint8)
    expected = xxhash.xxh3_64(prefix.tobytes() + src.tobytes()).intdigest()
    for chunk in (4096, 1 << 20):  # both of the kernel's loops: long rows in chunks, whole rows per chunk
        dst = np.zeros(3 * 80_000, dtype=np.uint8).reshape(3, 80_000)
        digest = ctypes.c_uint64()
        status = lib.kvt_hash_copy_rows(ctypes.byref(digest), prefix.ctypes.data, prefix.size, dst.ctypes.data,
                                        80_000, src.ctypes.data, 3, 70_001, chunk, 1)
        if status != 0 or digest.value != expected or not (dst[:, :70_001] == src.reshape(3, -1)).all():
            logger.warning("kvtier: python-xxhash's exported xxh3 failed kvtier's check: DISK reads hash with python-xxhash, then copy")
            lib.kvt_bind_xxh3(None, None, None, None, None)
            return False
    return True


def _short(exc: BaseException) -> str:
    text = getattr(exc, "stderr", None) or str(exc)
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return " ".join(str(text).split())[:300]


def _compiler() -> list[str] | None:
    """The C compiler command: ``$CC``, Python's own build compiler, ``cc``, ``gcc``, ``clang``
    (the first whose program is on ``PATH``)."""
    for candidate in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc", "clang"):
        words = shlex.split(candidate) if candidate else []
        if words and shutil.which(words[0]):
            return words
    return None


def _untrusted(path: Path) -> str | None:
    """Why a library at ``path`` must not be loaded (``None``: it may): it or its directory
    is owned by another user or writable by others (a library planted in a shared directory
    would run in this process)."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    for item in (path.parent, path):
        st = item.stat()
        if uid is not None and st.st_uid not in (uid, 0):
            return f"{item} belongs to another user"
        if st.st_mode & 0o022:
            return f"{item} is writable by others"
    return None


def cache_dir() -> Path:
    """Where the compiled library is kept (:data:`CACHE_ENV`)."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtier" / "kernels"


def _build() -> Path | None:
    """The library for this source, compiler and machine, compiled unless cached (``None``:
    no compiler). Raises ``OSError`` / ``SubprocessError`` when the compile fails."""
    compiler = _compiler()
    if compiler is None:
        return None
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(compiler).encode() + platform.machine().encode()).hexdigest()[:16]
    directory = cache_dir()
    path = directory / f"host_copy-{key}.so"
    if path.is_file():
        return path
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    _remove_stale_partials(directory)
    partial = directory / f".host_copy-{key}.{os.getpid()}.{threading.get_ident()}.so"
    try:
        subprocess.run([*compiler, "-O2", "-shared", "-fPIC", "-o", str(partial), str(_SOURCE)],
                       check=True, capture_output=True, timeout=120)
        os.chmod(partial, 0o755)  # never group- or world-writable, whatever the umask (_untrusted)
        os.replace(partial, path)  # atomic: a concurrent build of the same key writes the same bytes
    finally:
        partial.unlink(missing_ok=True)
    return path


def _remove_stale_partials(directory: Path, age_s: float = 600.0) -> None:
    """Delete compiler outputs left by builds killed mid-way (older than ``age_s``)."""
    import time

    for stale in directory.glob(".host_copy-*.so"):
        try:
            if time.time() - stale.stat().st_mtime > age_s:
                stale.unlink()
        except OSError:
            pass


def gather_blocks(out: np.ndarray, pool: np.ndarray, slots: Sequence[int], positions: Sequence[int]) -> bool:
    """``out[:, positions[i]] = pool[slots[i]]`` for every ``i``, in order: a hit's blocks from
    their pool slots to their places in a cache laid out head-major.

    Args:
        out: ``[rows, n, piece_nbytes]`` uint8, C-contiguous, writable (``rows`` =
            ``num_layers * 2 * num_kv_heads``, ``n`` = the cache's tokens / ``block_size``,
            ``piece_nbytes`` = ``block_size * head_dim * itemsize``).
        pool: ``[num_slots, rows, piece_nbytes]`` uint8, C-contiguous.
        slots, positions: ``[k]`` ints each, ``0 <= slot < num_slots``, ``0 <= position < n``.

    Returns:
        ``True`` when copied; ``False`` (nothing copied) when the kernels are unavailable or
        ``out`` and ``pool`` share memory (the caller copies with numpy).

    Raises:
        ValueError: shapes, dtypes, layout, indices that are not integers or out of range
            (checked before any byte is written: the kernel itself trusts its arguments).
    """
    lib = library()
    if lib is None:
        return False
    if out.dtype != np.uint8 or pool.dtype != np.uint8 or out.ndim != 3 or pool.ndim != 3:
        raise ValueError(f"expected uint8 out [rows, n, piece] and pool [slots, rows, piece], got "
                         f"{out.dtype} {out.shape} and {pool.dtype} {pool.shape}")
    rows, n, piece = out.shape
    if pool.shape[1:] != (rows, piece):
        raise ValueError(f"expected pool [slots, {rows}, {piece}], got {pool.shape}")
    if not (out.flags.c_contiguous and out.flags.writeable and pool.flags.c_contiguous):
        raise ValueError("expected a C-contiguous writable out and a C-contiguous pool")
    k = len(slots)
    if len(positions) != k:
        raise ValueError(f"expected one position per slot ({k}), got {len(positions)}")
    if not k:
        return True
    ids = np.asarray([slots, positions])
    if ids.dtype.kind not in "iub":  # a float (NaN, 2.9) never becomes an address
        raise ValueError(f"expected integer slots and positions, got {ids.dtype}")
    if ids.min() < 0 or ids[0].max() >= pool.shape[0] or ids[1].max() >= n:
        raise ValueError(f"expected slots in [0, {pool.shape[0]}) and positions in [0, {n}), got slots "
                         f"{ids[0].min()}..{ids[0].max()}, positions {ids[1].min()}..{ids[1].max()}")
    if np.may_share_memory(out, pool):  # overlapping: numpy's copies handle it, these do not
        return False
    ids = ids.astype(np.int64)
    streaming = int(k * rows * piece >= STREAMING_MIN_NBYTES)
    lib.kvt_gather_blocks(out.ctypes.data, n * piece, pool.ctypes.data, rows * piece, ids[0].ctypes.data,
                          ids[1].ctypes.data, k, rows, piece, streaming)
    return True


def row_layout(array: np.ndarray) -> tuple[int, int, int] | None:
    """``(rows, row_nbytes, row_stride)`` of a uint8 array whose bytes are ``rows`` equally
    spaced runs of ``row_nbytes`` contiguous bytes (a block's place in a larger buffer: its
    leading dimensions collapse into one stride, its trailing ones are contiguous), ``None``
    for any other layout."""
    if array.dtype != np.uint8 or array.ndim == 0:
        return None
    shape, strides = array.shape, array.strides
    # the contiguous tail: trailing dimensions each stride = the product of the ones after it
    row_nbytes, axis = 1, array.ndim
    while axis > 0 and (shape[axis - 1] == 1 or strides[axis - 1] == row_nbytes):
        axis -= 1
        row_nbytes *= shape[axis]
    if axis == 0:
        return 1, row_nbytes, row_nbytes
    rows, row_stride = shape[axis - 1], strides[axis - 1]
    for a in range(axis - 2, -1, -1):  # the leading ones must nest evenly into one stride
        if shape[a] == 1:
            continue
        if strides[a] != rows * row_stride or row_stride <= 0:
            return None
        rows *= shape[a]
    if rows > 1 and row_stride < row_nbytes:
        return None  # overlapping rows: not a destination
    return rows, row_nbytes, row_stride


def _overlaps(dst_address: int, layout: tuple[int, int, int], src: np.ndarray) -> bool:
    """Whether ``src`` lies within the span of the rows ``layout`` places at ``dst_address``."""
    rows, row_nbytes, row_stride = layout
    return dst_address < src.ctypes.data + src.size and src.ctypes.data < dst_address + (rows - 1) * row_stride + row_nbytes


def _check_source(src: np.ndarray, nbytes: int) -> None:
    if src.dtype != np.uint8 or not src.flags.c_contiguous or src.size != nbytes:
        raise ValueError(f"expected a C-contiguous uint8 source of {nbytes} bytes, got {src.dtype} "
                         f"{src.shape} (contiguous: {src.flags.c_contiguous})")


def copy_into(dst: np.ndarray, src: np.ndarray) -> bool:
    """``dst[...] = src`` for a uint8 ``dst`` laid out as equally spaced contiguous rows
    (:func:`row_layout`) and a C-contiguous uint8 ``src`` of as many bytes, in the
    destination's order (:func:`copy_rows` at ``dst``'s address).

    Returns:
        ``True`` when copied; ``False`` (nothing copied) when the kernels are unavailable,
        ``dst`` has another layout or overlaps ``src`` (the caller copies with numpy).

    Raises:
        ValueError: ``src`` is not C-contiguous uint8 of ``dst.size`` bytes, or ``dst`` is
            not writable.
    """
    if library() is None:
        return False
    _check_source(src, dst.size)
    if not dst.flags.writeable:
        raise ValueError("expected a writable destination")
    layout = row_layout(dst)
    return layout is not None and copy_rows(dst.ctypes.data, layout, src)


def copy_rows(dst_address: int, layout: tuple[int, int, int], src: np.ndarray) -> bool:
    """``rows`` runs of ``row_nbytes`` from ``src`` (C-contiguous uint8) to
    ``dst_address + r * row_stride`` (``layout`` = :func:`row_layout`, computed once for many
    destinations of one shape and strides, e.g. the blocks' places in a hit buffer).

    The caller vouches for the address and layout (every byte they name must be writable
    memory it owns); ``src`` is checked.

    Returns:
        ``True`` when copied; ``False`` (nothing copied) when the kernels are unavailable or
        the destination overlaps ``src``.

    Raises:
        ValueError: ``src`` is not C-contiguous uint8 of ``rows * row_nbytes`` bytes.
    """
    lib = library()
    if lib is None:
        return False
    rows, row_nbytes, row_stride = layout
    _check_source(src, rows * row_nbytes)
    if not src.size:
        return True
    if _overlaps(dst_address, layout, src):
        return False  # the caller's numpy copy handles it
    lib.kvt_copy_rows(dst_address, row_stride, src.ctypes.data, row_nbytes, rows, row_nbytes,
                      int(src.size >= STREAMING_MIN_NBYTES))
    return True


HASH_CHUNK_NBYTES = 64 << 10
""":func:`hash_copy_rows` hashes this many bytes (whole rows when rows are shorter), then copies
them while they are in cache (L2: 512 KiB to 2 MiB a core on current x86)."""


def _check_chunk() -> None:
    if not isinstance(HASH_CHUNK_NBYTES, int) or HASH_CHUNK_NBYTES <= 0:
        raise ValueError(f"expected HASH_CHUNK_NBYTES to be an int > 0, got {HASH_CHUNK_NBYTES!r}")


def hash_copy_rows(dst_address: int, layout: tuple[int, int, int], src: np.ndarray,
                   prefix: np.ndarray = _NO_PREFIX) -> int | None:
    """:func:`copy_rows` that also returns the xxh3-64 of ``prefix`` followed by ``src``
    (``xxhash.xxh3_64(prefix + src).intdigest()``), in one pass over ``src`` and without the
    GIL: a DISK record verified and delivered (:func:`kvtier.records.decode_into_view`). Every
    chunk of :data:`HASH_CHUNK_NBYTES` is hashed, then copied from cache.

    Returns:
        the digest; ``None`` (nothing copied) when the kernels or python-xxhash's exported
        xxh3 are unavailable (:func:`_bind_xxh3`), or the destination overlaps ``src``: the
        caller hashes and copies as before.

    Raises:
        ValueError: ``src`` or ``prefix`` not C-contiguous uint8, ``src`` not
            ``rows * row_nbytes`` bytes, :data:`HASH_CHUNK_NBYTES` not an int > 0.
    """
    lib = library()
    if lib is None or not _hashing:
        return None
    rows, row_nbytes, row_stride = layout
    _check_source(src, rows * row_nbytes)
    _check_source(prefix, prefix.size)
    if src.size and _overlaps(dst_address, layout, src):
        return None
    _check_chunk()
    digest = ctypes.c_uint64()
    if lib.kvt_hash_copy_rows(ctypes.byref(digest), prefix.ctypes.data, prefix.size, dst_address, row_stride,
                              src.ctypes.data, rows, row_nbytes, HASH_CHUNK_NBYTES,
                              int(src.size >= STREAMING_MIN_NBYTES)) != 0:
        return None
    return digest.value


def hash_copy_blocks(dst_addresses: np.ndarray, layout: tuple[int, int, int], records: Sequence[np.ndarray],
                     prefix_nbytes: int, payload_offset: int) -> np.ndarray | None:
    """:func:`hash_copy_rows` for many blocks of one layout in one call (the GIL released once for
    them all): block ``b``'s digest is the xxh3-64 of ``records[b][:prefix_nbytes]`` followed by
    its payload ``records[b][payload_offset:]``, whose rows go to ``dst_addresses[b] + r *
    row_stride``.

    Args:
        dst_addresses: ``[n]`` int64, each a destination the caller vouches for (``layout``'s
            rows there are writable memory it owns, the blocks' places do not overlap).
        layout: ``(rows, row_nbytes, row_stride)`` (:func:`row_layout`), every block's.
        records: ``n`` C-contiguous uint8 arrays of exactly ``payload_offset + rows *
            row_nbytes`` bytes (``prefix_nbytes <= payload_offset``).

    Returns:
        ``[n]`` uint64 digests; ``None`` (nothing copied) when the kernels or the bound xxh3
        are unavailable, or a destination range overlaps a record: the caller decodes each
        block on its own.

    Raises:
        ValueError: a record of another size, dtype or layout, mismatched lengths, or
            :data:`HASH_CHUNK_NBYTES` not an int > 0.
    """
    lib = library()
    if lib is None or not _hashing:
        return None
    rows, row_nbytes, row_stride = layout
    n = len(records)
    if len(dst_addresses) != n or not 0 <= prefix_nbytes <= payload_offset:
        raise ValueError(f"expected one destination per record ({n}) and a prefix within the header, got "
                         f"{len(dst_addresses)} and {prefix_nbytes} of {payload_offset}")
    if not n:
        return np.zeros(0, np.uint64)
    nbytes = payload_offset + rows * row_nbytes
    for record in records:
        _check_source(record, nbytes)
    starts = np.fromiter((r.ctypes.data for r in records), np.int64, n)
    dsts = np.ascontiguousarray(dst_addresses, dtype=np.int64)
    span = (rows - 1) * row_stride + row_nbytes if rows else 0
    lo, hi = dsts.min(), dsts.max() + span  # every destination lies in [lo, hi)
    if np.any((starts < hi) & (starts + nbytes > lo)):
        return None  # a record inside the destinations' range: left to the caller's per-block copies
    _check_chunk()
    digests = np.empty(n, np.uint64)
    if lib.kvt_hash_copy_blocks(digests.ctypes.data, starts.ctypes.data, prefix_nbytes, payload_offset, dsts.ctypes.data,
                                row_stride, n, rows, row_nbytes, HASH_CHUNK_NBYTES,
                                int(n * rows * row_nbytes >= STREAMING_MIN_NBYTES)) != 0:
        return None
    return digests
