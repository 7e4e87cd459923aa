"""OpenAPI 3 description of the daemon's API (served at ``/openapi.json``). Limits in it are
the running daemon's (``--max-batch-blocks``, ``--max-block-bytes``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from kvtier import __version__
from kvtier.wire import FRAMES, MSGPACK
from kvtier.types import DTYPES_BY_NAME

if TYPE_CHECKING:
    from kvtier.server.settings import ServeConfig

_FRAMES_DOC = (
    "A stream of frames, then one 0x00 byte: frame = hash_len u8 (16 or 32) | block_hash | block record "
    "(128-byte header: magic 'KVTB', version u16 (2), dtype code u8, ndim u8, shape 8 x u32, namespace 32 B, "
    "token fingerprint 32 B, payload_nbytes u64, seq u64, xxh3-64 checksum u64 over the header before it and "
    "the payload; then payload_nbytes raw bytes). All integers little-endian. A get sends each block with the "
    "fingerprint it was put with; the client checks it against its own tokens."
)



_GROUP_FIELDS = {
    "kind": {"type": "string", "enum": ["full", "sliding", "chunked", "mla"]},
    "layers": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    "num_kv_heads": {"type": "integer", "minimum": 1},
    "k_head_dim": {"type": "integer", "minimum": 1},
    "v_head_dim": {"type": "integer", "minimum": 1},
    "window": {"type": ["integer", "null"], "minimum": 1, "description": "sliding window or chunk, tokens"},
}

def _error(description: str) -> dict:
    return {
        "description": description,
        "content": {"application/json": {"schema": {
            "type": "object", "required": ["error"], "properties": {"error": {"type": "string"}},
        }}},
    }


def _msgpack(schema: dict, description: str = "") -> dict:
    return {"description": description or "msgpack map", "content": {MSGPACK: {"schema": schema}}}


def openapi(settings: "ServeConfig", extra: Mapping[str, dict] | None = None, routes: Iterable[Any] = ()) -> dict:
    """The description as a JSON-ready dict: the daemon's own routes, then ``extra`` path
    items (routes other modules added, kvtier.server.app.OPENAPI_PATHS), then a minimal
    entry for any other route among ``routes`` (aiohttp route objects)."""
    doc = _core(settings)
    paths = doc["paths"]
    for path, item in (extra or {}).items():
        paths.setdefault(path, {}).update(item)
    for route in routes:
        method, path = route.method.lower(), route.resource.canonical if route.resource is not None else None
        if path is None or method == "head" or method in paths.get(path, {}):
            continue
        item = paths.setdefault(path, {})
        params = [p.strip("{}") for p in path.split("/") if p.startswith("{")]
        if params:
            item.setdefault("parameters", [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
                                           for p in params])
        item[method] = {"summary": f"{method.upper()} {path}", "responses": {
            "200": {"description": "OK"}, "401": _error("missing or wrong bearer token")}}
    return doc


def _core(settings: "ServeConfig") -> dict:
    max_blocks = settings.max_batch_blocks
    block_hash = {"type": "string", "format": "binary", "minLength": 16, "maxLength": 32,
                  "description": "msgpack bin of 16 (xxh3-128) or 32 (SHA-256) bytes"}
    hashes = {"type": "object", "required": ["block_hashes"], "properties": {
        "block_hashes": {"type": "array", "items": block_hash, "maxItems": max_blocks},
    }}
    spec = {"type": "object", "required": ["block_shape", "dtype"], "properties": {
        "block_shape": {"type": "array", "minItems": 1, "maxItems": 5,
                        "items": {"type": "integer", "minimum": 1, "maximum": 2**31 - 1},
                        "description": "[num_layers, 2, block_size, num_kv_heads, head_dim]; with groups, "
                                       "the spec's own ([block_numel] for a flat layout)"},
        "dtype": {"type": "string", "enum": sorted(DTYPES_BY_NAME)},
        "block_size": {"type": "integer", "minimum": 1, "description": "tokens per block (with groups)"},
        "groups": {"type": "array", "minItems": 1, "description": "layer groups (kvtier.types.LayerGroup)",
                   "items": {"type": "object", "required": list(_GROUP_FIELDS), "properties": _GROUP_FIELDS}},
    }}
    described = {"type": "object", "properties": {
        **spec["properties"], "namespace": {"type": "string"}, "max_batch_blocks": {"type": "integer"},
        "max_block_bytes": {"type": "integer"}, "durable": {"type": "boolean"}, "created": {"type": "boolean"},
        "channel": {"type": "string", "description": "path of the WebSocket lookup channel (kvtier.server.channel)"},
        "usage": {"type": "object", "description": "per tier: blocks, used_bytes, capacity_bytes"},
    }}
    common = {
        "400": _error("malformed body, namespace or hash"),
        "401": _error("missing or wrong token or signature"),
        "403": _error("a namespace the token file does not give the tenant, or a cross-origin call"),
        "404": _error("unknown namespace"),
        "415": _error("a body of another media type than the route takes"),
    }
    admin = {"401": _error("missing or wrong token"), "403": _error("not an admin token")}
    too_large = {"413": _error(f"over --max-batch-blocks ({max_blocks}) or --max-block-bytes "
                               f"({settings.max_block_bytes}), or a body over the size limit")}
    ns_param = {"name": "ns", "in": "path", "required": True,
                "description": "32-byte namespace as 64 lowercase hex digits (no other spelling)",
                "schema": {"type": "string", "pattern": "^[0-9a-f]{64}$"}}
    tenant_param = {"name": "tenant", "in": "path", "required": True, "description": "a tenant of the token file",
                    "schema": {"type": "string", "pattern": "^[a-z0-9][a-z0-9_-]{0,31}$"}}
    reply = lambda key: _msgpack({"type": "object", "properties": {key: {"type": "boolean"}}})  # noqa: E731
    emptied = _msgpack({"type": "object", "properties": {"reset": {"type": "boolean"}, "blocks": {
        "type": "integer", "minimum": 0, "description": "distinct blocks it held when the reset began"}}})
    return {
        "openapi": "3.0.3",
        "info": {"title": "kvtier cache daemon", "version": __version__,
                 "description": "Shared KV-cache blocks by namespace and block hash (kvtier serve)."},
        "components": {"securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer"},
            "session": {"type": "apiKey", "in": "header", "name": "Authorization", "description": (
                "KVTier-Session id=.., n=.., sig=.. after POST /v1/auth/hello: the token never travels "
                "(kvtier.auth); every reply carries KVTier-Proof")},
        }},
        "security": [{"bearer": []}, {"session": []}] if settings.token or settings.token_file else [],
        "paths": {
            "/healthz": {"get": {
                "summary": "Liveness", "security": [],
                "responses": {"200": {"description": "serving", "content": {"application/json": {"schema": {
                    "type": "object", "properties": {"status": {"type": "string"}, "namespaces": {"type": "integer"}},
                }}}}},
            }},
            "/openapi.json": {"get": {
                "summary": "This description", "security": [],
                "responses": {"200": {"description": "OpenAPI 3 document",
                                      "content": {"application/json": {"schema": {"type": "object"}}}}},
            }},
            "/v1/auth/hello": {"post": {
                "summary": "Open a signed session (Authorization: KVTier-Hello key=.., nonce=.., ts=.., sig=..)",
                "security": [],
                "responses": {"200": _msgpack({"type": "object", "properties": {
                    "session": {"type": "string"}, "nonce": {"type": "string"}, "ttl_s": {"type": "number"}}}),
                    "401": _error("unknown key or wrong signature")},
            }},
            "/v1/namespaces/{ns}": {
                "parameters": [ns_param],
                "put": {
                    "summary": "Register a namespace's block shape and dtype (idempotent)",
                    "requestBody": {"required": True, "content": {MSGPACK: {"schema": spec}}},
                    "responses": {
                        "200": _msgpack(described, "already registered with this spec"),
                        "201": _msgpack(described, "registered"),
                        **common, "409": _error("registered with another spec"), **too_large,
                        "507": _error("--max-namespaces reached"),
                    },
                },
                "get": {"summary": "Spec, limits and per-tier usage",
                        "responses": {"200": _msgpack(described), **common}},
                "delete": {"summary": "Drop the namespace and all its blocks (admin token)",
                           "responses": {"200": reply("deleted"), **common}},
            },
            "/v1/namespaces/{ns}/reset": {"parameters": [ns_param], "post": {
                "summary": "Empty the namespace, every tier; it stays registered (admin token)",
                "responses": {"200": emptied, **common}}},
            "/v1/admin/namespaces": {"get": {
                "summary": "Every tenant's namespaces: tenant, namespace, label, spec, usage (admin token)",
                "responses": {"200": _msgpack({"type": "object"}), **admin}}},
            "/v1/admin/reset": {"post": {
                "summary": "Empty every namespace of every tenant (admin token)",
                "responses": {"200": _msgpack({"type": "object", "properties": {"reset": {"type": "integer"},
                                                                                 "blocks": {"type": "integer"}}}),
                              **admin}}},
            "/v1/admin/tenants/{tenant}/namespaces/{ns}": {"parameters": [tenant_param, ns_param], "delete": {
                "summary": "Drop a tenant's namespace and all its blocks (admin token)",
                "responses": {"200": reply("deleted"), **admin, "404": _error("no such namespace")}}},
            "/v1/admin/tenants/{tenant}/namespaces/{ns}/reset": {"parameters": [tenant_param, ns_param], "post": {
                "summary": "Empty a tenant's namespace (admin token)",
                "responses": {"200": emptied, **admin, "404": _error("no such namespace")}}},
            "/v1/namespaces/{ns}/lookup": {"parameters": [ns_param], "post": {
                "summary": "Leading blocks present and where",
                "requestBody": {"required": True, "content": {MSGPACK: {"schema": hashes}}},
                "responses": {"200": _msgpack({"type": "object", "properties": {
                    "num_blocks": {"type": "integer", "minimum": 0},
                    "media": {"type": "array", "items": {"type": "string", "enum": ["GPU", "CPU", "DISK"]}},
                }}), **common, **too_large},
            }},
            "/v1/namespaces/{ns}/get": {"parameters": [ns_param], "post": {
                "summary": "The leading present blocks, streamed as frames",
                "requestBody": {"required": True, "content": {MSGPACK: {"schema": hashes}}},
                "responses": {"200": {"description": _FRAMES_DOC, "content": {FRAMES: {"schema": {
                    "type": "string", "format": "binary"}}}}, **common, **too_large},
            }},
            "/v1/namespaces/{ns}/put": {"parameters": [ns_param], "post": {
                "summary": "Store blocks sent as frames; each is verified first",
                "requestBody": {"required": True, "description": _FRAMES_DOC,
                                "content": {FRAMES: {"schema": {"type": "string", "format": "binary"}}}},
                "responses": {"200": _msgpack({"type": "object", "properties": {"stored": {
                    "type": "array", "items": {"type": "boolean"},
                    "description": "per frame: acknowledged as stored (with --durable: committed to DISK)"}}}),
                    **common, **too_large},
            }},
        },
    }
