"""The whole exchange (issue 40): tools, tool calls, reasoning, finish reason and vLLM token ids
survive capture, redaction, dedupe, stitching and export; bad ones are quarantined with a reason;
the three decoders stay in step on the mix that carries them."""

from __future__ import annotations

import json
import random
from datetime import timedelta

import pytest

from capture import batchpath, dedupe, ingest as ingest_mod
from capture.formats import to_conversation
from capture.ingest import IDS_DROPPED, ingest, process_file
from capture.records import Reject, decode_line, make_capture_record
from capture.sharegpt import Exchange, to_exchange
from capture.split import export, export_row, load_split
from capture.synth import ALL_FORMATS, EXCHANGE_FORMATS, TextPool, exchange, lines as synth_lines
from tests.capture_support import T0, check, layout_file, msgspec_chunk, obj_of, reconciles, same, write
from tests.config_support import make_cfg

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
TOOL_REQ = {"model": "qwen3", "tools": TOOLS, "tool_choice": "auto", "chat_template_kwargs": {"enable_thinking": False},
            "messages": [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Oslo?"},
                         {"role": "assistant", "content": None, "tool_calls": [CALL]},
                         {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "12 C, rain"}]}


def vllm_message(content, reasoning=None, tool_calls=None) -> dict:
    return {"role": "assistant", "content": content, "refusal": None, "tool_calls": tool_calls or [],
            "reasoning": reasoning, "reasoning_content": None}


def response(message: dict, finish="stop", prompt_ids=None, ids=None) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "qwen3", "prompt_token_ids": prompt_ids,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "token_ids": ids}]}


def sse(chunks: list[dict]) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def conv_of(req, resp, ct="application/json"):
    rec = decode_line(make_capture_record(req, resp, response_content_type=ct).encode())
    return to_conversation(rec.request, rec.response)


def row_of(tmp_path, lines, redact=True) -> tuple[list[dict], object]:
    p = write(tmp_path / "cap.jsonl", [make_capture_record(**kw, event_id=f"e{i}", inference_time=T0)
                                       if isinstance(kw, dict) else kw for i, kw in enumerate(lines)])
    res = process_file(obj_of(p), ingest_mod.FileOptions(redact=redact))
    assert res.read == res.table.num_rows + res.file_duplicates + res.file_stitched + len(res.quarantine) + \
        sum(res.skips.values())
    return res.table.to_pylist(), res


# -- the reference keeps it all ---------------------------------------------------------------

def test_plain_rows_keep_their_sharegpt_view_and_no_structured_columns(tmp_path):
    req = {"model": "m", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]}
    (row,), _ = row_of(tmp_path, [{"request": req, "response": response(vllm_message("A"), finish="length")}])
    assert [(t["from"], t["value"]) for t in row["conversations"]] == [("system", "S"), ("human", "Q"), ("gpt", "A")]
    assert all(row[k] is None for k in batchpath.STRUCTURED)
    assert row["finish_reason"] == "length"  # a cut answer: no end of turn was generated
    ex = to_exchange(row)
    assert ex == Exchange(messages=[{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                                    {"role": "assistant", "content": "A"}], tools=None, tool_choice=None,
                          chat_template_kwargs=None, raw=False, prompt_token_ids=None, output_token_ids=None,
                          finish_reason="length")


def test_reasoning_is_kept_out_of_the_value_and_in_messages():
    conv = conv_of({"messages": [{"role": "user", "content": "2+2?"}]},
                   response(vllm_message("4", reasoning="Two and two make four.")))
    assert conv.turns == [("human", "2+2?"), ("gpt", "4")]
    assert json.loads(conv.messages) == [{"role": "user", "content": "2+2?"},
                                         {"role": "assistant", "content": "4", "reasoning": "Two and two make four."}]
    # The deprecated field name is read too, and an answer that is all reasoning is kept.
    msg = vllm_message(None) | {"reasoning": None, "reasoning_content": "Still thinking"}
    conv = conv_of({"messages": [{"role": "user", "content": "Q"}]}, response(msg, finish="length"))
    assert conv.turns[-1] == ("gpt", "") and conv.finish_reason == "length"
    assert json.loads(conv.messages)[-1] == {"role": "assistant", "content": None, "reasoning": "Still thinking"}


def test_tool_calls_tools_and_tool_messages_are_kept_as_sent():
    new_call = {"id": "chatcmpl-tool-2", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}}
    conv = conv_of(TOOL_REQ, response(vllm_message(None, tool_calls=[new_call]), finish="tool_calls"))
    msgs = json.loads(conv.messages)
    assert msgs[:-1] == TOOL_REQ["messages"]
    assert msgs[-1] == {"role": "assistant", "content": None, "tool_calls": [new_call]}
    assert json.loads(conv.tools) == TOOLS and json.loads(conv.tool_choice) == "auto"
    assert json.loads(conv.chat_template_kwargs) == {"enable_thinking": False}
    assert conv.finish_reason == "tool_calls"
    # The ShareGPT view as before: tool calls as JSON text, the tool result a human turn.
    assert [f for f, _ in conv.turns] == ["system", "human", "gpt", "human", "gpt"]
    assert json.loads(conv.turns[2][1]) == [CALL] and json.loads(conv.turns[-1][1]) == [new_call]


