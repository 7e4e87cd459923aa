"""Who may call the daemon: tokens, the tenant each belongs to, and what a tenant may do.

Three modes (:class:`Tenants`):

- **open** (no token): every caller is tenant ``default`` with admin rights. For a Unix
  socket (only the daemon's user can connect) or a loopback port on a single-user host.
- **one token** (``--token`` / ``KVTIER_TOKEN``): its holders are tenant ``default``, admin:
  one trust domain, as before tenancy existed.
- **token file** (``--token-file PATH``, TOML or JSON, readable by its owner only)::

      [tenants.ops]                  # a tenant name: [a-z0-9][a-z0-9_-]{0,31}
      admin = true                   # its tokens may also delete, reset, see every tenant
      tokens = ["<16-1024 printable ASCII characters>"]

      [tenants.team-a]
      tokens = ["...", "..."]        # several tokens per tenant (rotation)
      namespaces = ["<64 hex>"]      # optional: only these; default any it registers
      max_namespaces = 2             # optional cap of its own (the daemon's cap still applies)
      [tenants.team-a.names]         # optional display names in metrics and stats
      "<64 hex>" = "llama-3-8b"

  (JSON: ``{"tenants": {"ops": {"admin": true, "tokens": [...]}, ...}}``.) Unknown keys,
  duplicate tokens, names outside ``namespaces``: refused at start-up with the reason.

A tenant's blocks live in its own stores (kvtier.server.registry keys them by tenant and
namespace): two tenants that register the same namespace never share a block.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.auth import key_id
from kvtier.checks import check_token, parse_display_name, parse_namespace, parse_tenant

DEFAULT_TENANT = "default"
MIN_FILE_TOKEN_LENGTH = 16


@dataclass(frozen=True)
class Tenant:
    """One tenant of the daemon.

    Attributes:
        name: ``[a-z0-9][a-z0-9_-]{0,31}``; names its directory under ``<data_dir>/tenants``.
        admin: its callers may delete and reset namespaces and see every tenant's figures.
        namespaces: the namespaces it may use, or ``None`` for any it registers.
        names: display names of its namespaces (metrics labels), by namespace.
        max_namespaces: the most namespaces it may hold at once, or ``None``.
    """

    name: str
    admin: bool = False
    namespaces: frozenset[bytes] | None = None
    names: Mapping[bytes, str] = field(default_factory=dict)
    max_namespaces: int | None = None

    def allows(self, namespace: bytes) -> bool:
        return self.namespaces is None or namespace in self.namespaces


@dataclass(frozen=True)
class Caller:
    """The authenticated caller of a request (``request[CALLER]``)."""

    tenant: Tenant

    @property
    def admin(self) -> bool:
        return self.tenant.admin


class Tenants:
    """Tokens -> tenants. ``open``: no token configured, every caller is :attr:`default`."""

    def __init__(self, tenants: list[Tenant], tokens: Mapping[str, str]) -> None:
        self.tenants = {t.name: t for t in tenants}
        self.open = not tokens
        self._by_digest = {_digest(tok): self.tenants[name] for tok, name in tokens.items()}
        self._by_key = {key_id(tok): (tok, self.tenants[name]) for tok, name in tokens.items()}

    @property
    def default(self) -> Tenant:
        return self.tenants[DEFAULT_TENANT]

    @classmethod
    def single(cls, token: str | None) -> "Tenants":
        """Open (``token`` None) or one admin token, both as tenant ``default``."""
        tokens = {} if token is None else {check_token(token): DEFAULT_TENANT}
        return cls([Tenant(DEFAULT_TENANT, admin=True)], tokens)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Tenants":
        """Parse a token file; raises ``ValueError`` naming the file and what is wrong."""
        path = Path(path)
        try:
            st = path.stat()
            if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise ValueError(f"expected a token file readable by its owner only (chmod 600), got mode "
                                 f"{stat.S_IMODE(st.st_mode):o}")
            return cls.parse(_read(path))
        except (OSError, ValueError) as exc:
            raise ValueError(f"token file {path}: {exc}") from None

    @classmethod
    def parse(cls, doc: Any) -> "Tenants":
        """From the parsed document (see the module docstring)."""
        _keys(doc, {"tenants"}, "the document")
        entries = doc.get("tenants")
        if not isinstance(entries, dict) or not entries:
            raise ValueError("expected a non-empty [tenants] table")
        tenants, tokens = [], {}
        for name, entry in entries.items():
            tenant, own = _tenant(name, entry)
            tenants.append(tenant)
            for tok in own:
                if tok in tokens:
                    raise ValueError(f"tenant {name}: a token is also one of tenant {tokens[tok]}'s")
                tokens[tok] = name
        return cls(tenants, tokens)

    def bearer(self, token: str) -> Tenant | None:
        """The tenant of a bearer token (a dict lookup by its SHA-256: no timing leak)."""
        return self._by_digest.get(_digest(token))

    def key(self, key: str) -> tuple[str, Tenant] | None:
        """``(token, tenant)`` of a key id (:func:`kvtier.auth.key_id`)."""
        return self._by_key.get(key)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _read(path: Path) -> Any:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" or text.lstrip().startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"expected JSON ({exc})") from None
    try:
        import tomllib
    except ImportError:  # Python 3.10
        raise ValueError("expected a JSON token file (TOML needs Python 3.11)") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"expected TOML ({exc})") from None


def _keys(obj: Any, allowed: set[str], what: str) -> None:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a table for {what}, got {type(obj).__name__}")
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {what}; expected {sorted(allowed)}")


def _tenant(name: Any, entry: Any) -> tuple[Tenant, list[str]]:
    name = parse_tenant(name)
    what = f"tenant {name}"
    _keys(entry, {"admin", "tokens", "namespaces", "max_namespaces", "names"}, what)
    admin = entry.get("admin", False)
    if not isinstance(admin, bool):
        raise ValueError(f"{what}: expected admin = true or false, got {admin!r}")
    tokens = entry.get("tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ValueError(f"{what}: expected tokens = [one or more tokens]")
    tokens = [check_token(t, MIN_FILE_TOKEN_LENGTH) for t in tokens]
    namespaces = entry.get("namespaces")
    if namespaces is not None:
        if not isinstance(namespaces, list):
            raise ValueError(f"{what}: expected namespaces = [64 hex digits, ...]")
        namespaces = frozenset(parse_namespace(n) for n in namespaces)
    limit = entry.get("max_namespaces")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0):
        raise ValueError(f"{what}: expected max_namespaces > 0, got {limit!r}")
    names = {}
    for ns, display in (entry.get("names") or {}).items():
        namespace = parse_namespace(ns)
        if namespaces is not None and namespace not in namespaces:
            raise ValueError(f"{what}: a display name for namespace {ns}, which is not in its namespaces")
        names[namespace] = parse_display_name(display)
    if len(set(names.values())) != len(names):
        raise ValueError(f"{what}: expected distinct display names")
    return Tenant(name, admin, namespaces, names, limit), tokens
