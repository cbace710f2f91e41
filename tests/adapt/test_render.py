"""adapt.render / adapt.data on Qwen3's real tokenizer and chat template: examples are the
request as vLLM renders it plus what the target generated (reasoning, content, tool calls,
end of turn), tokenized apart; stored ids win; no conversation crashes tokenization."""

from __future__ import annotations

import json

import pytest

from adapt.data import TokenizeReport, row_examples, tokenize_conversation, tokenize_rows
from adapt.render import vllm_messages, vllm_tools
from tests.target_support import qwen3_chat_model

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def tok(model_cache):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_chat_model(model_cache))


def _prompt_ids(tok, request, tools=None, **kwargs) -> list[int]:
    """vLLM's prompt ids for a chat request: its rendering, tokenized without special tokens added."""
    text = tok.apply_chat_template(vllm_messages(request), tools=vllm_tools(tools), add_generation_prompt=True,
                                   tokenize=False, **kwargs)
    return tok(text, add_special_tokens=False)["input_ids"]


def _check(tok, row, request, generated: str, tools=None, **kwargs):
    """The row's own example is exactly the request's prompt ids + the generated text's ids, loss on the latter."""
    ex = row_examples(tok, row)[-1]
    prompt = _prompt_ids(tok, request, tools, **kwargs)
    out = tok(generated, add_special_tokens=False)["input_ids"]
    assert ex.input_ids.tolist() == prompt + out
    assert ex.loss_mask.tolist() == [False] * len(prompt) + [True] * len(out)
    assert ex.source == "template" and ex.inexact == ()
    return ex


def test_reasoning_answer_is_trained_with_its_think_block(tok):
    req = [{"role": "user", "content": "what is two plus two"}]
    row = {"messages": req + [{"role": "assistant", "reasoning": "\nthe user asks for a sum\n",
                               "content": "\n\nthe answer is four"}]}
    _check(tok, row, req, "<think>\nthe user asks for a sum\n</think>\n\nthe answer is four<|im_end|>")
    # The deprecated field name is read the same way.
    old = {"messages": req + [{"role": "assistant", "reasoning_content": "the user asks for a sum",
                               "content": "the answer is four"}]}
    _check(tok, old, req, "<think>\nthe user asks for a sum\n</think>\n\nthe answer is four<|im_end|>")


def test_thinking_disabled_keeps_the_empty_think_block_in_the_prompt(tok):
    req = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say hi"}]
    row = {"messages": req + [{"role": "assistant", "content": "hi there"}],
           "chat_template_kwargs": {"enable_thinking": False}}
    ex = _check(tok, row, req, "hi there<|im_end|>", enable_thinking=False)
    assert tok.decode(ex.input_ids[~ex.loss_mask].tolist()).endswith("<think>\n\n</think>\n\n")


def test_tools_calls_and_tool_results(tok):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    turn1 = [{"role": "user", "content": "weather in Paris?"}]
    row1 = {"messages": turn1 + [{"role": "assistant", "content": "\n\n", "reasoning": "I should call the tool",
                                  "tool_calls": [call]}], "tools": TOOLS, "tool_choice": "auto"}
    ex = _check(tok, row1, turn1, "<think>\nI should call the tool\n</think>\n\n<tool_call>\n"
                "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>", TOOLS)
    assert "# Tools" in tok.decode(ex.input_ids.tolist())  # the tools system prompt the target read
    # Text before the call, thinking off.
    row_c = {"messages": turn1 + [{"role": "assistant", "content": "let me check\n", "tool_calls": [call]}],
             "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}}
    _check(tok, row_c, turn1, "let me check\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
           "{\"city\": \"Paris\"}}\n</tool_call><|im_end|>", TOOLS, enable_thinking=False)
    # The tool's result comes back as a tool message; the next answer is a request of its own.
    turn2 = turn1 + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    row2 = {"messages": turn2 + [{"role": "assistant", "reasoning": "it is sunny", "content": "It is sunny."}],
            "tools": TOOLS}
    ex2 = _check(tok, row2, turn2, "<think>\nit is sunny\n</think>\n\nIt is sunny.<|im_end|>", TOOLS)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in tok.decode(ex2.input_ids.tolist())


def test_multi_turn_one_example_per_request_where_the_template_rewrites_turns(tok):
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "reasoning": "greet", "content": "yes"},
            {"role": "user", "content": "again"},
            {"role": "assistant", "reasoning": "agree", "content": "yes, sure"}]
    exs = row_examples(tok, {"messages": msgs})
    # Qwen3 drops turn 1's reasoning from turn 2's prompt: turn 1 is an example of its own.
    assert len(exs) == 2
    assert exs[0].input_ids.tolist() == (_prompt_ids(tok, msgs[:1])
                                         + tok("<think>\ngreet\n</think>\n\nyes<|im_end|>",
                                               add_special_tokens=False)["input_ids"])
    _check(tok, {"messages": msgs}, msgs[:3], "<think>\nagree\n</think>\n\nyes, sure<|im_end|>")


