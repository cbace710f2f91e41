"""Real multi-turn traffic: the cut-off ShareGPT file read explicitly, and the replayer against a fake endpoint."""

from __future__ import annotations

import json
import time

import pytest

from tests.services import LoopbackServer, free_port
from tests.serving_support import fake_replica
from traffic import sharegpt
from traffic.public_prompts import PromptSourceError
from traffic.replay import replay


@pytest.mark.parametrize("text, n, truncated", [
    ('[{"a": 1}, {"b": 2}]', 2, False),
    ('[ ]', 0, False),
    ('[{"a": 1}, {"b": "cut he', 1, True),  # inside a string of the second element
    ('[{"a": 1}, {"b": 2},', 2, True),  # between elements
    ('[{"a": 1}, {"b"', 1, True),
    ('[', 0, True),
])
def test_a_cut_off_array_keeps_every_complete_element_and_says_it_was_cut(text, n, truncated):
    p = sharegpt.read_array_prefix(text)
    assert len(p.objects) == n and p.truncated is truncated
    if truncated:
        assert p.reason and p.stopped_at <= len(text)


def test_not_an_array_or_data_after_it_is_an_error():
    with pytest.raises(PromptSourceError, match="not a JSON array"):
        sharegpt.read_array_prefix('{"a": 1}')
    with pytest.raises(PromptSourceError, match="data after the end"):
        sharegpt.read_array_prefix('[{"a": 1}] [2]')


def test_normalize_maps_speakers_and_drops_what_has_no_user():
    c = sharegpt.normalize({"id": "x", "conversations": [
        {"from": "human", "value": "hi ```py\nprint(1)```"}, {"from": "ChatGPT", "value": "hello"},
        {"from": "narrator", "value": "?"}, {"from": "gpt", "value": "  "}]})
    assert [t["from"] for t in c.turns] == ["human", "gpt"] and c.has_code and c.user_turns == ["hi ```py\nprint(1)```"]
    assert sharegpt.normalize({"id": "y", "conversations": [{"from": "gpt", "value": "only me"}]}) is None


def test_the_real_sharegpt_wheel_is_read_to_its_cut(tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "prompt-wheels"
    s = sharegpt.load(cache)
    r = s.read
    assert r["objects"] == 17671 and r["truncated"] and r["dropped_tail_chars"] > 0
    assert r["kept"] + r["no_user_turn"] + r["repeated_id"] == r["objects"]
    assert len(s.conversations) == r["kept"] > 17000 and r["with_code"] > 6000 and r["multi_turn"] > 12000
    general, code = sharegpt.general_and_code(s.conversations)
    assert len(general) + len(code) == len(s.conversations) and all(c.has_code for c in code)
    assert sharegpt.stable_order(code)[:3] == sharegpt.stable_order(list(reversed(code)))[:3]


def conv(cid, *users, dataset_answer="RECORDED"):
    turns = []
    for u in users:
        turns += [{"from": "human", "value": u}, {"from": "gpt", "value": dataset_answer}]
    return {"id": cid, "conversations": turns}


def test_each_turn_carries_the_served_models_own_earlier_answers():
    app = fake_replica(context_chars=10_000, delay=0.05)
    with LoopbackServer(app, free_port()) as s:
        stats = replay(s.url, "m", [conv("a", "q1", "q2", "q3")], progress=False)
    msgs = [r["json"]["messages"] for r in app.state.seen]
    assert [[m["content"] for m in ms] for ms in msgs] == [
        ["q1"], ["q1", "answer-1", "q2"], ["q1", "answer-1", "q2", "answer-2", "q3"]]
    assert all("RECORDED" not in json.dumps(ms) for ms in msgs)
    assert stats.completed == 1 and stats.turns_ok == 3 and stats.output_tokens == 9


def test_a_history_that_outgrows_the_context_ends_its_conversation_not_the_run():
    app = fake_replica(context_chars=40, delay=0.05)
    with LoopbackServer(app, free_port()) as s:
        stats = replay(s.url, "m", [conv("long", "x" * 15, "y" * 15, "z" * 15), conv("ok", "hi")], progress=False,
                       max_turns=5)
    assert stats.context_full == 1 and stats.completed == 1 and stats.failed == 0 and stats.turns_ok == 3


def test_concurrency_bounds_conversations_in_flight_and_rate_spreads_their_starts():
    app = fake_replica(context_chars=10_000, delay=0.2)
    rows = [conv(str(i), "q1", "q2") for i in range(8)]
    with LoopbackServer(app, free_port()) as s:
        stats = replay(s.url, "m", rows, concurrency=2, progress=False)
        assert app.state.peak == 2 and stats.completed == 8
        app.state.seen.clear()
        t0 = time.perf_counter()
        replay(s.url, "m", rows[:4], concurrency=8, rate=5.0, seed=1, progress=False)
        spread = time.perf_counter() - t0
    assert spread > 0.5  # four starts of a 5/s Poisson process, seeded: not all at once


def test_max_turns_stops_a_conversation_after_that_many_user_turns():
    app = fake_replica(context_chars=10_000, delay=0.05)
    with LoopbackServer(app, free_port()) as s:
        stats = replay(s.url, "m", [conv("a", "q1", "q2", "q3")], max_turns=2, progress=False)
    assert stats.turns_sent == 2 and len(app.state.seen) == 2 and stats.completed == 1


def test_transcripts_hold_each_conversation_as_served():
    app = fake_replica(context_chars=40, delay=0.05)
    out: list = []
    with LoopbackServer(app, free_port()) as s:
        replay(s.url, "m", [conv("a", "q1", "q2"), conv("long", "x" * 50)], progress=False, transcripts=out)
    assert out == [{"id": "a", "conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "answer-1"},
                                                 {"from": "human", "value": "q2"}, {"from": "gpt", "value": "answer-2"}]}]
