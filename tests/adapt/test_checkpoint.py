"""Head directories written and read by adapt.checkpoint: what vLLM loads, round trip, foreign-format
import, and the offline acceptance machinery (no vLLM server here). What validation refuses is
tests/headspec/test_validate.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapt.checkpoint import import_head, load_head
from adapt.drafter import propose
from evaluation.offline import draft_all_positions, simulate
from headspec.errors import HeadError
from headspec.files import sha256_file
from headspec.validate import validate_head
from tests.peagle_support import write_published_peagle_head


def _inputs(cfg, n=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        input_ids=torch.randint(0, cfg.vocab_size, (1, n), generator=g),
        positions=torch.arange(n)[None],
        aux_hidden=torch.randn(1, n, cfg.fc_input_size, generator=g),
        is_mask=(torch.arange(n) >= n - 2)[None],
        attn_mask=torch.ones(n, n, dtype=torch.bool).tril()[None],
    )


def test_head_dir_is_what_vllm_loads(random_head, tiny_model):
    cfg = json.loads((random_head / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["draft_vocab_size"] == 256 and cfg["target_hidden_size"] == 128
    assert cfg["ptd_token_id"] == 3  # "<|mask|>" in the tiny tokenizer
    names = set(load_file(random_head / "model.safetensors"))
    assert {"mask_hidden", "d2t", "t2d", "embed_tokens.weight", "fc.weight", "layers.0.hidden_norm.weight",
            "norm.weight", "lm_head.weight"} <= names
    assert sorted(p.name for p in random_head.iterdir()) == ["config.json", "manifest.json", "model.safetensors"]
    info = validate_head(random_head, tiny_model)
    assert info.manifest["target"]["name"] == "tiny-llama" and info.manifest["parent"] is None


def test_round_trip_keeps_the_function(random_head, tmp_path):
    from adapt.checkpoint import save_head

    model, _ = load_head(random_head)
    x = _inputs(model.config)
    again, _ = load_head(save_head(model, tmp_path / "again", {"parent": "abc"}))
    assert torch.equal(model(**x), again(**x))
    assert torch.equal(again.d2t, model.d2t)


def test_import_vllm_style_midlayer_without_embeddings(random_head, tiny_model, tmp_path):
    """EAGLE-3 release layout: ``midlayer.*`` names, no embed_tokens, no manifest."""
    src = tmp_path / "src"
    src.mkdir()
    t = load_file(random_head / "model.safetensors")
    t.pop("embed_tokens.weight")
    save_file({k.replace("layers.0.", "midlayer."): v for k, v in t.items()}, src / "model.safetensors")
    cfg = json.loads((random_head / "config.json").read_text())
    cfg.pop("num_speculative_tokens")
    (src / "config.json").write_text(json.dumps(cfg))
    out = import_head(src, tiny_model, tmp_path / "imported", k=4)
    info = validate_head(out, tiny_model)
    assert info.num_speculative_tokens == 4
    assert info.manifest["imported_from"]["format"] == "vllm-eagle3"
    a, _ = load_head(random_head)
    b, _ = load_head(out)
    x = _inputs(a.config)
    assert torch.equal(a(**x), b(**x))  # the random head's embeddings are the target's


def test_import_speculators_peagle(random_head, tiny_model, tmp_path):
    src = tmp_path / "spec"
    src.mkdir()
    t = load_file(random_head / "model.safetensors")
    save_file({("model." + k if k.startswith("layers") else k): v for k, v in t.items()}, src / "model.safetensors")
    vcfg = json.loads((random_head / "config.json").read_text())
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
    a, _ = load_head(random_head)
    b, _ = load_head(out)
    assert not b.config.norm_before_residual
    x = _inputs(a.config)
    assert torch.equal(a(**x), b(**x))


def test_import_speculators_eagle3_defaults_norm_before_residual(random_head, tiny_model, tmp_path):
    src = tmp_path / "spec3"
    src.mkdir()
    t = load_file(random_head / "model.safetensors")
    t.pop("mask_hidden")
    save_file(t, src / "model.safetensors")
    vcfg = json.loads((random_head / "config.json").read_text())
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


def test_all_step_drafts_equal_per_step_passes(random_head, tiny_model):
    """The one-pass draft of every step equals vLLM's per-step pass (build_draft_inputs)."""
    from adapt.hidden_states import TargetRunner

    model, _ = load_head(random_head)
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