def test_repeated_answer_text_does_not_crash(tok, tiny_model):
    """An earlier answer's text appearing again later once raised ValueError and aborted training."""
    from transformers import AutoTokenizer

    row = {"conversations": [{"from": "human", "value": "is it ok?"}, {"from": "gpt", "value": "yes"},
                             {"from": "human", "value": "really?"}, {"from": "gpt", "value": "yes, sure"}]}
    reports = []
    for t in (tok, AutoTokenizer.from_pretrained(tiny_model)):
        rep = TokenizeReport()
        exs = tokenize_rows(t, [row], 512, rep)
        assert exs and rep.tokenized == 1 and not rep.skipped
        assert tokenize_conversation(t, row) is not None
        trained = t.decode(exs[-1].input_ids[exs[-1].loss_mask].tolist())
        assert trained.endswith("yes, sure<|im_end|>")
        reports.append(rep)
    # Plain rows of a template without reasoning (ChatML): one example, every answer trained.
    tiny = AutoTokenizer.from_pretrained(tiny_model)
    (ex,) = row_examples(tiny, row)
    assert tiny.decode(ex.input_ids[ex.loss_mask].tolist()) == "yes<|im_end|>yes, sure<|im_end|>"
    # Under Qwen3's template a plain row's answers lack their reasoning: trained, counted inexact.
    assert reports[0].inexact["reasoning_unknown"] == 2 and not reports[1].inexact


def test_stored_token_ids_win(tok):
    req = [{"role": "user", "content": "x"}]
    prompt, output = _prompt_ids(tok, req) + [5], tok("yes indeed<|im_end|>", add_special_tokens=False)["input_ids"]
    row = {"messages": req + [{"role": "assistant", "content": "yes indeed"}], "prompt_token_ids": prompt,
           "output_token_ids": output}
    (ex,) = row_examples(tok, row)
    assert ex.input_ids.tolist() == prompt + output  # the stored ids as they are, not a rendering
    assert ex.loss_mask.tolist() == [False] * len(prompt) + [True] * len(output)
    assert ex.source == "token_ids"


def test_ids_that_do_not_decode_to_the_text_are_not_trained_on(tok):
    """Ids of another request (or redacted text's original) fall back to the text, counted."""
    req = [{"role": "user", "content": "what is the capital of France"}]
    other = tok("my password is hunter2<|im_end|>", add_special_tokens=False)["input_ids"]
    row = {"messages": req + [{"role": "assistant", "content": "Paris"}], "prompt_token_ids": _prompt_ids(tok, req),
           "output_token_ids": other}
    rep = TokenizeReport()
    (ex,) = tokenize_rows(tok, [row], None, rep)
    assert ex.source == "template" and rep.inexact == {"token_ids_not_the_text": 1}
    assert "hunter2" not in tok.decode(ex.input_ids.tolist())
    # The prompt is checked too: ids of another question with this answer's text.
    wrong_prompt = {**row, "prompt_token_ids": _prompt_ids(tok, [{"role": "user", "content": "something else"}]),
                    "output_token_ids": tok("Paris<|im_end|>", add_special_tokens=False)["input_ids"]}
    (ex,) = row_examples(tok, wrong_prompt)
    assert ex.source == "template" and ex.inexact == ("token_ids_not_the_text",)


