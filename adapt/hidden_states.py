"""Run the target model the way vLLM feeds an EAGLE-3 drafter.

vLLM (``_maybe_add_hidden_state`` in model_executor/models/interfaces.py) records
aux layer id L as ``hidden_states + residual`` at the *input* of decoder layer L,
i.e. transformers' ``output_hidden_states[L]``; L == num_layers is the pre-norm
output of the last layer (transformers' last entry is post-norm, so it is
captured with a hook on the final norm instead). Aux states are concatenated in
ascending layer order, as vLLM sorts the ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from adapt.device import pick_device
from capture.sharegpt import to_messages

@dataclass
class TargetOutput:
    input_ids: torch.Tensor  # Long[N]
    assistant_mask: torch.Tensor  # Bool[N]: token produced by an assistant turn
    aux_hidden: torch.Tensor  # [N, n_aux*H]
    logits: torch.Tensor | None  # [N, V] float32 (next-token logits at each position)


class TargetRunner:
    """A transformers copy of the target that returns drafter inputs and distillation targets."""

    def __init__(self, target_dir: str | Path, aux_layer_ids: Sequence[int], device: str = "auto",
                 dtype: torch.dtype = torch.bfloat16) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.target_dir = Path(target_dir)
        self.device = pick_device(device)
        self.dtype = dtype
        self.tokenizer = AutoTokenizer.from_pretrained(self.target_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.target_dir, dtype=dtype).to(self.device).eval()
        self.num_layers = self.model.config.num_hidden_layers
        ids = sorted(set(int(i) for i in aux_layer_ids))
        if not ids or ids[0] < 0 or ids[-1] > self.num_layers:
            raise ValueError(f"aux layer ids {list(aux_layer_ids)} out of range for a {self.num_layers}-layer target")
        self.aux_layer_ids = ids
        self._prenorm: torch.Tensor | None = None
        self._final: torch.Tensor | None = None
        if self.num_layers in ids:
            self.model.model.norm.register_forward_pre_hook(self._grab_prenorm)
        self.model.model.norm.register_forward_hook(self._grab_final)

    def _grab_prenorm(self, _module, args):
        self._prenorm = args[0]

    def _grab_final(self, _module, _args, output):
        self._final = output

    # --- tokenisation -------------------------------------------------------

    def render(self, row: dict[str, Any] | list[dict[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids of the whole conversation and a mask of assistant-produced tokens.

        The mask comes from rendering growing prefixes, so it is exact for any
        template that renders a prefix of the conversation as a prefix of the text.
        """
        msgs = row if isinstance(row, list) else to_messages(row)
        tok = self.tokenizer
        ids: list[int] = []
        mask: list[bool] = []
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                # Everything up to and including the generation prompt is context.
                head = tok.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True)
                done = tok.apply_chat_template(msgs[: i + 1], tokenize=False)
                ids, mask = self._extend(ids, mask, head, False)
                ids, mask = self._extend(ids, mask, done, True)
            else:
                text = tok.apply_chat_template(msgs[: i + 1], tokenize=False)
                ids, mask = self._extend(ids, mask, text, False)
        return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)

    def _extend(self, ids, mask, text, flag):
        new = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if new[: len(ids)] != ids:
            raise ValueError("chat template is not prefix-stable; cannot derive the assistant mask")
        return new, mask + [flag] * (len(new) - len(ids))

    def prompt_ids(self, row: dict[str, Any] | list[dict[str, str]]) -> list[int]:
        """Prompt for the last assistant turn (or the whole chat when it ends with a user turn)."""
        msgs = row if isinstance(row, list) else to_messages(row)
        last_asst = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
        ctx = msgs[:last_asst] if last_asst is not None else msgs
        text = self.tokenizer.apply_chat_template(ctx, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    # --- forward --------------------------------------------------------------

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, with_logits: bool = True,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Aux hidden [N, n_aux*H] and next-token logits [N, V] (float32) for one sequence.

        ``rows`` (Long[R]) limits the logits to those positions ([R, V]): the
        output layer over the full vocabulary is a fifth of a small target's forward.
        """
        ids = input_ids.to(self.device).view(1, -1)
        if not with_logits:
            keep = 1  # the model always scores some rows: one is the least
        elif rows is None:
            keep = 0  # all
        else:
            keep = rows.to(self.device)
        out = self.model(input_ids=ids, output_hidden_states=True, use_cache=False, logits_to_keep=keep)
        parts = []
        for L in self.aux_layer_ids:
            parts.append(self._prenorm if L == self.num_layers else out.hidden_states[L])
        aux = torch.cat([p[0] for p in parts], dim=-1)
        logits = out.logits[0].float() if with_logits else None
        return aux, logits

    def final_hidden(self) -> torch.Tensor:
        """[N, H]: the last :meth:`forward`'s final-norm output, the input of the target's output layer."""
        if self._final is None:
            raise RuntimeError("final_hidden() before forward()")
        return self._final[0]

    def run(self, row: dict[str, Any], with_logits: bool = True) -> TargetOutput:
        ids, mask = self.render(row)
        aux, logits = self.forward(ids, with_logits)
        return TargetOutput(ids, mask, aux, logits)

    def run_many(self, rows: Iterable[dict[str, Any]], with_logits: bool = True) -> Iterable[TargetOutput]:
        for row in rows:
            yield self.run(row, with_logits)

    @torch.no_grad()
    def greedy(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()) -> list[int]:
        """Greedy continuation with a KV cache, stopping after a stop id (EOS is never suppressed)."""
        ids = torch.tensor([list(prompt_ids)], device=self.device)
        out = self.model(input_ids=ids, use_cache=True)
        new: list[int] = []
        while len(new) < max_new_tokens:
            nxt = int(out.logits[0, -1].argmax())
            new.append(nxt)
            if nxt in stop_ids:
                break
            out = self.model(input_ids=torch.tensor([[nxt]], device=self.device),
                             past_key_values=out.past_key_values, use_cache=True)
        return new
