"""headspec.validate: what a head directory may not be (missing, misshapen, broken or tampered tensors,
impossible configs, pickle and code files, fields that load code), and what it may be (degenerate but
well formed, its declared float dtype, attention biases)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from headspec.errors import HeadError
from headspec.files import sha256_file
from headspec.validate import validate_head


@pytest.fixture
def copy(random_head, tmp_path) -> Path:
    """A copy of the session's random head, to break."""
    dst = tmp_path / "h"
    shutil.copytree(random_head, dst)
    return dst


def _rewrite(d: Path, edit, fix_manifest: bool = True) -> None:
    t = load_file(d / "model.safetensors")
    edit(t)
    save_file(t, d / "model.safetensors")
    if fix_manifest:
        m = json.loads((d / "manifest.json").read_text())
        m["sha256"] = sha256_file(d / "model.safetensors")
        (d / "manifest.json").write_text(json.dumps(m))


def test_missing_tensor(copy, tiny_model):
    _rewrite(copy, lambda t: t.pop("fc.weight"))
    with pytest.raises(HeadError, match=r"missing tensors: fc\.weight"):
        validate_head(copy, tiny_model)


def test_wrong_shape(copy, tiny_model):
    _rewrite(copy, lambda t: t.__setitem__("lm_head.weight", torch.zeros(100, 128, dtype=torch.bfloat16)))
    with pytest.raises(HeadError, match=r"wrong shapes: lm_head\.weight: \(100, 128\) != expected \(256, 128\)"):
        validate_head(copy, tiny_model)


def test_wrong_target_hidden_and_vocab(random_head, tmp_path):
    fake = tmp_path / "target"
    fake.mkdir()
    (fake / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "hidden_size": 576, "vocab_size": 49152}))
    with pytest.raises(HeadError, match="target_hidden_size 128 != target hidden_size 576.*vocab_size 512 != target vocab_size 49152"):
        validate_head(random_head, fake)


def test_aux_layer_out_of_range(copy, tiny_model):
    cfg = json.loads((copy / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 9]
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HeadError, match=r"aux layer ids \[9\] out of range for a 4-layer target"):
        validate_head(copy, tiny_model)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "extra.pt", "optimizer.pth", "state.pkl"])
def test_pickle_file_rejected(copy, tiny_model, name):
    (copy / name).write_bytes(b"\x80\x04K\x01.")
    with pytest.raises(HeadError, match=f"pickle files are not allowed.*{name}"):
        validate_head(copy, tiny_model)


def test_tampered_weights(copy, tiny_model):
    _rewrite(copy, lambda t: t["norm.weight"].mul_(2), fix_manifest=False)
    with pytest.raises(HeadError, match="sha256 .* does not match manifest"):
        validate_head(copy, tiny_model)


# -- what a head's config may not say, and the tensors it may not hold -------------------------

def _edit_config(d: Path, edit, name: str = "config.json") -> None:
    cfg = json.loads((d / name).read_text())
    edit(cfg)
    (d / name).write_text(json.dumps(cfg))


def _set(**kv):
    return lambda c: c.update(kv)


def _rope_theta(v):
    def edit(c):
        c["rope_theta"] = v
        c["rope_parameters"]["rope_theta"] = v
    return edit


def _drop_head_dim(**kv):
    def edit(c):
        c.pop("head_dim")
        c.update(kv)
    return edit


