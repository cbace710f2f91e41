"""targets.model_zoo: the model fixtures it builds (the tiny target, the SmolLM2 cache) load and are built once."""

from __future__ import annotations

import json


def test_tiny_model_loads_and_generates(tiny_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": "write python code"}], add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 8
    assert sum(p.numel() for p in model.parameters()) < 2_000_000


def test_smollm2_cache_is_converted_once_and_verified(smollm2_model):
    from targets import model_zoo

    info = json.loads((smollm2_model / model_zoo.READY_MARKER).read_text())
    assert info["gguf_sha256"] == model_zoo.SMOLLM2_GGUF_SHA256
    cfg = json.loads((smollm2_model / "config.json").read_text())
    assert cfg["hidden_size"] == 576 and cfg["num_hidden_layers"] == 30
    assert "quantization_config" not in cfg
    assert (smollm2_model / "model.safetensors").stat().st_size > 200_000_000
    mtime = (smollm2_model / "model.safetensors").stat().st_mtime
    assert model_zoo.ensure_smollm2(smollm2_model.parent) == smollm2_model
    assert (smollm2_model / "model.safetensors").stat().st_mtime == mtime  # cached, not rebuilt
