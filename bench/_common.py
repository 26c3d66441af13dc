"""Shared by the bench scripts: model configs, workloads, timing, and the transformers
baselines that tokenfleet is measured against on identical weights (machine facts and
report output: report.py)."""

from __future__ import annotations

import queue
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Hugging Face LlamaConfig kwargs. max_position_embeddings only has to cover prompt + new.
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=688,
        vocab_size=4096,
    ),
    "small": dict(  # ~125M parameters
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
        vocab_size=32000,
    ),
}


def build_checkpoint(name: str, folder: Path, seed: int = 0) -> Any:
    """A seeded random LlamaForCausalLM saved to `folder`; returns the model (fp32, eval).

    No EOS and no tied head, so every generated length is exactly what was asked for.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **MODEL_CONFIGS[name],
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---- workloads --------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    prompt_ids: list[int]
    max_new: int


def uniform_jobs(n: int, prompt_len: int, new: int, vocab: int, seed: int = 1) -> list[Job]:
    """n jobs of identical shape (different token ids): the concurrency sweep."""
    rng = random.Random(seed)
    return [Job([rng.randrange(3, vocab) for _ in range(prompt_len)], new) for _ in range(n)]


def mixed_jobs(
    n: int, prompt_range: tuple[int, int], new_range: tuple[int, int], vocab: int, seed: int = 2
) -> list[Job]:
    """n jobs with seeded prompt lengths and max_new_tokens drawn uniformly from the ranges."""
    rng = random.Random(seed)
    jobs = []
    for _ in range(n):
        length = rng.randint(*prompt_range)
        new = rng.randint(*new_range)
        jobs.append(Job([rng.randrange(3, vocab) for _ in range(length)], new))
    return jobs


# ---- transformers baselines -------------------------------------------------------------


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
    with torch.inference_mode():
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


def hf_one_by_one(model: Any, jobs: list[Job]) -> list[list[int]]:
    return [hf_generate(model, [job])[0] for job in jobs]


class HFContinuous:
    """transformers' own continuous batching manager, started once and reused."""

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