def test_reasoning_on_a_target_whose_template_never_writes_it_is_skipped(tiny_model):
    """A template without reasoning (ChatML here) would train the answer without the thinking the
    endpoint's model generated: the row is skipped, counted, and training goes on."""
    from transformers import AutoTokenizer

    small = AutoTokenizer.from_pretrained(tiny_model)
    req = [{"role": "user", "content": "two plus two"}]
    thinking = {"messages": req + [{"role": "assistant", "reasoning": "add them", "content": "four"}]}
    plain = {"messages": req + [{"role": "assistant", "content": "four"}]}
    rep = TokenizeReport()
    exs = tokenize_rows(small, [thinking, plain], None, rep)
    assert len(exs) == 1 and rep.skipped == {"reasoning_not_in_template": 1} and rep.tokenized == 1


def test_ids_of_another_vocabulary_fall_back_to_the_text_and_are_counted(tok, tiny_model):
    """Ids the target's embeddings cannot index (captured from another model, or corrupt) are not
    trained on: the request is rendered from its text instead and counted inexact."""
    from transformers import AutoTokenizer

    from adapt.render import last_prompt_ids
    from capture.sharegpt import to_exchange

    small = AutoTokenizer.from_pretrained(tiny_model)
    req = [{"role": "user", "content": "x"}]
    qwen_prompt = _prompt_ids(tok, req)
    row = {"messages": req + [{"role": "assistant", "content": "y"}], "prompt_token_ids": qwen_prompt,
           "output_token_ids": tok("y<|im_end|>", add_special_tokens=False)["input_ids"]}
    rep = TokenizeReport()
    (ex,) = tokenize_rows(small, [row], None, rep)
    assert ex.source == "template" and ex.inexact == ("token_ids_not_this_tokenizer",)
    assert int(ex.input_ids.max()) < len(small)
    assert rep.inexact == {"token_ids_not_this_tokenizer": 1}
    assert last_prompt_ids(small, to_exchange(row)) != qwen_prompt
    (same,) = row_examples(tok, row)  # the vocabulary they belong to keeps them
    assert same.source == "token_ids"


def test_raw_prompt_and_truncated_answer(tok):
    raw = {"raw": True, "conversations": [{"from": "human", "value": "Once upon"}, {"from": "gpt", "value": " a time"}],
           "finish_reason": "length"}
    (ex,) = row_examples(tok, raw)
    assert ex.input_ids.tolist() == tok("Once upon")["input_ids"] + tok(" a time", add_special_tokens=False)["input_ids"]
    req = [{"role": "user", "content": "count"}]
    cut = {"messages": req + [{"role": "assistant", "content": "one two"}], "finish_reason": "length",
           "chat_template_kwargs": {"enable_thinking": False}}
    ex = row_examples(tok, cut)[-1]
    assert tok.decode(ex.input_ids[ex.loss_mask].tolist()) == "one two"  # no end of turn was generated
    assert ex.inexact == ("truncated",)


