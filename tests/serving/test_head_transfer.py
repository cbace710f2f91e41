"""The swap's proposer lookup: found where vLLM keeps it, frozen heap or not."""

import gc

import pytest
import torch

from serving.head_transfer import find_pd_caches
from serving.vllm_internals import PD_CACHE, PROPOSER_MODEL


class _Proposer:
    """Holds the draft model and its cached fc(mask_hidden) under vLLM's attribute names."""

    def __init__(self, model: torch.nn.Module) -> None:
        setattr(self, PROPOSER_MODEL, model)
        setattr(self, PD_CACHE, torch.zeros(4))


class _Wrapper:
    """A graph wrapper: the proposer holds this, and ``unwrap()`` gives the draft."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model

    def unwrap(self) -> torch.nn.Module:
        return self._model


@pytest.mark.parametrize("wrapped", [False, True])
def test_the_proposer_is_found_directly_and_behind_a_graph_wrapper(wrapped):
    draft = torch.nn.Linear(4, 4)
    proposer = _Proposer(_Wrapper(draft) if wrapped else draft)
    assert find_pd_caches(draft) == [proposer]


def test_the_proposer_is_found_in_a_frozen_heap_which_stays_frozen():
    # vLLM's engine core calls gc.freeze() once started; with the worker in that process (the
    # single-GPU default) the proposer and the draft are frozen when a swap looks for them.
    draft = torch.nn.Linear(4, 4)
    proposer = _Proposer(draft)
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        assert find_pd_caches(draft) == [proposer]
        assert gc.get_freeze_count() >= frozen
    finally:
        gc.unfreeze()