def test_streamed_reasoning_and_tool_calls_are_merged_by_index():
    head = {"id": "c", "object": "chat.completion.chunk", "model": "qwen3"}
    chunks = [head | {"prompt_token_ids": [1, 2, 3], "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                                  "token_ids": []}]},
              head | {"choices": [{"index": 0, "delta": {"reasoning": "Need "}, "token_ids": [10]}]},
              head | {"choices": [{"index": 0, "delta": {"reasoning_content": "weather."}, "token_ids": [11]}]},
              head | {"choices": [{"index": 0, "delta": {"tool_calls": [
                  {"index": 0, "id": "t0", "type": "function", "function": {"name": "get_weather", "arguments": ""}},
                  {"index": 1, "id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"ci'}}]},
                  "token_ids": [12]}]},
              head | {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Oslo"}'}},
                                                                         {"index": 1, "function": {"arguments": 'ty": "Lima"}'}}]},
                                   "token_ids": [13, 14]}]},
              head | {"choices": [{"index": 1, "delta": {"content": "other sample"}, "token_ids": [99]}]},
              head | {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls", "token_ids": [15]}]}]
    conv = conv_of(TOOL_REQ, sse(chunks), "text/event-stream")
    last = json.loads(conv.messages)[-1]
    assert last == {"role": "assistant", "content": None, "reasoning": "Need weather.", "tool_calls": [
        {"id": "t0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}}]}
    assert (conv.prompt_token_ids, conv.output_token_ids, conv.finish_reason) == ([1, 2, 3], [10, 11, 12, 13, 14, 15],
                                                                                  "tool_calls")


def test_token_ids_of_chat_and_completions_json_and_sse():
    conv = conv_of({"messages": [{"role": "user", "content": "Q"}]},
                   response(vllm_message("A"), prompt_ids=[5, 6], ids=[7, 8]))
    assert (conv.prompt_token_ids, conv.output_token_ids, conv.messages) == ([5, 6], [7, 8], None)
    comp = {"choices": [{"index": 0, "text": " world", "finish_reason": "stop", "prompt_token_ids": [1], "token_ids": [2]}]}
    conv = conv_of({"prompt": "hello"}, comp)
    assert (conv.turns, conv.raw, conv.prompt_token_ids, conv.output_token_ids) == (
        [("human", "hello"), ("gpt", " world")], True, [1], [2])
    stream = [{"choices": [{"index": 0, "text": " wo", "prompt_token_ids": [1], "token_ids": [2]}]},
              {"choices": [{"index": 0, "text": "rld", "token_ids": [3], "finish_reason": "length"}]}]
    conv = conv_of({"prompt": "hello", "stream": True}, sse(stream), "text/event-stream")
    assert (conv.turns[-1], conv.prompt_token_ids, conv.output_token_ids, conv.finish_reason) == (
        ("gpt", " world"), [1], [2, 3], "length")


@pytest.mark.parametrize("req,resp,reason", [
    ({"messages": [{"role": "user", "content": "Q"}]},
     response(vllm_message(None, tool_calls=[{"id": "x", "type": "function",
                                              "function": {"name": "f", "arguments": "{not json"}}])),
     "invalid_tool_call_arguments"),
    ({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "x", "function": {"name": "f", "arguments": 42}}]}, {"role": "user", "content": "and?"}]},
     response(vllm_message("A")), "invalid_tool_call_arguments"),
    ({"messages": [{"role": "user", "content": "Q"}]}, response(vllm_message("A"), ids=[1, -2]), "invalid_token_ids"),
    ({"messages": [{"role": "user", "content": "Q"}]}, response(vllm_message("A"), prompt_ids="1 2"), "invalid_token_ids"),
    ({"messages": [{"role": "user", "content": "Q"}]}, response(vllm_message("A"), ids=[1, True]), "invalid_token_ids"),
    ({"messages": [{"role": "user", "content": "Q"}]}, response(vllm_message("A", reasoning=["x"])), "invalid_reasoning"),
    ({"messages": [{"role": "user", "content": "Q", "reasoning_content": 3}]}, response(vllm_message("A")),
     "invalid_reasoning"),
    ({"messages": [{"role": "user", "content": "Q"}], "chat_template_kwargs": "think"}, response(vllm_message("A")),
     "wrong_type"),
])
def test_bad_exchange_fields_are_quarantined_with_a_reason(tmp_path, req, resp, reason):
    with pytest.raises(Reject) as e:
        conv_of(req, resp)
    assert (e.value.kind, e.value.reason) == ("quarantine", reason)
    good = {"request": {"messages": [{"role": "user", "content": "fine"}]}, "response": response(vllm_message("ok"))}
    rows, res = row_of(tmp_path, [{"request": req, "response": resp}, good])
    assert len(rows) == 1 and [q["reason"] for q in res.quarantine] == [reason]
    assert same(make_capture_record(req, resp).encode())  # the fast paths decline it to the reference


def test_bad_streamed_tool_call_arguments_are_quarantined():
    chunks = [{"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "t", "function": {
        "name": "f", "arguments": '{"a": '}}]}}]}, {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}]
    with pytest.raises(Reject) as e:
        conv_of({"messages": [{"role": "user", "content": "Q"}], "stream": True}, sse(chunks), "text/event-stream")
    assert e.value.reason == "invalid_tool_call_arguments"


