"""Attack kind 6 (issue 12): an Authorization header that is not valid UTF-8 was a 500 with a
logged traceback per request. Now any header that is not printable ASCII is a 401 like a
wrong token (kvtier.server.auth), and errors a client can repeat at will are logged once per
interval with a count (kvtier.server.errors.RateLimitedLog)."""

from __future__ import annotations

import json
import logging

import pytest

from tests.security.conftest import TOKEN_A, bearer, call, raw, register

VALUES = [b"Bearer \xff\xfe\x80", b"Bearer caf\xe9", b"\xc3\x28", b"Bearer " + "é".encode("utf-8"),
          b"Bearer tok\x7fen", b"Bearer \x00", b"KVTier-Session id=\xff, n=1, sig=00"]


@pytest.mark.parametrize("value", VALUES)
def test_an_authorization_header_that_is_not_printable_ascii_is_a_401(secure_daemon, value):
    daemon = secure_daemon()
    request = (b"GET /v1/stats HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: " + value + b"\r\n\r\n")
    status, headers, body = raw(daemon.port, request)
    assert status in (400, 401), (status, body)  # 400: a byte aiohttp refuses in any header
    if status == 401:
        assert json.loads(body)["error"] and "www-authenticate" in headers
    assert call(daemon.port, "GET", "/v1/stats", b"", bearer(TOKEN_A))[0] == 200


def test_errors_a_client_repeats_are_logged_once_per_interval(secure_daemon, caplog):
    daemon = secure_daemon()
    assert register(daemon.port, TOKEN_A) == 201
    caplog.set_level(logging.INFO)
    for _ in range(40):
        raw(daemon.port, b"GET /v1/stats HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer \xff\r\n\r\n")
        raw(daemon.port, b"GARBAGE \x00\x01 HTTP/9\r\n\r\n")
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(loud) <= 4, [r.getMessage()[:120] for r in loud]
    assert sum(1 for r in loud if r.exc_info) <= 2
