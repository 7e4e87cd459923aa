# GC pause logger for the daemon (issue 17 tail study): only in processes that run `kvtier serve`
import sys
if sys.argv[1:2] == ["serve"] or "serve" in sys.argv[:3]:
    import atexit, gc, os, signal, time
    _t = {}
    _log = []
    _g2 = []
    _t0 = time.perf_counter()
    def _cb(phase, info):
        if phase == "start":
            _t["t"] = time.perf_counter()
        else:
            _log.append((info["generation"], time.perf_counter() - _t.get("t", time.perf_counter())))
            if info["generation"] == 2:
                _g2.append((time.perf_counter() - _t0, _log[-1][1]))
    gc.callbacks.append(_cb)
    def _dump():
        out = os.environ.get("GCLOG_OUT", "/tmp/daemon4/gclog/out.txt")
        with open(out, "a") as f:
            for g in (0, 1, 2):
                xs = sorted(d for gen, d in _log if gen == g)
                if xs:
                    f.write(f"pid {os.getpid()} gen{g}: n={len(xs)} max {xs[-1]*1e3:.2f} ms p99 {xs[int(0.99*(len(xs)-1))]*1e3:.2f} ms total {sum(xs)*1e3:.1f} ms\n")
            f.write(f"pid {os.getpid()} gen2 at (s since start, ms): " + ", ".join(f"{a:.1f}: {b*1e3:.0f}" for a, b in _g2) + "\n")
            f.write(f"pid {os.getpid()} frozen {gc.get_freeze_count()} objects, tracked {len(gc.get_objects())}\n")
    atexit.register(_dump)