# -- redaction: no secret in any stored form --------------------------------------------------

AWS = "AKIAIOSFODNN7EXAMPLE"
MAIL = "jane.doe@example.com"


def test_redaction_covers_every_stored_text_and_drops_the_ids_of_a_changed_row(tmp_path):
    call = {"id": "t", "type": "function", "function": {"name": "login", "arguments": json.dumps(
        {"user": MAIL, "password": "hunter2hunter2"})}}
    req = {"messages": [{"role": "user", "content": "log me in"}],
           "tools": [{"type": "function", "function": {"name": "login", "description": f"key {AWS}"}}],
           "chat_template_kwargs": {"note": f"mail {MAIL}"}}
    dirty = {"request": req, "response": response(vllm_message(None, reasoning=f"use {AWS}", tool_calls=[call]),
                                                  prompt_ids=[1, 2], ids=[3, 4])}
    clean = {"request": {"messages": [{"role": "user", "content": "hi"}]},
             "response": response(vllm_message("hello", reasoning="greet"), prompt_ids=[9], ids=[10])}
    rows, res = row_of(tmp_path, [dirty, clean])
    stored = json.dumps(rows, default=str)
    for secret in (AWS, MAIL, "hunter2hunter2"):
        assert secret not in stored
    d, c = rows
    assert d["prompt_token_ids"] is None and d["output_token_ids"] is None
    assert (c["prompt_token_ids"], c["output_token_ids"]) == ([9], [10])  # unchanged: kept
    counts = dict(res.row_redactions)[0]
    assert counts[IDS_DROPPED] == 1
    last = json.loads(d["messages"])[-1]
    assert "[REDACTED_" in last["reasoning"] and "[REDACTED_" in last["tool_calls"][0]["function"]["arguments"]
    json.loads(last["tool_calls"][0]["function"]["arguments"])  # still JSON
    assert "[REDACTED_" in d["conversations"][-1]["value"]


def test_a_run_counts_the_rows_whose_ids_were_dropped(tmp_path):
    cfg = make_cfg(tmp_path)
    req = {"messages": [{"role": "user", "content": f"my key is {AWS}"}]}
    layout_file(tmp_path / "src", T0, "a.jsonl", [make_capture_record(
        req, response(vllm_message("ok"), prompt_ids=[1], ids=[2]), inference_time=T0)])
    res = ingest(cfg, source=str(tmp_path / "src"))
    assert reconciles(res) and res.normalized == 1 and res.redactions[IDS_DROPPED] == 1
    (row,) = load_split(cfg, "train", heldout_hours=0)
    assert row["prompt_token_ids"] is None and AWS not in json.dumps(row, default=str)


# -- dedupe, stitching and export -------------------------------------------------------------