@pytest.mark.parametrize("edit, message", [
    (_rope_theta(float("nan")), r"rope_theta nan must be a finite number > 0"),
    (_rope_theta(float("inf")), r"rope_theta inf must be a finite number > 0"),
    (_rope_theta(0), r"rope_theta 0\.0 must be a finite number > 0"),
    (_set(rms_norm_eps=-1e-5), r"rms_norm_eps -1e-05 must be a finite number > 0"),
    (_set(rms_norm_eps=0.0), r"rms_norm_eps 0\.0 must be a finite number > 0"),
    (_set(rms_norm_eps=float("nan")), r"rms_norm_eps nan must be a finite number > 0"),
    (_drop_head_dim(num_attention_heads=3), r"hidden_size 128 is not divisible by num_attention_heads 3"),
    (_set(num_key_value_heads=3), r"num_key_value_heads 3 does not divide num_attention_heads 2"),
    (_set(head_dim=63), r"head_dim 63 must be even"),
    (_set(vocab_size=0), r"vocab_size 0 must be >= 1"),
    (_set(draft_vocab_size=-5), r"draft_vocab_size -5 must be >= 1"),
    (_set(draft_vocab_size=1000), r"draft_vocab_size 1000 > vocab_size 512"),
    (_set(num_speculative_tokens=0), r"num_speculative_tokens 0 must be >= 1"),
    (_set(intermediate_size=-1), r"intermediate_size -1 must be >= 1"),
    (_set(num_hidden_layers=0), r"num_hidden_layers 0 must be >= 1"),
    (_set(max_position_embeddings=0), r"max_position_embeddings 0 must be >= 1"),
    (_set(ptd_token_id=512), r"ptd_token_id 512 outside the vocab \[0, 512\)"),
    (lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 1, 3]),
     r"aux layer ids \[1, 1, 3\] must be distinct and ascending"),
    (lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[-1, 2, 3]),
     r"aux layer ids \[-1, 2, 3\] must be >= 0"),
    (lambda c: c.update(rope_parameters={"rope_theta": 1e4, "rope_type": "linear", "factor": 0}),
     r"rope scaling factor 0 must be a finite number > 0"),
    (_set(hidden_size="128"), r"hidden_size must be an integer, got '128'"),
    (_set(intermediate_size=256.5), r"intermediate_size must be an integer, got 256\.5"),
    (_set(attention_bias="false"), r"attention_bias must be true or false, got 'false'"),
    (_set(torch_dtype="int8", dtype="int8"), r"declares dtype 'int8', not one of bfloat16, float16, float32"),
    (_set(torch_dtype="float16"), r"must declare one weight dtype.*'bfloat16'.*'float16'"),
    (lambda c: [c.pop("torch_dtype"), c.pop("dtype")], r"must declare one weight dtype in torch_dtype/dtype, got none"),
])
def test_impossible_config_refused(copy, edit, message):
    """Checked without a target: these are wrong whatever the head is served with."""
    _edit_config(copy, edit)
    with pytest.raises(HeadError, match=message):
        validate_head(copy)


@pytest.mark.parametrize("manifest_k, config_k, message", [
    (0, 3, r"num_speculative_tokens must be one integer >= 1, got manifest\.json 0, config\.json 3"),
    (4, 3, r"num_speculative_tokens must be one integer >= 1, got manifest\.json 4, config\.json 3"),
])
def test_num_speculative_tokens_refused(copy, manifest_k, config_k, message):
    _edit_config(copy, _set(num_speculative_tokens=manifest_k), "manifest.json")
    _edit_config(copy, _set(num_speculative_tokens=config_k))
    with pytest.raises(HeadError, match=message):
        validate_head(copy)


def _poke(name, value, index=0):
    def edit(t):
        t[name].view(-1)[index] = value
    return edit


def _zero(name):
    return lambda t: t[name].zero_()


def _cast(name, dtype):
    return lambda t: t.__setitem__(name, t[name].to(dtype))


def _shift_t2d(t):
    """Same number of marked tokens as the draft vocab, but not the ones d2t maps to."""
    t["t2d"] = torch.roll(t["t2d"], 1)


@pytest.mark.parametrize("edit, message", [
    (_poke("fc.weight", float("nan"), 7), r"fc\.weight has 1 NaN/Inf of 49152 values"),
    (_poke("lm_head.weight", float("inf")), r"lm_head\.weight has 1 NaN/Inf"),
    (_poke("mask_hidden", float("-inf"), 5), r"mask_hidden has 1 NaN/Inf"),
    (_poke("norm.weight", float("nan")), r"norm\.weight has 1 NaN/Inf"),
    (_zero("fc.weight"), r"fc\.weight is all zeros"),
    (_zero("layers.0.self_attn.q_proj.weight"), r"layers\.0\.self_attn\.q_proj\.weight is all zeros"),
    (_zero("embed_tokens.weight"), r"embed_tokens\.weight is all zeros"),
    (_cast("fc.weight", torch.int8), r"fc\.weight is int8, config\.json declares bfloat16"),
    (_cast("fc.weight", torch.float16), r"fc\.weight is float16, config\.json declares bfloat16"),
    (_cast("lm_head.weight", torch.float32), r"lm_head\.weight is float32, config\.json declares"),
    (_cast("d2t", torch.float32), r"d2t is float32, must be an integer tensor"),
    (_cast("t2d", torch.int64), r"t2d is int64, must be a bool mask"),
    (_shift_t2d, r"t2d marks 256 tokens, not exactly the 256 draft tokens d2t maps to"),
])
def test_broken_tensor_refused(copy, tiny_model, edit, message):
    _rewrite(copy, edit)
    with pytest.raises(HeadError, match=message):
        validate_head(copy, tiny_model)


