"""Helpers shared by the model tests: tiny reference checkpoints and block tables."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import LlamaForCausalLM

from tokenfleet.model import KVPool, LlamaModel, SeqInput

# Small enough that the whole reference file runs in seconds on 2 cores.
REFERENCE_CONFIGS: dict[str, dict[str, Any]] = {
    "gqa-hd32": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2),
    "mha-hd64-tied": dict(
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
    "explicit-hd64-mqa": dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        num_hidden_layers=3,
    ),
    "llama3-rope": dict(
        hidden_size=96,
        num_attention_heads=3,
        num_key_value_heads=1,
        rope_theta=500000.0,
        # original context 32 < the positions the tests reach, so the scaling matters
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
    ),
    "biases": dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=True,
        mlp_bias=True,
    ),
    # The other families, two shapes each: a "family" key picks transformers' class.
    "mistral-gqa": dict(
        family="mistral",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=None,
    ),
    "mistral-window": dict(
        family="mistral",
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=48,
        sliding_window=8,  # the prompts (up to 60 tokens) run far past it
    ),
    "qwen2-gqa": dict(
        family="qwen2",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=1000000.0,
    ),
    "qwen2-tied-mha": dict(
        family="qwen2",
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2-window": dict(  # layer 0 full, layer 1 a window of 8
        family="qwen2",
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
    ),
    "qwen3-gqa": dict(
        family="qwen3", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32
    ),
    "qwen3-tied-hd64": dict(
        family="qwen3",
        hidden_size=96,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    "phi3-gqa": dict(
        family="phi3",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    ),
    "phi3-mha-window": dict(
        family="phi3",
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        pad_token_id=0,
        sliding_window=8,
    ),
    # Windows of 8 so the prompts (up to 60 tokens) run far past them; a global layer
    # between sliding ones, each kind with its rope base; query_pre_attn_scalar apart
    # from head_dim in one shape (the GGUF one keeps llama.cpp's head_dim and 10k base).
    "gemma3-window": dict(
        family="gemma3",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_hidden_layers=3,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=24,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 50000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        },
    ),
    "gemma3-mqa": dict(
        family="gemma3",
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=48,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=48,
    ),
}

FAMILY_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}


def make_hf_llama(seed: int = 0, **overrides: Any) -> LlamaForCausalLM:
    """A randomly initialised LlamaForCausalLM (fp32, eval mode), or another family's
    model with `family="qwen3"` etc. (typed as Llama: the tests use what they share)."""
    family = overrides.pop("family", "llama")
    config_cls, model_cls = (getattr(transformers, n) for n in FAMILY_CLASSES[family])
    kwargs: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    biased = family == "qwen2" or getattr(model.config, "attention_bias", False)
    if biased or getattr(model.config, "mlp_bias", False):
        # HF initialises biases to zero; make them matter.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.02)
    if family == "qwen3":  # the q/k norms start at ones; make them matter too
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.normal_(1.0, 0.1)
    if family == "gemma3":  # its norms scale by (1 + weight) and start at zeros
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0.0, 0.1)
    return model  # type: ignore[no-any-return]


def save_hf_llama(model: LlamaForCausalLM, path: Path, **save_kwargs: Any) -> Path:
    model.save_pretrained(path, **save_kwargs)
    return path


def reference_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """transformers' logits for every position of one prompt: [len(ids), vocab]."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # type: ignore[no-any-return]


def block_tables(
    lengths: list[int], block_size: int, num_blocks: int, seed: int = 0
) -> list[list[int]]:
    """Disjoint, shuffled block tables covering each length (blocks are not in order)."""
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables: list[list[int]] = []
    for n in lengths:
        need = -(-n // block_size)
        if need > len(ids):
            raise ValueError("not enough blocks")
        tables.append(ids[:need])
        ids = ids[need:]
    return tables


def run_chunks(
    model: LlamaModel,
    pool: KVPool,
    ids: list[int],
    block_table: list[int],
    chunks: list[int],
) -> torch.Tensor:
    """Feed `ids` through the pool in chunks of the given sizes (one sequence alone).

    Returns the logits after each chunk: [len(chunks), vocab].
    """
    assert sum(chunks) == len(ids)
    out = []
    pos = 0
    for n in chunks:
        step = torch.tensor(ids[pos : pos + n])
        out.append(model.forward(step, [SeqInput(block_table, pos, n)], pool)[0])
        pos += n
    return torch.stack(out)


def greedy_engine_style(
    model: LlamaModel, prompts: list[list[int]], new: int, block: int, num_blocks: int
) -> list[list[int]]:
    """Greedy tokens as an engine runs them: every prompt prefilled in chunks of <= 16
    tokens, then all sequences decoded together, one forward per step."""
    pool = model.new_kv_pool(num_blocks, block)
    tables = block_tables([len(p) + new for p in prompts], block, num_blocks, seed=5)
    generated: list[list[int]] = []
    for p, table in zip(prompts, tables, strict=True):
        chunks = [16] * (len(p) // 16) + ([len(p) % 16] if len(p) % 16 else [])
        logits = run_chunks(model, pool, p, table, chunks)
        generated.append([int(logits[-1].argmax())])
    for _ in range(new - 1):
        seqs = [
            SeqInput(t, len(p) + len(gen) - 1, 1)
            for p, t, gen in zip(prompts, tables, generated, strict=True)
        ]
        logits = model.forward([gen[-1] for gen in generated], seqs, pool)
        for gen, row in zip(generated, logits.argmax(-1).tolist(), strict=True):
            gen.append(int(row))
    return generated
