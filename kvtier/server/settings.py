"""The daemon's settings: where it listens, who may call it, how large a call may be, and
the store configuration each namespace's :class:`~kvtier.store.TieredStore` starts from."""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvtier.config import StoreConfig, parse_bytes

DEFAULT_PORT = 8765
TOKEN_ENV = "KVTIER_TOKEN"


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
    port: int = DEFAULT_PORT
    """TCP port; 0 picks a free one (printed at start-up)."""
    token: str | None = None
    """Bearer token every call but ``/healthz`` and ``/openapi.json`` must carry
    (``Authorization: Bearer <token>``); ``None``: no auth (loopback only)."""
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

    def __post_init__(self) -> None:
        for name in ("max_namespaces", "max_block_bytes", "max_batch_blocks", "num_threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"expected {name} > 0, got {value!r}")
        if not isinstance(self.port, int) or not 0 <= self.port < 1 << 16:
            raise ValueError(f"expected 0 <= port < 65536, got {self.port!r}")
        if self.token is not None and (not self.token or self.token != self.token.strip()):
            raise ValueError("expected a non-empty token without surrounding whitespace")
        if self.durable and not self.store.disk_bytes:
            raise ValueError("expected disk_bytes > 0 with --durable (a durable put is one committed to DISK)")
        if self.store.cpu_bytes == 0:
            raise ValueError("expected cpu_bytes > 0: the daemon serves blocks from its CPU pool")

    def check_bind(self) -> None:
        """Raises ``ValueError`` when ``host`` is not a loopback address and no token is set
        (an open daemon would hand any caller every cached block, and take theirs)."""
        if self.token is None and not is_loopback(self.host):
            raise ValueError(
                f"refusing to listen on {self.host!r} without a token: pass --token or set {TOKEN_ENV} "
                "(or bind to 127.0.0.1)"
            )

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
        """From CLI options (``None`` = not given); the token falls back to ``KVTIER_TOKEN``."""
        environ = os.environ if environ is None else environ
        values = {k: options[k] for k in ("host", "port", "max_namespaces", "max_batch_blocks", "num_threads")
                  if options.get(k) is not None}
        if options.get("max_block_bytes") is not None:
            values["max_block_bytes"] = parse_bytes(options["max_block_bytes"])
        token = options.get("token") or environ.get(TOKEN_ENV) or None
        return cls(store=store, token=token, durable=bool(options.get("durable")), **values)


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
