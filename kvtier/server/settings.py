"""The daemon's settings: where it listens, who may call it, how large and how slow a call
may be, and the store configuration each namespace's :class:`~kvtier.store.TieredStore`
starts from."""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvtier.checks import UNIX_PATH_MAX_NBYTES, check_token
from kvtier.config import StoreConfig, parse_bytes
from kvtier.server.loop import EVENT_LOOPS
from kvtier.server.tenants import Tenants

DEFAULT_PORT = 8765
TOKEN_ENV = "KVTIER_TOKEN"
EVENT_LOOP_ENV = "KVTIER_EVENT_LOOP"


@dataclass(frozen=True)
class ServeConfig:
    """Settings of ``kvtier serve``.

    Capacities in ``store`` (``cpu_bytes``, ``disk_bytes``, ``gpu_bytes``) apply to each
    registered namespace (each model has its own block shape, so its own pools); the GPU
    pool is used only when CUDA is present. ``store.remote_url`` is ignored: the daemon is
    the bottom tier.
    """

    store: StoreConfig = field(default_factory=StoreConfig)
    host: str = "127.0.0.1"
    """Address to bind. A non-loopback address needs a token."""
    port: int | None = DEFAULT_PORT
    """TCP port; 0 picks a free one (printed at start-up); ``None``: no TCP listener (only
    ``unix_socket``)."""
    unix_socket: Path | None = None
    """Path of a Unix socket to listen on (mode 0600, in a directory of this user that no one
    else may write); the recommended local transport: only the daemon's user can connect."""
    token: str | None = None
    """The one token of the daemon (tenant ``default``, admin); ``None``: no auth (loopback
    or Unix socket only). Exclusive with ``token_file``."""
    token_file: Path | None = None
    """Tokens of several tenants and the admin (kvtier.server.tenants)."""
    allow_hosts: tuple[str, ...] = ()
    """Host names accepted in the ``Host`` header besides the bound address, ``localhost``
    and IP literals (DNS rebinding: a browser page's requests carry its own host name)."""
    idle_timeout_s: float = 15.0
    """A connection with no request in progress is closed after this long: an idle
    keep-alive, or a request whose headers have not all arrived (slowloris)."""
    request_timeout_s: float = 60.0
    """Most seconds a call may take that is not streaming blocks (lookup, register, ...)."""
    min_rate_bytes_per_s: int = 1 << 20
    """A put body must arrive, and a get response be read, at this rate on average after
    ``grace_s``; slower: the connection is closed and its pins and staging buffers freed."""
    grace_s: float = 5.0
    """Seconds every body read and response write gets before the minimum rate applies."""
    max_connections: int = 1024
    """Connections open at once; beyond, the longest idle one is closed, or the new one."""
    max_staging_bytes: int = 512 << 20
    """Staging memory of all puts in flight together; a put that finds none within
    ``grace_s`` is refused with 503."""
    max_pinned_fraction: float = 0.5
    """Share of a namespace's top pool that gets in flight may pin together; a get that
    finds none free sends the blocks it could (a shorter hit, never an error)."""
    shutdown_timeout_s: float = 2.0
    """On SIGTERM, calls in flight get this long before their connections are closed."""
    max_namespaces: int = 8
    """Namespaces (models) the daemon holds at once; registering one more is refused (507)."""
    max_block_bytes: int = 64 << 20
    """Largest block payload, bytes; a larger block or registration is refused (413)."""
    max_batch_blocks: int = 1024
    """Most block hashes or frames in one call (413 beyond)."""
    durable: bool = False
    """Acknowledge a put only once the block is committed to DISK (an LMDB transaction,
    which survives kill -9 of the daemon); the stores run ``write_through``. Otherwise a
    put is acknowledged once the block is in the store's memory."""
    num_threads: int = 8
    """Threads that run the (blocking) store calls so the event loop keeps serving."""
    event_loop: str = "auto"
    """``auto`` (uvloop when installed: ``kvtier[fast]``), ``uvloop`` or ``asyncio``
    (kvtier.server.loop); ``KVTIER_EVENT_LOOP``."""

    def __post_init__(self) -> None:
        for name in ("max_namespaces", "max_block_bytes", "max_batch_blocks", "num_threads", "max_connections",
                     "max_staging_bytes", "min_rate_bytes_per_s"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"expected {name} > 0, got {value!r}")
        for name in ("idle_timeout_s", "request_timeout_s", "grace_s", "shutdown_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
                raise ValueError(f"expected 0 < {name} <= 3600 (seconds), got {value!r}")
        if self.event_loop not in EVENT_LOOPS:
            raise ValueError(f"expected event_loop in {list(EVENT_LOOPS)}, got {self.event_loop!r}")
        if not 0 < self.max_pinned_fraction <= 1:
            raise ValueError(f"expected 0 < max_pinned_fraction <= 1, got {self.max_pinned_fraction!r}")
        if self.port is not None and (not isinstance(self.port, int) or not 0 <= self.port < 1 << 16):
            raise ValueError(f"expected 0 <= port < 65536, got {self.port!r}")
        if self.port is None and self.unix_socket is None:
            raise ValueError("expected a port or a unix socket to listen on")
        if self.unix_socket is not None:
            path = Path(self.unix_socket).expanduser().absolute()
            if len(str(path).encode()) > UNIX_PATH_MAX_NBYTES:
                raise ValueError(f"expected a unix socket path of at most {UNIX_PATH_MAX_NBYTES} bytes, got {path}")
            object.__setattr__(self, "unix_socket", path)
        if self.token is not None:
            check_token(self.token)
        if self.token is not None and self.token_file is not None:
            raise ValueError("expected --token or --token-file, not both")
        if self.durable and not self.store.disk_bytes:
            raise ValueError("expected disk_bytes > 0 with --durable (a durable put is one committed to DISK)")
        if self.store.cpu_bytes == 0:
            raise ValueError("expected cpu_bytes > 0: the daemon serves blocks from its CPU pool")

    def check_bind(self) -> None:
        """Raises ``ValueError`` when ``host`` is not a loopback address and no token is set
        (an open daemon would hand any caller every cached block, and take theirs)."""
        if self.port is not None and self.token is None and self.token_file is None and not is_loopback(self.host):
            raise ValueError(
                f"refusing to listen on {self.host!r} without a token: pass --token, --token-file or set "
                f"{TOKEN_ENV} (or bind to 127.0.0.1, or use --unix-socket)"
            )

    def tenants(self) -> Tenants:
        """Who may call (kvtier.server.tenants); raises ``ValueError`` for a bad token file."""
        if self.token_file is not None:
            return Tenants.load(self.token_file)
        return Tenants.single(self.token)

    def store_config(self, data_dir: Any, block_size: int, cuda: bool) -> StoreConfig:
        """The StoreConfig of one namespace's store."""
        return replace(
            self.store,
            data_dir=data_dir,
            block_size=block_size,
            gpu_bytes=self.store.gpu_bytes if cuda else 0,
            remote_url=None,
            write_policy="write_through" if self.durable else self.store.write_policy,
        )

    @classmethod
    def from_options(cls, store: StoreConfig, options: Mapping[str, Any], environ: Mapping[str, str] | None = None):
        """From CLI options (``None`` = not given); the token falls back to ``KVTIER_TOKEN``,
        the event loop to ``KVTIER_EVENT_LOOP``."""
        environ = os.environ if environ is None else environ
        values = {k: options[k] for k in ("host", "port", "max_namespaces", "max_batch_blocks", "num_threads",
                                          "max_connections", "idle_timeout_s", "unix_socket", "token_file")
                  if options.get(k) is not None}
        if options.get("max_block_bytes") is not None:
            values["max_block_bytes"] = parse_bytes(options["max_block_bytes"])
        if options.get("allow_host"):
            values["allow_hosts"] = tuple(options["allow_host"])
        if values.get("unix_socket") is not None and options.get("port") is None and options.get("host") is None:
            values["port"] = None  # the socket only, unless a TCP address is asked for too
        token = options.get("token") or (None if values.get("token_file") else environ.get(TOKEN_ENV)) or None
        event_loop = options.get("event_loop") or environ.get(EVENT_LOOP_ENV) or "auto"
        return cls(store=store, token=token, durable=bool(options.get("durable")), event_loop=event_loop, **values)


def is_loopback(host: str) -> bool:
    """``True`` for ``localhost``, 127.0.0.0/8 and ::1 (names are resolved)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)
