"""`adapt dataset tokens` and `adapt dataset stats --tokens` on captured Qwen3 traffic: what a head
would train on (from stored token ids, else rendered as vLLM renders the request), and the
trained tokens split into reasoning, content, tool calls and end of turn."""

from __future__ import annotations

import json
from datetime import timedelta

from typer.testing import CliRunner

from capture.records import make_capture_record
from settings.config import dump_toml
from tests.capture_support import T0, layout_file
from tests.config_support import make_cfg
from tests.render_support import TOOLS
from tests.target_support import qwen3_chat_model

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}


def _records(tok) -> tuple[list[str], list[int], list[int]]:
    def rec(i, messages, message, extra=None, resp_extra=None, choice_extra=None):
        req = {"model": "m", "messages": messages, **(extra or {})}
        resp = {"choices": [{"index": 0, "message": message, "finish_reason": "stop", **(choice_extra or {})}],
                **(resp_extra or {})}
        return make_capture_record(req, resp, event_id=f"e{i}", inference_time=T0 + timedelta(minutes=i))

    ask = [{"role": "user", "content": "what is three plus three"}]
    prompt = tok(tok.apply_chat_template(ask, add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False)["input_ids"]
    out = tok("<think>\nsum\n</think>\n\nfour<|im_end|>", add_special_tokens=False)["input_ids"]
    return [
        rec(0, [{"role": "user", "content": "what is two plus two"}], {"role": "assistant", "reasoning": "\nthe user wants the sum\n", "content": "\n\nfour"}),
        rec(1, [{"role": "user", "content": "weather in Paris?"}],
            {"role": "assistant", "content": None, "reasoning": "call the tool", "tool_calls": [CALL]},
            {"tools": TOOLS, "tool_choice": "auto"}),
        rec(2, [{"role": "user", "content": "is it ok?"}, {"role": "assistant", "content": "yes"},
                {"role": "user", "content": "really?"}], {"role": "assistant", "content": "yes, sure"}),
        # vLLM's return_token_ids: the ids are trained on as they are.
        rec(3, ask, {"role": "assistant", "reasoning": "sum", "content": "four"}, None,
            {"prompt_token_ids": prompt}, {"token_ids": out}),
        # Ids that do not decode to the row's text (another request's): the text is trained on, counted.
        rec(4, [{"role": "user", "content": "what is four plus four"}],
            {"role": "assistant", "reasoning": "add", "content": "eight"}, None,
            {"prompt_token_ids": prompt}, {"token_ids": out}),
    ], prompt, out


def test_dataset_tokens_and_stats_split(tmp_path, model_cache):
    from transformers import AutoTokenizer

    from app.cli import app

    target = qwen3_chat_model(model_cache)
    tok = AutoTokenizer.from_pretrained(target)
    cfg = make_cfg(tmp_path, target={"model": str(target)}, capture={"heldout_hours": 0})
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text(dump_toml(cfg))
    src = tmp_path / "capture"
    records, prompt, out = _records(tok)
    layout_file(src, T0, "a.jsonl", records)
    runner = CliRunner()
    r = runner.invoke(app, ["ingest", "--source", str(src), "--config", str(cfg_file), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["normalized"] == 5, r.output

    r = runner.invoke(app, ["dataset", "tokens", "--split", "train", "--config", str(cfg_file), "--json"])
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert all(set(x) >= {"row_id", "input_ids", "loss_mask", "source"} for x in lines)
    trained = {tok.decode([t for t, m in zip(x["input_ids"], x["loss_mask"]) if m]): x["source"] for x in lines}
    assert trained["<think>\nthe user wants the sum\n</think>\n\nfour<|im_end|>"] == "template"
    assert trained["<think>\nsum\n</think>\n\nfour<|im_end|>"] == "token_ids"  # the stored ids, not a rendering
    assert trained["<think>\nadd\n</think>\n\neight<|im_end|>"] == "template"  # ids of another answer
    assert trained["<think>\ncall the tool\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                   "{\"city\": \"Paris\"}}\n</tool_call><|im_end|>"] == "template"
    assert "<think>\n\n</think>\n\nyes, sure<|im_end|>" in trained  # reasoning unknown: counted below
    ids_row = next(x for x in lines if x["source"] == "token_ids")
    assert ids_row["input_ids"] == prompt + out and ids_row["loss_mask"] == [0] * len(prompt) + [1] * len(out)
    r = runner.invoke(app, ["dataset", "tokens", "--limit", "1", "--config", str(cfg_file)])
    assert r.exit_code == 0 and len(r.stdout.splitlines()) == 1 and "[[" in json.loads(r.stdout)["text"]

    r = runner.invoke(app, ["dataset", "stats", "--tokens", "--config", str(cfg_file), "--json"])
    assert r.exit_code == 0, r.output
    tr = json.loads(r.stdout)["trained"]
    assert tr["rows"] == 5 == tr["tokenized"] and tr["sources"] == {"template": len(lines) - 1, "token_ids": 1}
    assert tr["inexact"] == {"reasoning_unknown": 2, "token_ids_not_the_text": 1}
    kinds = tr["tokens"]
    assert kinds["end_of_turn"] == len(lines)  # one per answer (the multi-turn row is two requests)
    assert kinds["tool_calls"] == len(tok("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
                                          "\"Paris\"}}\n</tool_call>", add_special_tokens=False)["input_ids"])
    assert kinds["reasoning"] > 0 and kinds["content"] > 0
    assert sum(kinds.values()) == sum(sum(x["loss_mask"]) for x in lines)