@pytest.mark.parametrize("where, edit, message", [
    ("config.json", _set(auto_map={"AutoModel": "modeling_x.Drafter"}), r"config\.json: auto_map"),
    ("config.json", _set(trust_remote_code=True), r"config\.json: trust_remote_code"),
    ("config.json", _set(custom_pipelines={"x": {"impl": "p.P"}}), r"config\.json: custom_pipelines"),
    ("config.json", lambda c: c["eagle_config"].update(auto_map={"AutoConfig": "c.C"}),
     r"config\.json: eagle_config\.auto_map"),
    ("config.json", _set(tokenizer_class="tok.MyTokenizer"), r"tokenizer_class='tok\.MyTokenizer'"),
    ("tokenizer_config.json", _set(auto_map={"AutoTokenizer": ["tok.T", None]}), r"tokenizer_config\.json: auto_map"),
    ("processor_config.json", _set(processor_class="org/repo--proc.Proc"),
     r"processor_config\.json: processor_class='org/repo--proc\.Proc'"),
])
def test_code_loading_field_refused(copy, where, edit, message):
    if not (copy / where).exists():
        (copy / where).write_text("{}")
    _edit_config(copy, edit, where)
    with pytest.raises(HeadError, match="fields that load custom code are not allowed.*" + message):
        validate_head(copy)


@pytest.mark.parametrize("name", ["modeling_drafter.py", "sub/helper.py"])
def test_code_file_refused(copy, name):
    (copy / name).parent.mkdir(exist_ok=True)
    (copy / name).write_text("import os\n")
    with pytest.raises(HeadError, match=f"code files are not allowed in a head: {name}"):
        validate_head(copy)


def test_degenerate_but_well_formed_heads_stay_valid(copy, tiny_model):
    """What the all-zero rule must let through: an imported head's zero mask_hidden,
    zero norm vectors (the serving tests' constant-draft head) and a stock tokenizer class."""
    _rewrite(copy, lambda t: [t[n].zero_() for n in ("mask_hidden", "norm.weight", "layers.0.input_layernorm.weight")])
    _edit_config(copy, _set(tokenizer_class="LlamaTokenizerFast"))
    validate_head(copy, tiny_model)


@pytest.mark.parametrize("dtype, name", [(torch.float16, "float16"), (torch.float32, "float32")])
def test_head_in_its_declared_float_dtype_is_valid(copy, tiny_model, dtype, name):
    _rewrite(copy, lambda t: t.update({k: v.to(dtype) for k, v in t.items() if v.is_floating_point()}))
    _edit_config(copy, _set(torch_dtype=name, dtype=name))
    validate_head(copy, tiny_model)


def test_head_with_attention_bias_is_valid(tiny_model, tmp_path):
    """init_from_target zeroes the biases: a head written with them validates."""
    from adapt.checkpoint import _target_embeddings, save_head
    from adapt.drafter import PEagleDrafter
    from headspec.config import DrafterConfig

    cfg = DrafterConfig.from_target(tiny_model, 3, 256)
    cfg.attention_bias = True
    model = PEagleDrafter(cfg)
    model.init_from_target(_target_embeddings(tiny_model))
    out = save_head(model, tmp_path / "bias", target_dir=tiny_model)
    assert torch.count_nonzero(load_file(out / "model.safetensors")["layers.0.self_attn.q_proj.bias"]) == 0
    assert validate_head(out, tiny_model).config.attention_bias
