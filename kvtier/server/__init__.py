"""The cache daemon (``kvtier serve``): many engine processes share one KV cache over HTTP.

Modules (the tree is the architecture)::

    settings.py  ServeConfig: bind address, token, limits, durability, per-namespace store config
    registry.py  one TieredStore per namespace, reopened from the data directory on start
    frames.py    streamed get (from the pool) and put (verified, then stored)
    streams.py   their socket-level reads and writes (no copies where the loop allows)
    loop.py      the event loop: uvloop when installed, asyncio's otherwise
    errors.py    HTTP errors as JSON {"error": message}, and the middleware that makes them so
    app.py       make_app(settings): routes, typed app keys, the auth middleware, the dashboard
    openapi.py   the OpenAPI 3 description served at /openapi.json
    serve.py     serve(settings): run until SIGINT/SIGTERM

The wire format is kvtier.wire (msgpack bodies, block frames, the KVSpec encoding) over
kvtier.records; namespaces and block hashes are checked by kvtier.checks. Both sit below
the tiers, so the client, :class:`kvtier.tiers.remote.RemoteTier`, never imports this package.
"""
