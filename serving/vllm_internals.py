"""Every piece of vLLM the project uses beyond its public serving CLI, named once, checked by `adapt doctor`.

The in-place head swap (``serving.head_transfer``) and the engine-embedding agent (``serving.embedded``,
which every replica the project starts runs in) use vLLM's public weight-update protocol and its
weight-transfer plugin point, but also a few internals: a private registry, the proposer found by a
``gc`` referrer walk and the attribute names it is recognised by, the layerwise reload, and the
launcher functions ``vllm serve`` is built from. They are listed in :data:`INTERNALS` (``module`` and
a dotted ``path`` that must exist; when ``needle`` is set, the object's source must mention it: an
instance attribute set in ``__init__``), and the code that uses one takes its name from here. A vLLM
where one has changed fails ``adapt doctor`` with the entry's name; nothing falls back silently.

The supported vLLM minors (0.32, and 0.33 in the GPU lock) keep one object in different modules at
most: such an entry names the newest module first and the older one in ``also``, each the place a
supported release holds it (0.33 moved `vllm serve`'s parser and checks from
``vllm.entrypoints.launchers.cli_args`` to ``vllm.entrypoints.common.cli_args``), and the code that
uses it loads it through :func:`resolve` (:func:`serve_parser`), so the two never disagree.

Nothing here imports vLLM at module import time.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

# Attribute names the head-transfer engine relies on (vLLM's, not ours).
PD_CACHE = "parallel_drafting_hidden_state_tensor"  # the proposer's cached fc(mask_hidden)
PROPOSER_MODEL = "model"  # the proposer holds its draft model as self.model
AUX_HIDDEN = "eagle3_use_aux_hidden_state"  # whether the proposer combines hidden states before fc
DEFAULT_MODEL = "_default_model"  # a weight-transfer engine's target model (self.model is the draft in a draft update)
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # opens /collective_rpc, weight-update, sleep and cache routes: never set


@dataclass(frozen=True)
class Internal:
    """A vLLM object the project uses: ``module``'s ``path`` (dotted attributes) must exist and, when
    ``needle`` is set, its source must mention it. ``private``: not part of vLLM's documented API."""

    what: str
    module: str
    path: str
    needle: str | None = None
    private: bool = False
    # Where an older supported vLLM keeps it (tried in order after ``module``).
    also: tuple[str, ...] = ()


# In vllm.entrypoints.common.cli_args from 0.33, vllm.entrypoints.launchers.cli_args in 0.32.
SERVE_PARSER = Internal("`vllm serve`'s argument parser (the embedded agent parses the replica's line with it)",
                        "vllm.entrypoints.common.cli_args", "make_arg_parser", private=True,
                        also=("vllm.entrypoints.launchers.cli_args",))
SERVE_CHECKS = Internal("`vllm serve`'s argument checks", "vllm.entrypoints.common.cli_args",
                        "validate_parsed_serve_args", private=True, also=("vllm.entrypoints.launchers.cli_args",))

INTERNALS = (
    Internal("the engine client's drafter weight-update protocol (pause, start, update, finish, resume)",
             "vllm.engine.protocol", "EngineClient.start_draft_weight_update"),
    Internal("the weight-update protocol's finish step (weight_version)", "vllm.engine.protocol",
             "EngineClient.finish_weight_update"),
    Internal("weight-transfer engines registered by plugins", "vllm.distributed.weight_transfer",
             "WeightTransferEngineFactory.register_engine"),
    Internal("the weight-transfer factory's registry (WeightTransferEngineFactory._registry): registration is "
             "idempotent per process", "vllm.distributed.weight_transfer", "WeightTransferEngineFactory._registry",
             private=True),
    Internal("a weight-transfer engine's target model (_default_model) beside the draft it updates",
             "vllm.distributed.weight_transfer.base", "WeightTransferEngine", DEFAULT_MODEL, private=True),
    Internal("layerwise reload of the draft model", "vllm.model_executor.model_loader.reload",
             "finalize_layerwise_reload"),
    Internal("the proposer's cached parallel-drafting hidden state", "vllm.v1.spec_decode.llm_base_proposer",
             "SpecDecodeBaseProposer.load_model", PD_CACHE, private=True),
    Internal("the proposer holds its draft model as self.model (found by a gc referrer walk from the draft)",
             "vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer.load_model",
             f"self.{PROPOSER_MODEL} = ", private=True),
    Internal("the proposer's eagle3_use_aux_hidden_state flag", "vllm.v1.spec_decode.llm_base_proposer",
             "SpecDecodeBaseProposer", AUX_HIDDEN, private=True),
    Internal("EAGLE-3 combine_hidden_states", "vllm.model_executor.models.llama_eagle3",
             "Eagle3LlamaForCausalLM.combine_hidden_states"),
    Internal("P-EAGLE's mask_hidden buffer", "vllm.model_executor.models.llama_eagle3", "Eagle3LlamaForCausalLM",
             "mask_hidden"),
    SERVE_PARSER,
    SERVE_CHECKS,
    Internal("vLLM's argument parser class", "vllm.utils.argparse_utils", "FlexibleArgumentParser", private=True),
    Internal("the engine client `vllm serve` builds (the embedded agent holds it)",
             "vllm.entrypoints.launchers.api_server.entry", "build_async_engine_client", private=True),
    Internal("vLLM's OpenAI app (served by the embedded agent, without dev routes)",
             "vllm.entrypoints.launchers.app", "build_app", private=True),
    Internal("the OpenAI app's state", "vllm.entrypoints.launchers.api_server.app_state", "init_app_state",
             private=True),
)


def resolve(it: Internal) -> Any:
    """The object ``it`` names, or an exception saying what is missing (from ``it.module``, else the first
    of ``it.also`` that imports: a module that is absent is the older or newer vLLM's layout)."""
    for module in (it.module, *it.also):
        try:
            obj: Any = importlib.import_module(module)
            break
        except ModuleNotFoundError as exc:
            if exc.name is None or not module.startswith(exc.name):  # a missing dependency, not the module
                raise
            if module == (it.also or (it.module,))[-1]:
                raise ModuleNotFoundError(f"none of {', '.join((it.module, *it.also))} (vLLM moved {it.path}?)",
                                          name=exc.name) from None
    for attr in it.path.split("."):
        obj = getattr(obj, attr)
    if it.needle is not None and it.needle not in inspect.getsource(obj):
        raise LookupError(f"{it.module}.{it.path} no longer mentions {it.needle}")
    return obj


def check(table: tuple[Internal, ...] | None = None) -> dict[str, str]:
    """Each internal of ``table`` (default :data:`INTERNALS`): "ok" or why it is missing."""
    out = {}
    for it in INTERNALS if table is None else table:
        try:
            resolve(it)
            out[it.what] = "ok"
        except Exception as exc:  # noqa: BLE001 - each missing piece is a line of the report
            out[it.what] = f"missing: {type(exc).__name__}: {exc}"
    return out


def serve_parser() -> tuple[Any, Any]:
    """`vllm serve`'s ``make_arg_parser`` and ``validate_parsed_serve_args``, wherever this vLLM keeps them."""
    return resolve(SERVE_PARSER), resolve(SERVE_CHECKS)


def weight_transfer_registry() -> dict[str, Any]:
    """vLLM's private name -> engine table (``register_engine`` raises on a second registration)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    return WeightTransferEngineFactory._registry


def dev_mode_on(env: dict[str, str]) -> bool:
    """Whether ``env`` turns vLLM's dev routes on (vLLM reads the variable as a boolean)."""
    return env.get(DEV_MODE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")
