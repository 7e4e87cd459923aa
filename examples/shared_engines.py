"""Two engine processes sharing one KV cache through a REMOTE tier (the daemon or Redis).

    kvtier serve --port 8765 &                                   # or: redis-server --port 6379 &
    python examples/shared_engines.py --remote-url http://127.0.0.1:8765 --tiny

Engine A (a process with its own GPU/CPU/DISK tiers) serves the first turns of a
conversation; engine B (a new process, empty local tiers) takes over the conversation, as when
a load balancer moves it to another replica. B's first request hits the history A computed,
from REMOTE; its reply is compared with a cold engine (no kvtier) on the same prompt.

Each engine is ``python examples/shared_engines.py --role engine ...`` in its own process: it
reads the chat so far and the user turns to add from a JSON file and writes the replies, the
tokens it generated and the cached tokens per tier back.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

QUESTIONS = [
    "Explain in two sentences what a KV cache is in a transformer.",
    "Why does reusing it make the first token of a reply faster?",
    "What should a cache key include so that two models never share entries?",
    "And what goes wrong if it leaves the tokenizer out?",
]


def run_engine(job: dict) -> dict:
    """One engine process: ``job`` = {model, remote_url (None: no kvtier), data_dir,
    messages (chat so far), questions (user turns to add), max_new_tokens}."""
    import torch

    from kvtier import StoreConfig
    from kvtier.connectors.hf import HFConnector
    from kvtier.app.models import load_model, render_chat

    torch.manual_seed(0)
    model, tokenizer, model_id = load_model(job["model"])
    kv = None
    if job["remote_url"] is not None:
        config = StoreConfig(
            gpu_bytes="64MiB", cpu_bytes="64MiB", disk_bytes="256MiB", data_dir=job["data_dir"],
            remote_url=job["remote_url"], remote_token=job.get("remote_token"),
            remote_timeout_s=job.get("remote_timeout_s", 2.0),
        )
        kv = HFConnector.from_model(model, config, model_id=model_id)
    messages, turns = list(job["messages"]), []
    try:
        for question in job["questions"]:
            messages.append({"role": "user", "content": question})
            input_ids = torch.tensor([render_chat(tokenizer, messages)])
            plan = kv.before_prefill(input_ids) if kv is not None else None
            with torch.inference_mode():
                out = model.generate(
                    input_ids, max_new_tokens=job["max_new_tokens"], do_sample=False,
                    pad_token_id=tokenizer.eos_token_id, **(plan.generate_kwargs() if plan else {}),
                )
            if kv is not None:
                kv.after_request(out[0], plan.cache)
            new_ids = out[0, input_ids.shape[1]:].tolist()
            reply = tokenizer.decode(new_ids, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": reply})
            turns.append({
                "prompt_tokens": input_ids.shape[1],
                "cached_tokens": plan.num_cached_tokens if plan else 0,
                "cached_by_tier": plan.cached_tokens_by_medium(kv.block_size) if plan else {},
                "output_ids": new_ids,
            })
    finally:
        if kv is not None:
            kv.store.wait_for_writes()  # A's puts reach REMOTE before it reports done
            remote_errors = dict(kv.store.remote.errors) if kv.store.remote is not None else {}
            kv.close()
    return {"messages": messages, "turns": turns, "remote_errors": remote_errors if kv is not None else {}}


def spawn_engine(job: dict, workdir: Path, name: str) -> dict:
    """Run :func:`run_engine` in a new Python process (its own memory and tiers)."""
    job_path, out_path = workdir / f"{name}-job.json", workdir / f"{name}-out.json"
    job_path.write_text(json.dumps(job))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run(
        [sys.executable, __file__, "--role", "engine", "--job", str(job_path), "--out", str(out_path)],
        check=True, env=env,
    )
    return json.loads(out_path.read_text())


def share(remote_url: str, model: str, workdir: Path, first_turns: int = 3, max_new_tokens: int = 16,
          remote_token: str | None = None, cold_in_process: bool = False, remote_timeout_s: float = 2.0) -> dict:
    """A serves ``first_turns`` turns; B (fresh process and data dir) serves the next one;
    a cold engine (without kvtier; in this process when ``cold_in_process``) serves the same
    turn. Returns all three results (each engine's REMOTE errors by reason under
    ``"remote_errors"``)."""
    base = {"model": model, "max_new_tokens": max_new_tokens, "remote_token": remote_token,
            "remote_timeout_s": remote_timeout_s}
    a = spawn_engine({**base, "remote_url": remote_url, "data_dir": str(workdir / "a"), "messages": [],
                      "questions": QUESTIONS[:first_turns]}, workdir, "a")
    next_turn = {**base, "messages": a["messages"], "questions": QUESTIONS[first_turns : first_turns + 1]}
    b = spawn_engine({**next_turn, "remote_url": remote_url, "data_dir": str(workdir / "b")}, workdir, "b")
    cold_job = {**next_turn, "remote_url": None, "data_dir": None}
    cold = run_engine(cold_job) if cold_in_process else spawn_engine(cold_job, workdir, "cold")
    return {"a": a, "b": b, "cold": cold}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--remote-url", default=os.environ.get("KVTIER_REMOTE_URL"),
                        help="the shared tier: http://host:port (kvtier serve) or redis://host:port/0")
    parser.add_argument("--remote-token", default=os.environ.get("KVTIER_REMOTE_TOKEN"))
    parser.add_argument("--tiny", action="store_true", help="tiny random-weight Llama instead of SmolLM2")
    parser.add_argument("--role", choices=["share", "engine"], default="share", help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "engine":
        Path(args.out).write_text(json.dumps(run_engine(json.loads(Path(args.job).read_text()))))
        return
    if not args.remote_url:
        parser.error("--remote-url (or KVTIER_REMOTE_URL) is required")
    with tempfile.TemporaryDirectory(prefix="kvtier-share-") as tmp:
        result = share(args.remote_url, "tiny-llama" if args.tiny else "smollm2", Path(tmp), remote_token=args.remote_token)
    for name in ("a", "b"):
        for i, turn in enumerate(result[name]["turns"]):
            tiers = ", ".join(f"{tier} {n}" for tier, n in turn["cached_by_tier"].items())
            print(f"engine {name.upper()} turn {i + 1}: prompt {turn['prompt_tokens']:4d} tokens, "
                  f"{turn['cached_tokens']:4d} cached" + (f" ({tiers})" if tiers else ""))
    same = result["b"]["turns"][-1]["output_ids"] == result["cold"]["turns"][-1]["output_ids"]
    print(f"engine B's reply equals a cold engine's: {same}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
