"""Profile ``kvtier serve`` under load with py-spy (issue 17, item 1): one phase of lookups
(``--clients`` threads of one RemoteTier, 32 present hashes each), one of batch puts
(16 x 2 MiB a call), one of batch gets; py-spy samples the daemon process (all threads,
only the thread holding the GIL: its Python CPU work) during each and writes ``<out>/<phase>.svg`` (flame graph) and
``<out>/<phase>.txt`` (the top frames by own and by total samples).

    flock -s /tmp/kvtier-cpu.lock .venv/bin/python bench/results/2026-12-01-perf/profile_daemon.py \
        --out bench/results/2026-12-01-perf/profile-before

Needs py-spy (``pip install py-spy``) and the right to ptrace the daemon (root, or
``kernel.yama.ptrace_scope=0``).
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

from bench.server import NAMESPACE, SPEC, make_client, start_daemon, stop  # noqa: E402
from kvtier.types import BlockHash  # noqa: E402


def record(pid: int, out: Path, seconds: float, fmt: str) -> subprocess.Popen:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return subprocess.Popen([py_spy, "record", "--pid", str(pid), "--rate", "250", "--duration", str(int(seconds)),
                             "--format", fmt, "--output", str(out), "--nonblocking", "--gil", "--threads"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def summarize(raw: Path, txt: Path, top: int = 40) -> None:
    """Own and total samples per frame (function + file:line stripped to file) of a collapsed stack file."""
    own: collections.Counter = collections.Counter()
    total: collections.Counter = collections.Counter()
    roots: collections.Counter = collections.Counter()
    n = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        c = int(count)
        n += c
        frames = [f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0].rsplit("/", 1)[-1] + ")" if " (" in f else f
                  for f in stack.split(";")]
        own[frames[-1]] += c
        roots[" > ".join(frames[:3])] += c
        for f in set(frames):
            total[f] += c
    lines = [f"{n} samples (250 Hz, the thread holding the GIL: Python CPU work, not syscalls or waits)", "", "own samples:"]
    lines += [f"{100 * c / n:6.1f}%  {f}" for f, c in own.most_common(top)]
    lines += ["", "by thread (outermost frames):"]
    lines += [f"{100 * c / n:6.1f}%  {f}" for f, c in roots.most_common(8)]
    lines += ["", "total samples (frame on the stack):"]
    lines += [f"{100 * c / n:6.1f}%  {f}" for f, c in total.most_common(top)]
    txt.write_text("\n".join(lines) + "\n")


def profiled(pid: int, out: Path, name: str, seconds: float, work) -> None:
    svg = record(pid, out / f"{name}.svg", seconds, "flamegraph")
    raw_path = out / f"{name}.raw"
    raw = record(pid, raw_path, seconds, "raw")
    time.sleep(0.5)
    stop_at = time.monotonic() + seconds
    count = work(stop_at)
    for p in (svg, raw):
        _, err = p.communicate(timeout=60)
        if p.returncode:
            print(f"py-spy failed: {err.decode()[-500:]}", file=sys.stderr)
    summarize(raw_path, out / f"{name}.txt")
    raw_path.unlink()
    print(f"{name}: {count} operations in {seconds:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="kvtier-profile-"))
    nblocks = 64
    proc, url = start_daemon(work_dir, 3 * nblocks * SPEC.block_nbytes)
    try:
        client = make_client("daemon", url)
        src = torch.randn((nblocks, *SPEC.block_shape)).to(SPEC.dtype)
        hashes = [BlockHash(bytes([i]) * 32) for i in range(nblocks)]
        assert all(client.put(NAMESPACE, hashes, list(src)))

        def lookups(stop_at: float) -> int:
            done = [0] * args.clients

            def run(i: int) -> None:
                while time.monotonic() < stop_at:
                    assert client.lookup(NAMESPACE, hashes[:32]) == 32
                    done[i] += 1

            threads = [threading.Thread(target=run, args=(i,)) for i in range(args.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return sum(done)

        round_ = iter(range(1, 1 << 30))

        def puts(stop_at: float) -> int:
            n = 0
            while time.monotonic() < stop_at:
                r = next(round_)
                fresh = [BlockHash(r.to_bytes(4, "big") + bytes([i]) * 28) for i in range(nblocks)]
                for s in range(0, nblocks, 16):
                    assert all(client.put(NAMESPACE, fresh[s : s + 16], list(src[s : s + 16])))
                    n += 16
            return n

        dst = torch.empty_like(src)

        def gets(stop_at: float) -> int:
            n = 0
            while time.monotonic() < stop_at:
                for s in range(0, nblocks, 16):
                    st = client.get_into(NAMESPACE, hashes[s : s + 16], list(dst[s : s + 16]))
                    n += sum(x.value == "ok" for x in st)
            return n

        profiled(proc.pid, args.out, "lookup", args.seconds, lookups)
        profiled(proc.pid, args.out, "put", args.seconds, puts)
        assert all(client.put(NAMESPACE, hashes, list(src)))
        profiled(proc.pid, args.out, "get", args.seconds, gets)
        client.close()
    finally:
        stop(proc)


if __name__ == "__main__":
    main()
