"""The token file (kvtier.server.tenants): strict, refused with the reason at start-up."""

from __future__ import annotations

import json
import os

import pytest

from kvtier.auth import key_id
from kvtier.server.tenants import Tenants

A = "a-token-0123456789abcdef"
NS = "00" * 32


def _write(path, text: str, mode: int = 0o600):
    path.write_text(text)
    os.chmod(path, mode)
    return path


def test_toml_and_json_say_the_same(tmp_path):
    toml = _write(tmp_path / "t.toml", f'''
[tenants.ops]
admin = true
tokens = ["{A}x"]

[tenants.a]
tokens = ["{A}"]
namespaces = ["{NS}"]
max_namespaces = 2
names = {{ "{NS}" = "llama-8b" }}
''')
    doc = {"tenants": {"ops": {"admin": True, "tokens": [A + "x"]},
                       "a": {"tokens": [A], "namespaces": [NS], "max_namespaces": 2, "names": {NS: "llama-8b"}}}}
    for path in (toml, _write(tmp_path / "t.json", json.dumps(doc))):
        tenants = Tenants.load(path)
        a = tenants.bearer(A)
        assert a.name == "a" and not a.admin and a.max_namespaces == 2
        assert a.namespaces == {bytes(32)} and a.names == {bytes(32): "llama-8b"}
        assert tenants.bearer(A + "x").admin and tenants.bearer("nope") is None
        assert tenants.key(key_id(A)) == (A, a) and not tenants.open


@pytest.mark.parametrize("doc,message", [
    ({}, "non-empty \\[tenants\\]"),
    ({"tenants": {"a": {"tokens": [A]}}, "extra": 1}, "unknown key"),
    ({"tenants": {"a": {"tokens": [A], "admn": True}}}, "unknown key"),
    ({"tenants": {"A": {"tokens": [A]}}}, "tenant name"),
    ({"tenants": {"a": {"tokens": []}}}, "tokens = "),
    ({"tenants": {"a": {"tokens": ["short"]}}}, "token of 16-1024"),
    ({"tenants": {"a": {"tokens": [A + " x"]}}}, "token of 16-1024"),
    ({"tenants": {"a": {"tokens": [A]}, "b": {"tokens": [A]}}}, "also one of tenant"),
    ({"tenants": {"a": {"tokens": [A], "admin": "yes"}}}, "admin = true or false"),
    ({"tenants": {"a": {"tokens": [A], "namespaces": ["AB" * 32]}}}, "64 lowercase hex"),
    ({"tenants": {"a": {"tokens": [A], "max_namespaces": 0}}}, "max_namespaces > 0"),
    ({"tenants": {"a": {"tokens": [A], "namespaces": [NS], "names": {"11" * 32: "x"}}}}, "not in its namespaces"),
    ({"tenants": {"a": {"tokens": [A], "names": {NS: "a b"}}}}, "display name"),
])
def test_a_bad_token_file_is_refused_with_the_reason(tmp_path, doc, message):
    with pytest.raises(ValueError, match=message):
        Tenants.load(_write(tmp_path / "t.json", json.dumps(doc)))


def test_a_token_file_others_may_read_is_refused(tmp_path):
    path = _write(tmp_path / "t.json", json.dumps({"tenants": {"a": {"tokens": [A]}}}), mode=0o644)
    with pytest.raises(ValueError, match="readable by its owner only"):
        Tenants.load(path)


def test_one_token_is_the_admin_of_tenant_default_and_none_is_open():
    one = Tenants.single("secret")
    assert one.bearer("secret").admin and one.bearer("secret").name == "default" and not one.open
    assert Tenants.single(None).open