def test_requests_alike_in_text_but_not_in_exchange_are_not_duplicates(tmp_path):
    q = {"messages": [{"role": "user", "content": "Q"}]}
    plain = {"request": q, "response": response(vllm_message("A"))}
    thinking = {"request": q, "response": response(vllm_message("A", reasoning="r"))}
    ids = {"request": q, "response": response(vllm_message("A"), prompt_ids=[1], ids=[2])}
    rows, res = row_of(tmp_path, [plain, thinking, ids, plain, thinking])
    assert len(rows) == 3 and res.file_duplicates == 2


def test_the_decoder_drops_replays_of_exact_rows_itself_as_the_reference_does(tmp_path):
    """A replayed request kept whole is dropped in the decoder (nothing left for the file's own
    dedupe to copy), keyed by turns and exchange: a plain row with the same turns stays."""
    q = {"messages": [{"role": "user", "content": "Q"}]}
    kinds = [{"request": q, "response": response(vllm_message("A"))},
             {"request": q, "response": response(vllm_message("A", reasoning="r"))},
             {"request": q, "response": response(vllm_message("A"), prompt_ids=[1], ids=[2])},
             {"request": q, "response": response(vllm_message("A"), prompt_ids=[1], ids=[3])}]
    order = [0, 1, 2, 3, 1, 2, 2, 0, 3, 1]
    lines = [make_capture_record(**kinds[k], event_id=f"e{i}", inference_time=T0 + timedelta(seconds=i))
             for i, k in enumerate(order)]
    block = ("\n".join(lines) + "\n").encode()
    got = batchpath.decode_block(block, 0, 1, 8192, 1 << 26, None, dedupe.HashSet())
    assert (got.batch.num_rows, got.duplicates, got.unchecked) == (4, 6, 0)
    assert got.batch.column("line_no").to_pylist() == [1, 2, 3, 4]
    p = write(tmp_path / "cap.jsonl", lines)
    fast = process_file(obj_of(p), ingest_mod.FileOptions(), batch=True)
    slow = process_file(obj_of(p), ingest_mod.FileOptions(), batch=False)
    assert fast.table.equals(slow.table) and fast.file_duplicates == slow.file_duplicates == 6


