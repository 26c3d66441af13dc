"""Shared by the bench scripts: model configs and the seeded random checkpoints built from
them, the workloads (jobs, the requests made of them, the text the quality runs cut
from), and `Stream`, one request's timeline as its client saw it. Imports neither torch
nor transformers until a checkpoint is built (transformers baselines: _hf.py; machine
facts and report output: report.py)."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from report import pct

from tokenfleet.protocol import GenerationRequest

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
    # SmolLM2-135M's shape (its config.json), so timings need no 94 MiB file
    "smollm2-shape": dict(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_theta=100000.0,
    ),
}


def build_checkpoint(name: str, folder: Path, seed: int = 0, max_positions: int = 512) -> Any:
    """A seeded random LlamaForCausalLM saved to `folder`; returns the model (fp32, eval).

    No EOS and (unless the config ties it) no tied head, so every generated length is
    exactly what was asked for.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **{"tie_word_embeddings": False, **MODEL_CONFIGS[name]},
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
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


def num_params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


# ---- workloads --------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    prompt_ids: list[int]
    max_new: int


# The engine benchmark's mixed workload (bench/engine.py), which e2e.py, ab_engine.py,
# structured.py and vs_llamacpp.py run too: jobs, prompt lengths, max_new_tokens.
MIXED_N, MIXED_PROMPT, MIXED_NEW = 16, (8, 64), (16, 96)


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


def mixed_workload(vocab: int) -> list[Job]:
    """The engine benchmark's mixed workload (MIXED_*, seed 2) for a vocabulary."""
    return mixed_jobs(MIXED_N, MIXED_PROMPT, MIXED_NEW, vocab)


def requests(jobs: Sequence[Job], tag: str = "j", **fields: Any) -> list[GenerationRequest]:
    """One request per job, ids TAG-i, eos ignored: each makes exactly its max_new tokens."""
    return [
        GenerationRequest(
            job_id=f"{tag}-{i}",
            prompt_ids=j.prompt_ids,
            max_new_tokens=j.max_new,
            ignore_eos=True,
            **fields,
        )
        for i, j in enumerate(jobs)
    ]


def random_request(
    job_id: str, prompt_len: int, new: int, rng: random.Random, **fields: Any
) -> GenerationRequest:
    """A request of `prompt_len` random ordinary-text token ids (1000..19999 of the SmolLM2
    vocabulary), eos ignored; `fields`: priority, tenant ..."""
    return GenerationRequest(
        job_id=job_id,
        prompt_ids=[rng.randrange(1000, 20000) for _ in range(prompt_len)],
        max_new_tokens=new,
        ignore_eos=True,
        **fields,
    )


# The text both quality benchmarks cut token ids from; its header ends with HEADER_END.
TEXT = Path(__file__).resolve().parent / "data" / "declaration_gettysburg.txt"
HEADER_END = "# ----\n"


def text_body() -> str:
    """TEXT without its header."""
    return TEXT.read_text().split(HEADER_END, 1)[-1]


# ---- what came back ---------------------------------------------------------------


@dataclass
class Stream:
    """One request's timeline at its client (perf_counter seconds, or seconds since a
    burst's t0) and what came back."""

    submitted: float = 0.0
    first: float = math.nan  # first token
    last: float = math.nan  # last token
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = -1  # the prompt's length (a server: what it says it evaluated)
    cached_tokens: int | None = None  # prompt tokens the system took from its cache
    stop_type: str = ""
    eog: list[int] = field(default_factory=list)  # llama-server: tokens ignore_eos masked
    # llama-server: tokens its SSE chunks left out (parts of a character not yet whole),
    # counted from its final `timings.predicted_n` as placeholders -1 at the last chunk
    held_back: int = 0

    def add(self, tokens: Iterable[int], now: float) -> None:
        """Tokens that arrived at `now`."""
        got = list(tokens)
        if got and not self.tokens:
            self.first = now
        if got:
            self.last = now
        self.tokens += got


def burst_metrics(streams: Sequence[Stream]) -> dict[str, float]:
    """Generated tokens / wall time (first submit to last token) and TTFT (each submit to
    its first token) of requests sent together."""
    t0 = min(s.submitted for s in streams)
    wall = max(s.last for s in streams) - t0
    ttft = [s.first - s.submitted for s in streams]
    return {
        "tok_s": sum(len(s.tokens) for s in streams) / wall,
        "wall_s": wall,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
    }
