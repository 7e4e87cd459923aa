"""The floor: a bare aiohttp app on uvloop (no middlewares, a fixed msgpack reply) under the same 1-client urllib3 POSTs: server and client CPU per request (argv: client)."""
import asyncio, os, sys, time, subprocess, socket
import urllib3
mode = sys.argv[1]
if mode == "server":
    import uvloop
    from aiohttp import web
    async def h(request):
        await request.read()
        return web.Response(body=b"\x82\xaanum_blocks\x20\xa5media\x90", content_type="application/msgpack")
    app = web.Application()
    app.router.add_post("/v1/namespaces/{ns}/lookup", h)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[2]), access_log=None, print=None)
else:
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    p = subprocess.Popen([sys.executable, __file__, "server", str(port)])
    time.sleep(2)
    pool = urllib3.HTTPConnectionPool("127.0.0.1", port)
    body = b"x" * 1200
    def cpu(pid):
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split(); return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    for _ in range(5):
        s0, t0, c0 = cpu(p.pid), time.perf_counter(), time.process_time()
        for _ in range(3000):
            r = pool.urlopen("POST", "/v1/namespaces/" + "ab" * 32 + "/lookup", body=body, headers={"Content-Type": "application/msgpack"})
            r.data
        print(f"{3000/(time.perf_counter()-t0):.0f}/s server {(cpu(p.pid)-s0)/3000*1e6:.0f} us client {(time.process_time()-c0)/3000*1e6:.0f} us")
    p.terminate()
