"""Connector options from ``kv_connector_extra_config`` (one flat dict, validated once).

Every :class:`~kvtier.config.StoreConfig` field is accepted under its own name (``cpu_bytes``,
``disk_bytes``, ``data_dir``, ``remote_url``, ...; byte sizes as ints or strings like
``"4GiB"``), on top of ``KVTIER_*`` environment variables, plus the connector's own keys
(:class:`ConnectorOptions`). Two store defaults differ from ``StoreConfig``'s for a vLLM
engine: ``gpu_bytes=0`` (vLLM's own paged cache is the top tier; kvtier's loads land in its
CPU pool) and ``write_policy="write_through"`` (a served engine is often stopped with a signal,
so a block goes to DISK as soon as it is stored rather than at a clean shutdown).
``block_size`` is vLLM's; giving another one is an error.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvtier.config import ENV_PREFIX, StoreConfig, parse_bytes

DEFAULT_STAGING_BYTES = 256 << 20

CONNECTOR_STORE_DEFAULTS: dict[str, Any] = {"gpu_bytes": 0, "write_policy": "write_through"}


@dataclass(frozen=True)
class ConnectorOptions:
    """What the connector runs with.

    Attributes:
        store: the store's capacities and policies (``block_size`` = vLLM's).
        model_id: name blocks are keyed under; default vLLM's served model name.
        model_revision: weights identity; default a fingerprint of the model directory
            (:func:`kvtier.connectors.vllm.keys.model_revision_for`).
        match_wait_s: seconds a lookup waits for DISK/REMOTE reads before answering "not
            yet" (vLLM then retries the request next step while it serves others).
        lookup_timeout_s: seconds the scheduler waits for a worker's answer before it
            counts the lookup as a miss.
        staging_bytes: device memory for the two staging buffers between the CPU pool and
            vLLM's GPU caches (CUDA only; out of what ``gpu_memory_utilization`` leaves free;
            :mod:`kvtier.connectors.vllm.copies`). At least one block per buffer.
    """

    store: StoreConfig
    model_id: str | None = None
    model_revision: str | None = None
    match_wait_s: float = 0.05
    lookup_timeout_s: float = 10.0
    staging_bytes: int = DEFAULT_STAGING_BYTES

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, block_size: int, environ: Mapping[str, str] | None = None
    ) -> ConnectorOptions:
        """Parse ``kv_connector_extra_config``.

        Raises:
            ValueError: an unknown key, a bad value, or a ``block_size`` other than vLLM's.
        """
        extra = dict(extra or {})
        environ = os.environ if environ is None else environ
        store_names = {f.name for f in fields(StoreConfig)}
        own_names = {f.name for f in fields(cls)} - {"store"}
        unknown = sorted(set(extra) - store_names - own_names)
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config keys {unknown}; expected StoreConfig fields "
                f"{sorted(store_names)} or {sorted(own_names)}"
            )
        if "block_size" in extra and extra["block_size"] != block_size:
            raise ValueError(
                f"expected kvtier block_size == vLLM's block_size ({block_size}), got {extra['block_size']!r}"
            )
        overrides = {k: v for k, v in CONNECTOR_STORE_DEFAULTS.items() if ENV_PREFIX + k.upper() not in environ}
        overrides.update({k: v for k, v in extra.items() if k in store_names})
        overrides["block_size"] = block_size
        store = StoreConfig.from_env(environ, **overrides)
        own = {k: v for k, v in extra.items() if k in own_names}
        for name in ("match_wait_s", "lookup_timeout_s"):
            value = own.get(name, getattr(cls, name))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 3600:
                raise ValueError(f"expected 0 <= {name} <= 3600 (seconds), got {value!r}")
        if "staging_bytes" in own:
            try:
                own["staging_bytes"] = parse_bytes(own["staging_bytes"])
            except (TypeError, ValueError) as exc:
                raise ValueError(f"expected staging_bytes as a byte size (e.g. '256MiB'), got {own['staging_bytes']!r}") from exc
            if not 0 < own["staging_bytes"] <= 1 << 40:
                raise ValueError(f"expected 0 < staging_bytes <= 1 TiB, got {own['staging_bytes']!r}")
        for name in ("model_id", "model_revision"):
            if own.get(name) is not None and (not isinstance(own[name], str) or not own[name]):
                raise ValueError(f"expected {name} to be a non-empty string, got {own[name]!r}")
        return cls(store=store, **own)
