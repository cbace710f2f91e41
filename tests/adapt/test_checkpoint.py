"""Head directories: round trip, clear errors for bad heads, foreign-format import,
and the offline acceptance machinery (no vLLM server here)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from adapt.checkpoint import import_head, init_random_head, load_head
from adapt.drafter import propose
from evaluation.offline import draft_all_positions, simulate
from headspec.errors import HeadError
from headspec.files import sha256_file
from headspec.validate import validate_head
from tests.peagle_support import write_published_peagle_head


@pytest.fixture(scope="module")
def head(tiny_model, tmp_path_factory) -> Path:
    return init_random_head(tiny_model, tmp_path_factory.mktemp("ckpt") / "head", k=3, draft_vocab_size=256, seed=3)


@pytest.fixture
def copy(head, tmp_path) -> Path:
    dst = tmp_path / "h"
    shutil.copytree(head, dst)
    return dst


def _rewrite(d: Path, edit, fix_manifest: bool = True) -> None:
    t = load_file(d / "model.safetensors")
    edit(t)
    save_file(t, d / "model.safetensors")
    if fix_manifest:
        m = json.loads((d / "manifest.json").read_text())
        m["sha256"] = sha256_file(d / "model.safetensors")
        (d / "manifest.json").write_text(json.dumps(m))


def _inputs(cfg, n=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        input_ids=torch.randint(0, cfg.vocab_size, (1, n), generator=g),
        positions=torch.arange(n)[None],
        aux_hidden=torch.randn(1, n, cfg.fc_input_size, generator=g),
        is_mask=(torch.arange(n) >= n - 2)[None],
        attn_mask=torch.ones(n, n, dtype=torch.bool).tril()[None],
    )


def test_head_dir_is_what_vllm_loads(head, tiny_model):
    cfg = json.loads((head / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["draft_vocab_size"] == 256 and cfg["target_hidden_size"] == 128
    assert cfg["ptd_token_id"] == 3  # "<|mask|>" in the tiny tokenizer
    names = set(load_file(head / "model.safetensors"))
    assert {"mask_hidden", "d2t", "t2d", "embed_tokens.weight", "fc.weight", "layers.0.hidden_norm.weight",
            "norm.weight", "lm_head.weight"} <= names
    assert sorted(p.name for p in head.iterdir()) == ["config.json", "manifest.json", "model.safetensors"]
    info = validate_head(head, tiny_model)
    assert info.manifest["target"]["name"] == "tiny-llama" and info.manifest["parent"] is None


def test_round_trip_keeps_the_function(head, tmp_path):
    from adapt.checkpoint import save_head

    model, _ = load_head(head)
    x = _inputs(model.config)
    again, _ = load_head(save_head(model, tmp_path / "again", {"parent": "abc"}))
    assert torch.equal(model(**x), again(**x))
    assert torch.equal(again.d2t, model.d2t)


def test_missing_tensor(copy, tiny_model):
    _rewrite(copy, lambda t: t.pop("fc.weight"))
    with pytest.raises(HeadError, match=r"missing tensors: fc\.weight"):
        validate_head(copy, tiny_model)


def test_wrong_shape(copy, tiny_model):
    _rewrite(copy, lambda t: t.__setitem__("lm_head.weight", torch.zeros(100, 128, dtype=torch.bfloat16)))
    with pytest.raises(HeadError, match=r"wrong shapes: lm_head\.weight: \(100, 128\) != expected \(256, 128\)"):
        validate_head(copy, tiny_model)


def test_wrong_target_hidden_and_vocab(head, tmp_path):
    fake = tmp_path / "target"
    fake.mkdir()
    (fake / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "hidden_size": 576, "vocab_size": 49152}))
    with pytest.raises(HeadError, match="target_hidden_size 128 != target hidden_size 576.*vocab_size 512 != target vocab_size 49152"):
        validate_head(head, fake)


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


def test_cli_validate_reports_error_as_json(copy, tiny_model):
    from app.cli import app

    (copy / "model.bin").write_bytes(b"x")
    res = CliRunner().invoke(app, ["head", "validate", str(copy), "--target", str(tiny_model), "--json"])
    assert res.exit_code == 1
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["ok"] is False and "pickle" in out["error"]


# --- validation refuses broken heads ------------------------------------------------

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


def test_import_vllm_style_midlayer_without_embeddings(head, tiny_model, tmp_path):
    """EAGLE-3 release layout: ``midlayer.*`` names, no embed_tokens, no manifest."""
    src = tmp_path / "src"
    src.mkdir()
    t = load_file(head / "model.safetensors")
    t.pop("embed_tokens.weight")
    save_file({k.replace("layers.0.", "midlayer."): v for k, v in t.items()}, src / "model.safetensors")
    cfg = json.loads((head / "config.json").read_text())
    cfg.pop("num_speculative_tokens")
    (src / "config.json").write_text(json.dumps(cfg))
    out = import_head(src, tiny_model, tmp_path / "imported", k=4)
    info = validate_head(out, tiny_model)
    assert info.num_speculative_tokens == 4
    assert info.manifest["imported_from"]["format"] == "vllm-eagle3"
    a, _ = load_head(head)
    b, _ = load_head(out)
    x = _inputs(a.config)
    assert torch.equal(a(**x), b(**x))  # the random head's embeddings are the target's


def test_import_speculators_peagle(head, tiny_model, tmp_path):
    src = tmp_path / "spec"
    src.mkdir()
    t = load_file(head / "model.safetensors")
    save_file({("model." + k if k.startswith("layers") else k): v for k, v in t.items()}, src / "model.safetensors")
    vcfg = json.loads((head / "config.json").read_text())
    layer = {k: vcfg[k] for k in ("model_type", "hidden_size", "intermediate_size", "num_attention_heads",
                                  "num_key_value_heads", "head_dim", "num_hidden_layers", "rms_norm_eps",
                                  "rope_theta", "max_position_embeddings", "vocab_size")}
    (src / "config.json").write_text(json.dumps({
        "speculators_model_type": "peagle",
        "transformer_layer_config": layer,
        "draft_vocab_size": 256,
        "target_hidden_size": 128,
        "mask_token_id": 3,
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
        "speculators_config": {"algorithm": "peagle", "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
                               "verifier": {"name_or_path": "tiny"}},
    }))
    out = import_head(src, tiny_model, tmp_path / "imported")
    info = validate_head(out, tiny_model)
    assert info.num_speculative_tokens == 5 and info.manifest["imported_from"]["format"] == "speculators-peagle"
    a, _ = load_head(head)
    b, _ = load_head(out)
    assert not b.config.norm_before_residual
    x = _inputs(a.config)
    assert torch.equal(a(**x), b(**x))


def test_import_speculators_eagle3_defaults_norm_before_residual(head, tiny_model, tmp_path):
    src = tmp_path / "spec3"
    src.mkdir()
    t = load_file(head / "model.safetensors")
    t.pop("mask_hidden")
    save_file(t, src / "model.safetensors")
    vcfg = json.loads((head / "config.json").read_text())
    layer = {k: vcfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                  "head_dim", "num_hidden_layers", "vocab_size")}
    (src / "config.json").write_text(json.dumps({
        "speculators_model_type": "eagle3", "transformer_layer_config": layer, "draft_vocab_size": 256,
        "speculators_config": {"proposal_methods": [{"speculative_tokens": 3}], "verifier": {"name_or_path": "t"}},
    }))
    out = import_head(src, tiny_model, tmp_path / "imported")
    b, man = load_head(out)
    assert b.config.norm_before_residual  # speculators' eagle3 default, as vLLM applies it
    assert b.config.ptd_token_id == 3  # picked from the target tokenizer
    assert torch.count_nonzero(b.mask_hidden) == 0 and man["imported_from"]["notes"]


def test_import_published_peagle_four_layer_head_keeps_its_shapes(tiny_model, tmp_path):
    """A head in the published P-EAGLE layout (speculators peagle, 4 layers, its own inner sizes)."""
    src = write_published_peagle_head(tiny_model, tmp_path / "pub", num_layers=4, k=3)
    out = import_head(src, tiny_model, tmp_path / "imported")
    info = validate_head(out, tiny_model)
    c = info.config
    assert (c.num_layers, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 384, 2, 2, 64)
    assert (c.draft_vocab_size, c.aux_layer_ids, c.ptd_token_id, c.norm_before_residual) == (256, [1, 2, 3], 3, True)
    assert info.num_speculative_tokens == 3 and info.manifest["imported_from"]["format"] == "speculators-peagle"
    vcfg = json.loads((out / "config.json").read_text())
    assert vcfg["num_hidden_layers"] == 4 and vcfg["intermediate_size"] == 384 and vcfg["num_key_value_heads"] == 2
    # Every published tensor is kept as it was (mask_hidden [1,1,n] flattened to vLLM's [1,n]), nothing added.
    a, b = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(a) == set(b)
    assert all(torch.equal(a[k].reshape(b[k].shape), b[k]) for k in a)
    model, _ = load_head(out)
    assert len(model.layers) == 4 and torch.isfinite(model(**_inputs(c))).all()


def test_import_drops_tensors_vllm_never_reads(tiny_model, tmp_path):
    src = write_published_peagle_head(tiny_model, tmp_path / "pub")
    clean = import_head(src, tiny_model, tmp_path / "clean")
    t = load_file(src / "model.safetensors")
    t["verifier_lm_head.weight"] = torch.ones(512, 128, dtype=torch.bfloat16)
    t["verifier_norm.weight"] = torch.ones(128, dtype=torch.bfloat16)
    t["layers.2.hidden_norm.weight"] = torch.ones(128, dtype=torch.bfloat16)  # vLLM-style exports have one per layer
    save_file(t, src / "model.safetensors")
    out = import_head(src, tiny_model, tmp_path / "imported")
    notes = " ".join(validate_head(out, tiny_model).manifest["imported_from"]["notes"])
    assert "verifier_lm_head.weight" in notes and "layers.2.hidden_norm.weight" in notes
    assert sha256_file(out / "model.safetensors") == sha256_file(clean / "model.safetensors")


def test_warm_start_from_an_imported_four_layer_head_keeps_its_shapes(tiny_model, tmp_path):
    from adapt.train import ShapeChangeError, train
    from tests.config_support import make_cfg

    base = import_head(write_published_peagle_head(tiny_model, tmp_path / "pub"), tiny_model, tmp_path / "imported")
    rows = [{"content_hash": f"c{i}", "conversations": [
        {"from": "human", "value": "def return import class"},
        {"from": "gpt", "value": "the of and to in is you that it " * (2 + i % 3)}]} for i in range(8)]

    def cfg(num_layers):
        return make_cfg(tmp_path, state_dir=tmp_path / "s", target={"model": str(tiny_model)},
                        head={"draft_vocab_size": 256, "num_layers": num_layers},
                        training={"max_steps": 3, "batch_tokens": 320, "max_seq_len": 160})

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = train(cfg(4), rows, str(base), tmp_path / "warm", progress=False)
        with pytest.raises(ShapeChangeError, match="num_hidden_layers: head has 4, config asks 1"):
            train(cfg(1), rows, str(base), tmp_path / "bad", progress=False)
    finally:
        torch.set_num_threads(before)
    info, base_info = validate_head(tmp_path / "warm", tiny_model), validate_head(base, tiny_model)
    assert res.steps == 3 and info.manifest["parent"] == base_info.sha256
    wb, ww = load_file(base / "model.safetensors"), load_file(tmp_path / "warm" / "model.safetensors")
    assert {k: v.shape for k, v in wb.items()} == {k: v.shape for k, v in ww.items()}
    assert info.config.intermediate_size == 384 and info.config.norm_before_residual  # the head's, not the target's
    assert not torch.equal(wb["layers.3.mlp.down_proj.weight"], ww["layers.3.mlp.down_proj.weight"])


def test_import_refuses_pickle(tmp_path, tiny_model):
    src = tmp_path / "p"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(HeadError, match="refusing pickle weights"):
        import_head(src, tiny_model, tmp_path / "out")


def test_all_step_drafts_equal_per_step_passes(head, tiny_model):
    """The one-pass draft of every step equals vLLM's per-step pass (build_draft_inputs)."""
    from adapt.hidden_states import TargetRunner

    model, _ = load_head(head)
    runner = TargetRunner(tiny_model, model.config.aux_layer_ids, device="cpu", dtype=torch.float32)
    prompt = runner.tokenizer("def return import class self", add_special_tokens=False)["input_ids"]
    seq = torch.tensor(prompt + runner.greedy(prompt, 12))
    aux, _ = runner.forward(seq, with_logits=False)
    n = len(prompt)
    fast = draft_all_positions(model, seq, aux, n, len(seq))
    slow = torch.tensor([propose(model, seq[:m], aux[:m], int(seq[m])) for m in range(n, len(seq))])
    assert torch.equal(fast, slow)


