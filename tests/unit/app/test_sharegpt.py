"""kvtier.app.sharegpt: the tolerant parser of the truncated ShareGPT file and the seeded choice."""

from __future__ import annotations

import io
import json

import pytest

from kvtier.app.sharegpt import (
    choose_conversations,
    iter_records,
    read_conversations,
    shuffled_eligible,
    to_conversation,
)


def _record(i: int, num_turns: int, text: str = "") -> dict:
    messages = []
    for t in range(num_turns):
        messages.append({"from": "human", "value": f"q{i}.{t} {text}"})
        messages.append({"from": "gpt", "value": f"a{i}.{t}"})
    return {"id": f"c{i}", "conversations": messages}


def _truncated_json(records: list[dict], cut_chars: int) -> str:
    """The records as an indented JSON array, with the last ``cut_chars`` characters cut."""
    text = json.dumps(records, indent=2, ensure_ascii=False)
    return text[:-cut_chars]


@pytest.mark.parametrize("chunk_chars", [7, 64, 1 << 20])
def test_iter_records_stops_at_the_truncated_object(chunk_chars: int) -> None:
    records = [_record(i, 2, "héllo ☃ wörld") for i in range(5)]
    text = _truncated_json(records, cut_chars=30)  # cuts into the last record
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    parsed = list(iter_records(io.StringIO(text), chunk_chars=chunk_chars))
    assert parsed == records[:4]


@pytest.mark.parametrize("chunk_chars", [1, 5, 33])
def test_iter_records_reads_utf8_bytes_cut_mid_character(chunk_chars: int) -> None:
    records = [_record(i, 1, "☃☃ émoji 🙂") for i in range(3)]
    data = _truncated_json(records, cut_chars=10).encode("utf-8")
    assert list(iter_records(io.BytesIO(data), chunk_chars=chunk_chars)) == records[:2]


def test_iter_records_reads_a_complete_array() -> None:
    records = [_record(i, 1) for i in range(3)]
    assert list(iter_records(io.StringIO(json.dumps(records)), chunk_chars=10)) == records


def test_iter_records_rejects_a_non_array() -> None:
    with pytest.raises(ValueError, match="expected a JSON array"):
        list(iter_records(io.StringIO('{"a": 1}')))


def test_to_conversation_pairs_human_with_gpt_and_stops_at_a_break() -> None:
    record = {"conversations": [
        {"from": "gpt", "value": "greeting first"},  # leading non-human: skipped
        {"from": "human", "value": "u1"}, {"from": "gpt", "value": "r1"},
        {"from": "human", "value": "u2"}, {"from": "gpt", "value": "r2"},
        {"from": "human", "value": "u3"}, {"from": "human", "value": "u3 again"},  # breaks alternation
        {"from": "gpt", "value": "r3"},
    ]}
    assert to_conversation(record) == [("u1", "r1"), ("u2", "r2")]


def test_read_conversations_drops_empty_ones() -> None:
    records = [_record(0, 2), {"id": "x", "conversations": []}, _record(1, 1)]
    text = json.dumps(records)
    assert [len(c) for c in read_conversations(io.StringIO(text))] == [2, 1]


def test_seeded_choice_is_deterministic_and_respects_min_turns() -> None:
    records = [_record(i, 1 + i % 6) for i in range(60)]
    conversations = read_conversations(io.StringIO(json.dumps(records)))
    a = choose_conversations(conversations, 5, min_user_turns=4, seed=3)
    b = choose_conversations(conversations, 5, min_user_turns=4, seed=3)
    c = choose_conversations(conversations, 5, min_user_turns=4, seed=4)
    assert a == b
    assert a != c
    assert all(len(conv) == 4 for conv in a)  # cut to min_user_turns turns
    # every chosen conversation had >= 4 turns in the source
    sources = {conv[0][0]: conv for conv in conversations}
    assert all(len(sources[conv[0][0]]) >= 4 for conv in a)
    assert shuffled_eligible(conversations, 4, seed=3) == shuffled_eligible(conversations, 4, seed=3)


def test_seeded_choice_returns_fewer_when_few_qualify() -> None:
    conversations = [[("u", "r")] * 4, [("u", "r")] * 2]
    assert len(choose_conversations(conversations, 5, min_user_turns=4)) == 1


def test_select_conversations_skips_over_budget_and_is_seeded() -> None:
    from kvtier.app.models import byte_tokenizer
    from kvtier.app.sharegpt import select_conversations

    tokenizer = byte_tokenizer()  # one token per byte: lengths are easy to reason about
    long_text = "x" * 400
    records = [_record(i, 4, long_text if i % 2 else "") for i in range(20)]
    conversations = read_conversations(io.StringIO(json.dumps(records)))
    chosen, skipped = select_conversations(tokenizer, 3, 4, seed=1, max_prompt_tokens=300,
                                           conversations=conversations)
    assert len(chosen) == 3 and skipped > 0
    assert all("x" * 400 not in user for conv in chosen for user, _ in conv)  # the long ones were skipped
    again, _ = select_conversations(tokenizer, 3, 4, seed=1, max_prompt_tokens=300, conversations=conversations)
    assert again == chosen
    # cut messages instead of skipping: every draw fits
    cut, skipped = select_conversations(tokenizer, 3, 4, seed=1, max_message_tokens=50, max_prompt_tokens=400,
                                        conversations=conversations)
    assert skipped == 0 and all(len(user) <= 50 for conv in cut for user, _ in conv)
    # a minimum history keeps only the long ones
    long_only, _ = select_conversations(tokenizer, 3, 4, seed=1, min_history_tokens=1000, max_prompt_tokens=5000,
                                        conversations=conversations)
    assert len(long_only) == 3 and all("x" * 400 in conv[0][0] for conv in long_only)
