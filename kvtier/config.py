"""One configuration dataclass for the store, validated once; environment variables and CLI
flags map onto its fields one to one (``gpu_bytes`` <-> ``KVTIER_GPU_BYTES`` <-> ``--gpu-bytes``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, Mapping, get_args

# Kept free of torch and of kvtier.hashing (numpy, msgpack): `kvtier --help` builds its flags
# from this module. tests/unit/test_config.py checks HashName against kvtier.hashing.HASH_NAMES.
HashName = Literal["sha256", "xxh3_128"]
HASH_NAMES: tuple[str, ...] = get_args(HashName)
WritePolicy = Literal["write_back", "write_through"]
ENV_PREFIX = "KVTIER_"

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40,
}


def parse_bytes(value: str | int) -> int:
    """``"512MiB"`` -> 536870912; ints pass through. Raises ``ValueError`` on anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"expected a byte size >= 0, got {value}")
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"expected a byte size like 4096, 512MiB or 2GB, got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def default_data_dir() -> Path:
    """Per-user cache directory: ``$XDG_CACHE_HOME/kvtier`` or ``~/.cache/kvtier``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvtier"


@dataclass(frozen=True)
class StoreConfig:
    """Capacities in bytes and the store's policies. A capacity of 0 disables that tier."""

    gpu_bytes: int = 1 << 30
    """GPU paged pool size, bytes. Without a CUDA device there is no GPU pool: these bytes
    join the CPU pool, which is then the top pool."""
    cpu_bytes: int = 4 << 30
    """CPU slab size, bytes (pinned when CUDA is available)."""
    disk_bytes: int = 16 << 30
    """LMDB size cap, bytes (headers and page rounding included)."""
    block_size: int = 16
    """Tokens per block."""
    hash_name: HashName = "sha256"
    """Block hash function (see kvtier.hashing)."""
    write_policy: WritePolicy = "write_back"
    """``write_back``: a block goes down a tier only when evicted (spill). ``write_through``:
    every stored block is also written to every lower tier at once."""
    data_dir: Path = field(default_factory=default_data_dir)
    """Directory of the DISK tier's LMDB environment."""
    num_io_threads: int = 2
    """Threads for DISK reads and writes (a tuning knob: never part of a key)."""
    flush_on_close: bool = True
    """On close, write every block that is only in GPU/CPU memory down to DISK, so that the
    next process finds it (persistence across restarts)."""
    remote_url: str | None = None
    """Shared REMOTE tier below DISK: ``http://host:port`` (a ``kvtier serve`` daemon),
    ``redis://host:port/db`` (Redis) or ``redis+cluster://host:port`` (Redis Cluster);
    ``None``: no REMOTE tier. Stored blocks are written to it in the background."""
    remote_token: str | None = None
    """Bearer token for the daemon (``KVTIER_REMOTE_TOKEN``); Redis takes its password from
    the URL."""
    remote_timeout_s: float = 2.0
    """Seconds before a REMOTE call gives up; a timed-out read is a miss, never an error."""
    trace_path: Path | None = None
    """Opt-in: append every counted lookup, load and store (block hashes only, no token ids)
    to this JSONL file, for ``kvtier replay`` (kvtier.store.trace). ``None``: no trace."""

    def __post_init__(self) -> None:
        for name in ("gpu_bytes", "cpu_bytes", "disk_bytes"):
            object.__setattr__(self, name, parse_bytes(getattr(self, name)))
        for name in ("block_size", "num_io_threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"expected {name} > 0, got {value!r}")
        if self.hash_name not in HASH_NAMES:
            raise ValueError(f"expected hash_name in {HASH_NAMES}, got {self.hash_name!r}")
        if self.write_policy not in get_args(WritePolicy):
            raise ValueError(f"expected write_policy in {get_args(WritePolicy)}, got {self.write_policy!r}")
        object.__setattr__(self, "data_dir", Path(self.data_dir).expanduser())
        if self.trace_path is not None:
            object.__setattr__(self, "trace_path", Path(self.trace_path).expanduser())
        if self.remote_url is not None and not re.match(r"^(https?|redis|rediss|redis\+cluster)://[^/\s]+", str(self.remote_url)):
            raise ValueError(f"expected remote_url like http://127.0.0.1:8765 or redis://127.0.0.1:6379/0, got {self.remote_url!r}")
        timeout = self.remote_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
            raise ValueError(f"expected 0 < remote_timeout_s <= 3600 (seconds), got {timeout!r}")
        if self.gpu_bytes == 0 and self.cpu_bytes == 0:
            raise ValueError("expected gpu_bytes or cpu_bytes > 0 (loads land in a memory pool), got both 0")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "StoreConfig":
        """Defaults, then ``KVTIER_<FIELD>`` environment variables, then ``overrides``
        (``None`` values in overrides are ignored, so unset CLI flags fall through)."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                values[f.name] = _coerce(f.name, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def with_(self, **changes: Any) -> "StoreConfig":
        return replace(self, **changes)


def _coerce(name: str, raw: str) -> Any:
    if name.endswith("_bytes"):
        return parse_bytes(raw)
    if name in ("block_size", "num_io_threads"):
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"expected an int for {ENV_PREFIX}{name.upper()}, got {raw!r}") from None
    if name == "remote_timeout_s":
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"expected seconds for {ENV_PREFIX}{name.upper()}, got {raw!r}") from None
    if name == "flush_on_close":
        value = raw.strip().lower()
        if value in ("1", "true", "yes", "on"):
            return True
        if value in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected {ENV_PREFIX}FLUSH_ON_CLOSE to be true/false, got {raw!r}")
    return raw


def config_options(func):
    """Click decorator: one ``--gpu-bytes``-style option per ``StoreConfig`` field; the
    command receives them as keyword arguments (``None`` when not given)."""
    import click

    for f in reversed(fields(StoreConfig)):
        flag = "--" + f.name.replace("_", "-")
        help_text = f"StoreConfig.{f.name} (env {ENV_PREFIX}{f.name.upper()})"
        if f.name == "flush_on_close":
            func = click.option(flag + "/--no-" + flag[2:], default=None, help=help_text)(func)
        elif f.name in ("hash_name", "write_policy"):
            choices = HASH_NAMES if f.name == "hash_name" else get_args(WritePolicy)
            func = click.option(flag, type=click.Choice(choices), default=None, help=help_text)(func)
        elif f.name in ("block_size", "num_io_threads"):
            func = click.option(flag, type=int, default=None, help=help_text)(func)
        elif f.name == "remote_timeout_s":
            func = click.option(flag, type=float, default=None, help=help_text)(func)
        else:
            func = click.option(flag, default=None, help=help_text)(func)
    return func


def config_from_cli(options: Mapping[str, Any]) -> StoreConfig:
    """Build the config from click keyword arguments produced by :func:`config_options`."""
    names = {f.name for f in fields(StoreConfig)}
    return StoreConfig.from_env(**{k: v for k, v in options.items() if k in names})