def test_aux_layers_follow_vllm_semantics(tiny_model):
    """Layer id L = input of decoder layer L; L = num_layers = pre-norm output of the last layer."""
    from adapt.hidden_states import TargetRunner

    r = TargetRunner(tiny_model, [0, 2, 4], device="cpu", dtype=torch.float32)
    ids = torch.tensor(r.tokenizer("the of and", add_special_tokens=False)["input_ids"])
    aux, _ = r.forward(ids, with_logits=False)
    H = 128
    emb = r.model.model.embed_tokens(ids)
    assert torch.allclose(aux[:, :H], emb)
    out = r.model(input_ids=ids[None], output_hidden_states=True)
    assert torch.allclose(aux[:, H:2 * H], out.hidden_states[2][0])
    # Final norm applied to the pre-norm state gives transformers' (post-norm) last entry.
    assert torch.allclose(r.model.model.norm(aux[:, 2 * H:]), out.hidden_states[4][0], atol=1e-5)


def test_simulate_counts_like_vllm():
    # seq: prompt of 2, then tokens 10..17. K=2.
    seq = [1, 2, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    drafts = torch.tensor([
        [11, 12],  # m=2 (sampled 10): both accepted -> m=5
        [0, 0], [0, 0],
        [14, 0],   # m=5 (sampled 13): 1 accepted -> m=7
        [0, 0],
        [0, 16],   # m=7 (sampled 15): 0 accepted -> m=8
        [17, 18],  # m=8 (sampled 16): both -> m=11, generated 9 >= 8: stop
        [0, 0], [0, 0],
    ])
    c = simulate(seq, drafts, prompt_len=2, max_new_tokens=8)
    assert c == {"num_drafts": 4, "num_draft_tokens": 8, "num_accepted_tokens": 5, "accepted_per_pos": [3, 2]}
