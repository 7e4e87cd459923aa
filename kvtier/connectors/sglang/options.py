"""Backend options from SGLang's ``--hicache-storage-backend-extra-config`` (one flat JSON
object, validated once, here).

SGLang's own keys for a dynamic backend (``backend_name``, ``module_path``, ``class_name``,
``interface_v1``) are accepted and left to SGLang. Every :class:`~kvtier.config.StoreConfig`
field is accepted under its own name (``cpu_bytes``, ``disk_bytes``, ``data_dir``,
``remote_url``, ...; byte sizes as ints or strings like ``"4GiB"``), on top of ``KVTIER_*``
environment variables, plus the backend's own keys (:class:`BackendOptions`). Anything else is
an error at attach time, not a silently ignored typo.

Store defaults that differ from ``StoreConfig``'s for an L3 backend: ``gpu_bytes=0`` (SGLang's
GPU pool and host pool are L1 and L2; kvtier's reads land in its CPU pool and are copied into
SGLang's host buffer), ``cpu_bytes=256MiB`` (a staging and hot-page cache, not a second L2:
loads and stores go through it in chunks of half its size) and
``write_policy="write_through"`` (a page SGLang backs up reaches DISK at once, not only when a
served engine shuts down cleanly). ``block_size`` is SGLang's page size; giving it is an error.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvtier.config import ENV_PREFIX, StoreConfig

SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
"""Keys SGLang's dynamic-backend factory reads from the same extra config."""

BACKEND_STORE_DEFAULTS: dict[str, Any] = {
    "gpu_bytes": 0,
    "cpu_bytes": 256 << 20,
    "write_policy": "write_through",
}
_REFUSED_STORE_KEYS = ("gpu_bytes", "block_size", "hash_name")


@dataclass(frozen=True)
class BackendOptions:
    """What the backend runs with.

    Attributes:
        store: the store's capacities and policies (``block_size`` is set later, from the
            host pool's page size).
        model_id: name pages are keyed under; default SGLang's served model name.
        model_revision: weights identity (a commit, a digest); SGLang's page keys hash token
            ids only, so two checkpoints served under one name share keys unless this tells
            them apart.
        cache_salt: tenant salt: two deployments with different salts never share a page.
    """

    store: StoreConfig
    model_id: str | None = None
    model_revision: str = ""
    cache_salt: str | None = None

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
    ) -> BackendOptions:
        """Parse SGLang's storage extra config.

        Raises:
            ValueError: an unknown key, a bad value, or a key the backend sets itself
                (``gpu_bytes``, ``block_size``, ``hash_name``).
        """
        extra = dict(extra or {})
        environ = os.environ if environ is None else environ
        store_names = {f.name for f in fields(StoreConfig)}
        own_names = {f.name for f in fields(cls)} - {"store"}
        unknown = sorted(set(extra) - store_names - own_names - SGLANG_KEYS)
        if unknown:
            raise ValueError(
                f"unknown kvtier keys {unknown} in --hicache-storage-backend-extra-config; expected "
                f"StoreConfig fields {sorted(store_names - set(_REFUSED_STORE_KEYS))}, {sorted(own_names)} "
                f"or SGLang's {sorted(SGLANG_KEYS)}"
            )
        refused = sorted(k for k in _REFUSED_STORE_KEYS if k in extra)
        if refused:
            raise ValueError(
                f"expected no {refused} in the extra config: the SGLang backend keeps no GPU pool, "
                "uses SGLang's page size as block_size and keys pages with SHA-256"
            )
        overrides = {k: v for k, v in BACKEND_STORE_DEFAULTS.items() if ENV_PREFIX + k.upper() not in environ}
        overrides.update({k: v for k, v in extra.items() if k in store_names})
        overrides["gpu_bytes"] = 0
        overrides["hash_name"] = "sha256"
        store = StoreConfig.from_env(environ, **overrides)
        own = {k: v for k, v in extra.items() if k in own_names}
        for name in ("model_id", "cache_salt"):
            if own.get(name) is not None and (not isinstance(own[name], str) or not own[name]):
                raise ValueError(f"expected {name} to be a non-empty string, got {own[name]!r}")
        if not isinstance(own.get("model_revision", ""), str):
            raise ValueError(f"expected model_revision to be a string, got {own['model_revision']!r}")
        return cls(store=store, **own)
