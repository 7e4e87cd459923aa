"""How a client of the ``kvtier serve`` daemon proves its token over TCP without sending it,
and how the daemon proves it holds the token too (issue 12: "whoever binds the port while the
daemon is down receives the bearer token"). Shared by the daemon (kvtier.server.auth) and its
client (kvtier.tiers.remote); primitives only, no I/O.

Protocol (HMAC-SHA256 everywhere; ``token`` is the shared secret, never on the wire)::

    1. hello   POST /v1/auth/hello
               Authorization: KVTier-Hello key=<key id>, nonce=<client nonce>, ts=<unix s>, sig=<hex>
                   sig = HMAC(token, "kvtier-hello\\n" key "\\n" nonce "\\n" ts)
               -> 200 {"session": sid, "nonce": server nonce, "ttl_s": ...}
                  KVTier-Proof: HMAC(token, "kvtier-hello-proof\\n" nonce "\\n" sid "\\n" server nonce)
               session key  K = HMAC(token, "kvtier-session\\n" sid "\\n" nonce "\\n" server nonce)
    2. calls   Authorization: KVTier-Session id=<sid>, n=<counter>, sig=<hex>
                   sig = HMAC(K, method "\\n" path?query "\\n" n "\\n" endpoint)
               -> any status, KVTier-Proof: HMAC(K, "kvtier-response\\n" n "\\n" status)

``key id`` names a token without revealing it (a SHA-256 prefix). ``endpoint`` is the
daemon's address as the client's socket sees it (``host:port``, :func:`endpoint`): the daemon
checks it against the address the connection arrived on, so a request signed for a socket
that someone else listens on (``localhost`` resolving to ``::1`` where an impostor bound the
port, while the daemon listens on 127.0.0.1) is refused by the daemon. Sessions live in the
daemon's memory only, counters are used once: a request captured by an impostor can never be
replayed to the daemon (the impostor's session is unknown to it, a daemon restart forgets
every session). Bodies are not signed: nothing a signature was made for can reach the daemon
other than as it was sent (SHA-256 of every put body would cost ~3 ms per MiB on these
cores). A client checks ``KVTier-Proof`` on every reply before reading its body: an impostor
cannot answer (no fake hits, no blocks of its own making).

Over a Unix socket (a 0600 socket in a 0700 directory: only the daemon's user can connect)
and over https (TLS authenticates the daemon), the token goes as ``Authorization: Bearer``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re

from kvtier.checks import parse_hex, parse_uint

HELLO_PATH = "/v1/auth/hello"
HELLO = "KVTier-Hello"
SESSION = "KVTier-Session"
PROOF_HEADER = "KVTier-Proof"
KEY_ID_NBYTES = 16
NONCE_NBYTES = 16
SESSION_NBYTES = 16
SIG_NBYTES = 32
HELLO_WINDOW_S = 300
"""A hello's timestamp may be this far from the daemon's clock (it only limits replays of a
hello: a replayed hello opens a session nobody can use without the token)."""

_PARAM = re.compile(r"([a-z]+)=([0-9a-f]+)")


def key_id(token: str) -> str:
    """The public name of ``token``: 32 hex digits of SHA-256 (reveals nothing of it)."""
    return hashlib.sha256(b"kvtier key id\0" + token.encode()).hexdigest()[: 2 * KEY_ID_NBYTES]


def nonce() -> str:
    return os.urandom(NONCE_NBYTES).hex()


def _mac(key: bytes, *parts: str) -> str:
    return hmac.new(key, "\n".join(parts).encode(), hashlib.sha256).hexdigest()


def hello_signature(token: str, key: str, client_nonce: str, ts: int) -> str:
    return _mac(token.encode(), "kvtier-hello", key, client_nonce, str(ts))


def hello_proof(token: str, client_nonce: str, session: str, server_nonce: str) -> str:
    return _mac(token.encode(), "kvtier-hello-proof", client_nonce, session, server_nonce)


def session_key(token: str, session: str, client_nonce: str, server_nonce: str) -> bytes:
    return bytes.fromhex(_mac(token.encode(), "kvtier-session", session, client_nonce, server_nonce))


def request_signature(key: bytes, method: str, path_qs: str, counter: int, endpoint_: str) -> str:
    return _mac(key, method, path_qs, str(counter), endpoint_)


def response_proof(key: bytes, counter: int, status: int) -> str:
    return _mac(key, "kvtier-response", str(counter), str(status))


def equal(a: str, b: str) -> bool:
    """Constant-time comparison of two hex strings."""
    return hmac.compare_digest(a.encode(), b.encode())


def endpoint(sockaddr: object) -> str:
    """``host:port`` of a socket address (IPv6 in brackets; an IPv4-mapped IPv6 address as
    IPv4), the same on both ends of a TCP connection; ``""`` for anything else."""
    if not isinstance(sockaddr, tuple) or len(sockaddr) < 2:
        return ""
    try:
        ip = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
    except ValueError:
        return ""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    host = f"[{ip}]" if ip.version == 6 else str(ip)
    return f"{host}:{int(sockaddr[1])}"


def format_params(scheme: str, **params: object) -> str:
    return scheme + " " + ", ".join(f"{k}={v}" for k, v in params.items())


def parse_params(value: str, scheme: str, spec: dict[str, int | None]) -> dict[str, object]:
    """The parameters of ``Authorization: <scheme> k=v, ...``, strictly: exactly the keys of
    ``spec`` once each, in any order; a key whose spec is an int is lowercase hex of that many
    bytes (bytes), ``None`` an unsigned decimal (int). Raises ``ValueError``."""
    if not value.startswith(scheme + " "):
        raise ValueError(f"expected the {scheme} scheme")
    out: dict[str, object] = {}
    for part in value[len(scheme) + 1 :].split(", "):
        m = _PARAM.fullmatch(part)
        if m is None or m.group(1) not in spec or m.group(1) in out:
            raise ValueError(f"expected {scheme} parameters {sorted(spec)} as k=v, got {part[:40]!r}")
        k, v = m.groups()
        nbytes = spec[k]
        out[k] = parse_uint(v, k) if nbytes is None else parse_hex(v, nbytes, k).hex()
    if len(out) != len(spec):
        raise ValueError(f"expected {scheme} parameters {sorted(spec)}, got {sorted(out)}")
    return out


HELLO_PARAMS = {"key": KEY_ID_NBYTES, "nonce": NONCE_NBYTES, "ts": None, "sig": SIG_NBYTES}
SESSION_PARAMS = {"id": SESSION_NBYTES, "n": None, "sig": SIG_NBYTES}
