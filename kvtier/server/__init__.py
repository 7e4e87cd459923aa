"""The cache daemon (``kvtier serve``): many engine processes share one KV cache over HTTP.

Modules (the tree is the architecture)::

    wire.py      the wire format: msgpack bodies, block frames, limits (the client uses it too)
    settings.py  ServeConfig: bind address, token, limits, durability, per-namespace store config
    registry.py  one TieredStore per namespace, reopened from the data directory on start
    frames.py    streamed get (from the pool) and put (verified, then stored)
    app.py       make_app(settings): routes, typed app keys, auth and error middlewares
    openapi.py   the OpenAPI 3 description served at /openapi.json
    serve.py     serve(settings): run until SIGINT/SIGTERM

The client is :class:`kvtier.tiers.remote.RemoteTier`.
"""