def test_stitching_never_merges_an_exact_row_into_one_that_loses_it(tmp_path):
    """A request kept whole (reasoning, tool calls or ids) is its own example even when a later
    request of the conversation holds its text; plain prefixes are still stitched as before."""
    sys_ = {"role": "system", "content": "S"}
    turn1 = {"request": {"messages": [sys_, {"role": "user", "content": "Q1"}]},
             "response": response(vllm_message("A1", reasoning="think 1"), prompt_ids=[1], ids=[2])}
    plain1 = {"request": {"messages": [sys_, {"role": "user", "content": "P1"}]}, "response": response(vllm_message("B1"))}
    turn2 = {"request": {"messages": [sys_, {"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
                                      {"role": "user", "content": "Q2"}]}, "response": response(vllm_message("A2"))}
    plain2 = {"request": {"messages": [sys_, {"role": "user", "content": "P1"}, {"role": "assistant", "content": "B1"},
                                       {"role": "user", "content": "P2"}]},
              "response": response(vllm_message("B2", reasoning="r2"))}
    rows, res = row_of(tmp_path, [turn1, plain1, turn2, plain2])
    kept = sorted(tuple(t["value"] for t in r["conversations"] if t["from"] == "human") for r in rows)
    # turn1 (reasoning + ids) stays beside turn2; plain1 is stitched into plain2 (kept whole itself).
    assert kept == [("P1", "P2"), ("Q1",), ("Q1", "Q2")] and res.file_stitched == 1
    assert next(r for r in rows if len(r["conversations"]) == 3)["output_token_ids"] == [2]


def test_ingest_then_export_is_a_sharegpt_superset_that_to_exchange_reads(tmp_path):
    cfg = make_cfg(tmp_path)
    new_call = dict(CALL, id="t2")
    layout_file(tmp_path / "src", T0, "a.jsonl", [
        make_capture_record(TOOL_REQ, response(vllm_message(None, reasoning="r", tool_calls=[new_call]),
                                               finish="tool_calls", prompt_ids=[1, 2], ids=[3]), inference_time=T0),
        make_capture_record({"messages": [{"role": "user", "content": "plain"}]}, response(vllm_message("A")),
                            inference_time=T0 + timedelta(seconds=1))])
    res = ingest(cfg, source=str(tmp_path / "src"))
    assert reconciles(res) and res.normalized == 2
    out = tmp_path / "train.jsonl"
    assert export(cfg, "train", out, heldout_hours=0) == 2
    exported = [json.loads(x) for x in out.read_text().splitlines()]
    stored = load_split(cfg, "train", heldout_hours=0)
    for e, s in zip(exported, stored):
        assert e["conversations"] == s["conversations"]  # what ShareGPT readers read, unchanged
        assert to_exchange(e) == to_exchange(s) == to_exchange(export_row(s))
    tool = next(to_exchange(e) for e in exported if e["messages"])
    assert tool.tools == TOOLS and tool.tool_choice == "auto" and tool.chat_template_kwargs == {"enable_thinking": False}
    assert tool.messages[-1] == {"role": "assistant", "content": None, "reasoning": "r", "tool_calls": [new_call]}
    assert (tool.prompt_token_ids, tool.output_token_ids, tool.finish_reason, tool.raw) == ([1, 2], [3], "tool_calls",
                                                                                           False)
    plain = next(e for e in exported if not e["messages"])
    assert plain["tools"] is None and to_exchange(plain).messages == [{"role": "user", "content": "plain"},
                                                                      {"role": "assistant", "content": "A"}]


def test_to_exchange_refuses_malformed_fields():
    with pytest.raises(ValueError, match="token ids"):
        to_exchange({"conversations": [], "prompt_token_ids": [1, -1]})
    with pytest.raises(ValueError, match="messages"):
        to_exchange({"conversations": [], "messages": "{not json"})


# -- the synthetic mix and the three decoders -------------------------------------------------

def test_synthetic_mix_is_a_third_reasoning_and_tool_calls_built_like_vllm():
    pool = TextPool(random.Random(4))
    got = [to_conversation(*(lambda r: (r.request, r.response))(decode_line(line.encode())))
           for line in synth_lines(600, seed=4)
           if "text/csv" not in line]
    whole = [c for c in got if c.messages is not None]
    assert len(whole) >= len(got) // 3
    msgs = [json.loads(c.messages) for c in whole]
    assert any("reasoning" in m[-1] for m in msgs) and any("tool_calls" in m[-1] for m in msgs)
    assert any(m.get("role") == "tool" and m.get("tool_call_id") for ms in msgs for m in ms)
    assert any(c.prompt_token_ids and c.output_token_ids for c in whole)
    for fmt in EXCHANGE_FORMATS:
        kw = exchange(fmt, pool, 1)
        if fmt.endswith("_stream"):
            assert kw["response"].startswith("data: ")
        else:
            call = [c for c in (kw["response"]["choices"][0]["message"]["tool_calls"] or [])]
            assert all(isinstance(c["function"]["arguments"], str) for c in call)


def test_msgspec_declines_every_whole_exchange_that_the_c_decoder_decides_as_the_reference():
    lines = [line.encode() for line in synth_lines(1500, seed=9)]
    for line in lines[:300]:
        assert same(line)
    # check: the rows both fast paths decide alike, the ones only the C decoder decides as the reference.
    decided_native, decided_msgspec = check(lines, hour=T0)
    assert decided_native == len(lines) > decided_msgspec
    chunk = msgspec_chunk(lines)
    structured = set()
    for i, line in enumerate(lines):
        rec = decode_line(line)
        try:
            conv = to_conversation(rec.request, rec.response)
        except Reject:
            continue
        if conv.messages is not None or conv.prompt_token_ids is not None:
            structured.add(i)
    assert structured and structured <= set(chunk.declined)
    assert set(chunk.batch.column("finish_reason").to_pylist()) >= {"stop"}


def test_each_format_through_both_file_paths_alike(tmp_path):
    pool = TextPool(random.Random(6))
    for fmt in ALL_FORMATS:
        p = write(tmp_path / f"{fmt}.jsonl", [make_capture_record(event_id=f"e{i}", inference_time=T0 + timedelta(seconds=i),
                                                                   **exchange(fmt, pool, i)) for i in range(20)])
        fast = process_file(obj_of(p), ingest_mod.FileOptions(), batch=True)
        slow = process_file(obj_of(p), ingest_mod.FileOptions(), batch=False)
        assert fast.table.equals(slow.table) and fast.quarantine == slow.quarantine == []
        assert fast.table.num_rows == (0 if fmt == "tabular_csv" else 20)
