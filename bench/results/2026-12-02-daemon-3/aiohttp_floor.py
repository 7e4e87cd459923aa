"""Floors of a lookup's server CPU in aiohttp 3.14 on uvloop (issue 17), one client on loopback:

    http  a bare aiohttp app (no middlewares, a fixed msgpack reply) under urllib3 POSTs of a
          32-hash lookup body (the last round's floor: bench/results/2026-12-02-daemon)
    ws    the same reply on one aiohttp ``web.WebSocketResponse`` per connection, one binary
          message each way (the client: kvtier.tiers.transport.Channel, masked frames)
    lowlevel  aiohttp's low-level server (``web.Server``: no router, no app) under urllib3

Prints requests/s, server and client CPU per request (us), 5 rounds of 3000 (argv: MODE)."""
import os
import socket
import subprocess
import sys
import time

REPLY = b"\x82\xaanum_blocks\x20\xa5media\x90"
mode = sys.argv[1]
if mode.startswith("server-"):
    import asyncio

    import uvloop
    from aiohttp import web

    kind, port = mode[7:], int(sys.argv[2])

    async def h(request):
        await request.read()
        return web.Response(body=REPLY, content_type="application/msgpack")

    async def ws_handler(request):
        ws = web.WebSocketResponse(protocols=("kvtier.v1",), compress=False)
        await ws.prepare(request)
        async for msg in ws:
            await ws.send_bytes(REPLY)
        return ws

    if kind == "lowlevel":
        async def main():
            server = web.Server(h, access_log=None)
            await asyncio.get_running_loop().create_server(server, "127.0.0.1", port)
            await asyncio.Event().wait()
        uvloop.run(main())
    else:
        app = web.Application()
        app.router.add_post("/v1/namespaces/{ns}/lookup", h)
        app.router.add_get("/v1/channel", ws_handler)
        uvloop.install()
        web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)
else:
    import urllib3

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    from kvtier.tiers.transport import Channel

    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    p = subprocess.Popen([sys.executable, __file__, "server-" + ("ws" if mode == "ws" else mode), str(port)])
    time.sleep(2)
    body = b"x" * 1200
    if mode == "ws":
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        status, _, rest = Channel.handshake(sock, f"127.0.0.1:{port}", "/v1/channel", {})
        assert status == 101, status
        channel = Channel(sock, None, rest)
        one = lambda: channel.exchange(body, 1 << 16)  # noqa: E731
    else:
        pool = urllib3.HTTPConnectionPool("127.0.0.1", port)
        def one():
            pool.urlopen("POST", "/v1/namespaces/" + "ab" * 32 + "/lookup", body=body,
                         headers={"Content-Type": "application/msgpack"}).data

    def cpu(pid):
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

    for _ in range(5):
        s0, t0, c0 = cpu(p.pid), time.perf_counter(), time.process_time()
        for _ in range(3000):
            one()
        print(f"{mode}: {3000/(time.perf_counter()-t0):.0f}/s server {(cpu(p.pid)-s0)/3000*1e6:.0f} us "
              f"client {(time.process_time()-c0)/3000*1e6:.0f} us", flush=True)
    p.terminate()
