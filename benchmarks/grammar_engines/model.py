"""The model that samples the generations and whose decode step the mask costs are compared with."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .schemas import Spec
from .stats import timed


class Model:
    def __init__(self, path: str, gen_dtype: str) -> None:
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        # What samples the --runs generations: a bfloat16 copy by default (3x faster where the CPU has AMX).
        self.sampler = self.model if gen_dtype == "float32" else copy.deepcopy(self.model).to(getattr(torch, gen_dtype))
        self.eos = int(self.tok.eos_token_id)
        self.vocab = int(self.model.config.vocab_size)
        self.special = {i for i, t in self.tok.added_tokens_decoder.items() if t.special}
        self._prefill: dict[str, tuple[Any, torch.Tensor]] = {}

    def prompt(self, spec: Spec) -> list[int]:
        msgs = [{"role": "system", "content": spec.system}, {"role": "user", "content": spec.user}]
        text = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return self.encode(str(text))

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    @torch.inference_mode()
    def prefill(self, spec: Spec) -> tuple[Any, torch.Tensor]:
        """The sampler's KV cache and last logits after the spec's prompt (computed once per spec)."""
        if spec.key not in self._prefill:
            out = self.sampler(torch.tensor([self.prompt(spec)]), use_cache=True)
            self._prefill[spec.key] = (out.past_key_values, out.logits[:, -1, :].float())
        return self._prefill[spec.key]

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, cache: Any, sampler: bool = True) -> torch.Tensor:
        model = self.sampler if sampler else self.model
        return model(tokens.view(-1, 1), past_key_values=cache, use_cache=True).logits[:, -1, :].float()

    @torch.inference_mode()
    def decode_step_ms(self, batch: int, context: int, steps: int, sampler: bool = False) -> list[float]:
        """`steps` decode steps of `batch` sequences over a `context`-token KV cache (after two warm-up steps)."""
        ids = torch.randint(1000, 40000, (1, context), generator=torch.Generator().manual_seed(0))
        cache = (self.sampler if sampler else self.model)(ids, use_cache=True).past_key_values
        cache.batch_repeat_interleave(batch)
        x = torch.randint(1000, 40000, (batch,))
        times = [timed(self.step, x, cache, sampler)[0] * 1e3 for _ in range(steps + 2)]
        return times[2:]
