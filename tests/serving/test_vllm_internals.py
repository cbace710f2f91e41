"""serving.vllm_internals: an internal that supported vLLM minors keep in different modules is found in either,
and one found in none is named with every place looked at (stdlib stand-ins: importing vLLM costs tens of
seconds; the real table against the installed vLLM is checked by tests/app/test_doctor.py)."""

from __future__ import annotations

import pytest

from serving.vllm_internals import INTERNALS, SERVE_CHECKS, SERVE_PARSER, Internal, check, resolve


def test_an_internal_moved_between_supported_minors_is_found_where_this_one_keeps_it():
    import json.decoder

    newer_layout = Internal("in the newer module", "json.decoder", "JSONDecoder.decode", also=("json.no_such",))
    older_layout = Internal("in the older module", "json.no_such", "JSONDecoder.decode", also=("json.decoder",))
    assert resolve(newer_layout) is resolve(older_layout) is json.decoder.JSONDecoder.decode
    gone = Internal("moved again", "json.no_such", "JSONDecoder.decode", also=("json.no_such_either",))
    with pytest.raises(ModuleNotFoundError, match="none of json.no_such, json.no_such_either"):
        resolve(gone)
    assert check((gone,))["moved again"].startswith("missing: ModuleNotFoundError: none of json.no_such")
    # A module that exists but lost the object is not looked for elsewhere: the first module that imports decides.
    renamed = Internal("renamed", "json.decoder", "JSONDecoder.decode_v2", also=("json.scanner",))
    with pytest.raises(AttributeError):
        resolve(renamed)


def test_vllm_serve_parser_is_looked_for_in_0_33s_module_then_0_32s():
    for it in (SERVE_PARSER, SERVE_CHECKS):
        assert it in INTERNALS
        assert (it.module, *it.also) == ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args")