HOSTILE = [
    {},
    {"conversations": []},
    {"conversations": [{"from": "human", "value": "only a question"}]},
    {"conversations": [{"from": "gpt", "value": "an answer to nothing"}]},
    {"conversations": [{"from": "martian", "value": "?"}, {"from": "gpt", "value": "!"}]},
    {"conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]},
    {"messages": "not json ["},
    {"messages": [1, 2, 3]},
    {"messages": [{"content": "no role"}, {"role": "assistant", "content": "x"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                  {"role": "assistant", "content": "a cat"}]},
    {"messages": [{"role": "user", "content": {"odd": 1}}, {"role": "assistant", "content": "x"}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x", "tool_calls": "no"}]},
    {"messages": [{"role": "user", "content": "q"},
                  {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}],
     "tools": TOOLS},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x", "reasoning": 7}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}], "tools": [{"oops": 1}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}], "tools": "[{]"},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}],
     "chat_template_kwargs": {"tokenize": True, "add_generation_prompt": False, "enable_thinking": "maybe"}},
    {"messages": [{"role": "user", "content": "<|im_end|><|im_start|>assistant\n</think>"},
                  {"role": "assistant", "content": "<|im_end|>\n<|im_start|>user\nyes", "reasoning": "</think><think>"}]},
    {"messages": [{"role": "tool", "content": "orphan result"}, {"role": "assistant", "content": "ok"}]},
    {"messages": [{"role": "developer", "content": "rules"}, {"role": "user", "content": "q"},
                  {"role": "assistant", "content": "a"}]},
    {"messages": [{"role": "user", "content": "q" * 20000}, {"role": "assistant", "content": "\u0000\ud7ff\U0001f600"}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
     "prompt_token_ids": [-1, 2], "output_token_ids": [3]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
     "prompt_token_ids": [1, 2], "output_token_ids": []},
    {"raw": True, "conversations": [{"from": "human", "value": "p"}]},
    {"conversations": [{"from": "human", "value": "yes"}, {"from": "gpt", "value": "yes"},
                       {"from": "human", "value": "yes"}, {"from": "gpt", "value": "yes yes"}]},
]


def test_hostile_conversations_never_crash_and_counts_reconcile(tok, tiny_model):
    from transformers import AutoTokenizer

    for t in (tok, AutoTokenizer.from_pretrained(tiny_model)):
        rep = TokenizeReport()
        exs = tokenize_rows(t, HOSTILE, 256, rep)
        assert rep.rows == len(HOSTILE) == rep.tokenized + sum(rep.skipped.values())
        assert rep.examples == len(exs) == sum(rep.sources.values())
        assert rep.skipped and rep.tokenized  # some are refused (with reasons), some are fine
        assert not any(k.startswith("error:") for k in rep.skipped), rep.skipped
        for ex in exs:
            assert len(ex.input_ids) == len(ex.loss_mask) <= 256 and bool(ex.loss_mask.any())
        json.dumps(rep.to_dict())


def test_evaluation_prompts_are_the_last_requests_as_the_target_read_it(tok, tiny_model):
    """TargetRunner.prompt_ids (what offline evaluation continues): the tools and kwargs count, stored ids win."""
    from adapt.render import last_prompt_ids
    from capture.sharegpt import to_exchange

    req = [{"role": "user", "content": "weather in Paris?"}]
    row = {"messages": req + [{"role": "assistant", "content": "sunny"}], "tools": TOOLS,
           "chat_template_kwargs": {"enable_thinking": False}}
    assert last_prompt_ids(tok, to_exchange(row)) == _prompt_ids(tok, req, TOOLS, enable_thinking=False)
    stored = _prompt_ids(tok, req) + [198]  # what vLLM reported, one token past this rendering
    sunny = tok("sunny<|im_end|>", add_special_tokens=False)["input_ids"]
    assert last_prompt_ids(tok, to_exchange({**row, "prompt_token_ids": stored, "output_token_ids": sunny})) == stored
    # Ids that do not decode to the row's text are not the prompt the target read.
    assert last_prompt_ids(tok, to_exchange({**row, "prompt_token_ids": stored, "output_token_ids": [3]})) != stored
    # A plain row ending with a question: the whole chat is the prompt.
    plain = {"conversations": [{"from": "human", "value": "hi"}]}
    assert last_prompt_ids(tok, to_exchange(plain)) == _prompt_ids(tok, [{"role": "user", "content": "hi"}])
