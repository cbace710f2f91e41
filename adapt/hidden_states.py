"""Run the target model the way vLLM feeds an EAGLE-3 drafter.

vLLM (``_maybe_add_hidden_state`` in model_executor/models/interfaces.py) records
aux layer id L as ``hidden_states + residual`` at the *input* of decoder layer L,
i.e. transformers' ``output_hidden_states[L]``; L == num_layers is the pre-norm
output of the last layer (transformers' last entry is post-norm, so it is
captured with a hook on the final norm instead). Aux states are concatenated in
ascending layer order, as vLLM sorts the ids. They are captured with hooks at the
inputs of those layers, so a forward keeps only the layers it needs, not all of them.

A target too large for one GPU is spread over the visible GPUs (``device_map``,
see :func:`adapt.device.target_device_map`); what the runner returns is gathered
on its ``device`` either way. :meth:`TargetRunner.forward_batch` runs many
sequences in one forward (right-padded, with an attention mask).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from adapt.device import decode_threads, pick_device
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
                 dtype: torch.dtype = torch.bfloat16, device_map: str | dict[str, Any] | None = None) -> None:
        """``device_map`` (transformers' ``from_pretrained``, e.g. "auto") spreads the target's layers over
        several devices; without it the whole target sits on ``device``. Outputs land on ``device``."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.target_dir = Path(target_dir)
        self.device = pick_device(device)
        self.dtype = dtype
        self.tokenizer = AutoTokenizer.from_pretrained(self.target_dir)
        if device_map is None:
            self.model = AutoModelForCausalLM.from_pretrained(self.target_dir, dtype=dtype).to(self.device).eval()
        else:
            self.model = AutoModelForCausalLM.from_pretrained(self.target_dir, dtype=dtype,
                                                              device_map=device_map).eval()
        # transformers records the placement only when it spans several devices.
        self.device_map = getattr(self.model, "hf_device_map", device_map) if device_map is not None else None
        # Where input ids must go: the embedding's device (the first of a spread target's).
        self.input_device = self.model.get_input_embeddings().weight.device
        self.num_layers = self.model.config.num_hidden_layers
        ids = sorted(set(int(i) for i in aux_layer_ids))
        if not ids or ids[0] < 0 or ids[-1] > self.num_layers:
            raise ValueError(f"aux layer ids {list(aux_layer_ids)} out of range for a {self.num_layers}-layer target")
        self.aux_layer_ids = ids
        self._aux: dict[int, torch.Tensor] = {}
        self._final: torch.Tensor | None = None
        self._capture = False
        for L in ids:
            if L == self.num_layers:
                self.model.model.norm.register_forward_pre_hook(self._grabber(L))
            else:
                self.model.model.layers[L].register_forward_pre_hook(self._grabber(L))
        self.model.model.norm.register_forward_hook(self._grab_final)

    def _grabber(self, layer: int):
        def grab(_module, args):
            if self._capture:
                self._aux[layer] = args[0]
        return grab

    def _grab_final(self, _module, _args, output):
        if self._capture:
            self._final = output

    def _run(self, **kwargs: Any) -> Any:
        """The target's forward with its aux states and final-norm output captured."""
        self._aux, self._final = {}, None
        self._capture = True
        try:
            return self.model(use_cache=False, **kwargs)
        finally:
            self._capture = False

    def _aux_states(self) -> torch.Tensor:
        """[B, L, n_aux*H] of the last forward, on ``device``."""
        return torch.cat([self._aux[L].to(self.device) for L in self.aux_layer_ids], dim=-1)

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
        """Prompt for the last assistant turn (or the whole chat when it ends with a user turn), as the
        target read it: a captured row's stored prompt ids, else rendered as vLLM renders the request
        (its tools and chat_template_kwargs included; :mod:`adapt.render`)."""
        from adapt.render import last_prompt_ids
        from capture.sharegpt import to_exchange

        return last_prompt_ids(self.tokenizer, to_exchange({"conversations": row} if isinstance(row, list) else row))

    # --- forward --------------------------------------------------------------

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, with_logits: bool = True,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Aux hidden [N, n_aux*H] and next-token logits [N, V] (float32) for one sequence.

        ``rows`` (Long[R]) limits the logits to those positions ([R, V]): the
        output layer over the full vocabulary is a fifth of a small target's forward.
        """
        ids = input_ids.to(self.input_device).view(1, -1)
        if not with_logits:
            keep = 1  # the model always scores some rows: one is the least
        elif rows is None:
            keep = 0  # all
        else:
            keep = rows.to(self.input_device)
        out = self._run(input_ids=ids, logits_to_keep=keep)
        aux = self._aux_states()[0]
        logits = out.logits[0].float().to(self.device) if with_logits else None
        return aux, logits

    @torch.no_grad()
    def forward_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Aux hidden [B, L, n_aux*H] and final-norm output [B, L, H] of right-padded sequences Long[B, L]
        (``attention_mask`` 1 on real tokens): each real position's states are its sequence's alone."""
        self._run(input_ids=input_ids.to(self.input_device), attention_mask=attention_mask.to(self.input_device),
                  logits_to_keep=1)
        return self._aux_states(), self._final.to(self.device)

    def final_hidden(self) -> torch.Tensor:
        """[N, H]: the last :meth:`forward`'s final-norm output, the input of the target's output layer."""
        if self._final is None:
            raise RuntimeError("final_hidden() before forward()")
        return self._final[0].to(self.device)

    def output_layer(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's output layer on final-norm rows [n, H] (on its own device): logits [n, V] on ``device``."""
        layer = self.model.get_output_embeddings()
        return layer(hidden.to(layer.weight.device)).to(self.device)

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
        ids = torch.tensor([list(prompt_ids)], device=self.input_device)
        new: list[int] = []
        with decode_threads(self.device):
            out = self.model(input_ids=ids, use_cache=True)
            while len(new) < max_new_tokens:
                nxt = int(out.logits[0, -1].argmax())
                new.append(nxt)
                if nxt in stop_ids:
                    break
                out = self.model(input_ids=torch.tensor([[nxt]], device=self.input_device),
                                 past_key_values=out.past_key_values, use_cache=True)
        return new

    @torch.no_grad()
    def greedy_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                     stop_ids: Sequence[int] = ()) -> list[list[int]]:
        """:meth:`greedy` for many prompts in one batch (left-padded; each stops after its first stop id)."""
        if not prompts:
            return []
        L = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(prompts), L), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), L), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, L - len(p):] = torch.tensor(list(p), dtype=torch.long)
            mask[i, L - len(p):] = 1
        with decode_threads(self.device):
            out = self.model.generate(input_ids=ids.to(self.input_device), attention_mask=mask.to(self.input_device),
                                      max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                      eos_token_id=list(stop_ids) or None, pad_token_id=pad,
                                      temperature=None, top_p=None, top_k=None)
        new = out[:, L:].tolist()
        stops = set(stop_ids)
        result = []
        for seq in new:
            cut = next((i + 1 for i, t in enumerate(seq) if t in stops), len(seq))
            result.append(seq[:cut])
        return result
