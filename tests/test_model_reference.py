"""The paged-KV model against transformers' LlamaForCausalLM, plus loading and presets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from tests.helpers.gguf_files import F32, GGUF_ARCH, Q8_0, round_trip_model, write_gguf
from tests.helpers.models import (
    REFERENCE_CONFIGS,
    block_tables,
    greedy_engine_style,
    make_hf_llama,
    reference_logits,
    run_chunks,
    save_hf_llama,
)
from tokenfleet.model import (
    ByteTokenizer,
    KVPool,
    LoadedModel,
    ModelConfig,
    ModelConfigError,
    ModelLoadError,
    SeqInput,
    load_model,
)

FAMILY_OF = {f: f for f in GGUF_ARCH} | {"gemma3_text": "gemma3"}
BLOCK = 8  # small blocks so every sequence spans several, non-adjacent ones
NUM_BLOCKS = 64


def _close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    scale = max(float(ref.abs().max()), 1.0)
    torch.testing.assert_close(ours, ref, atol=rel * scale, rtol=0)


# The same random weights loaded from a GGUF file llama.cpp's way (F32, or Q8_0 against
# transformers on the quantized-and-back weights): two shapes per GGUF architecture.
GGUF_SHAPES = (
    *("gqa-hd32", "mha-hd64-tied", "qwen2-gqa", "qwen2-tied-mha"),
    *("qwen3-gqa", "qwen3-tied-hd64", "phi3-gqa", "mistral-gqa", "gemma3-mqa"),
)
GGUF_CASES = [f"{name}-gguf-{quant}" for name in GGUF_SHAPES for quant in ("f32", "q8_0")]


@pytest.fixture(scope="module", params=sorted(REFERENCE_CONFIGS) + GGUF_CASES)
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[LlamaForCausalLM, LoadedModel]:
    name, _, quant = str(request.param).partition("-gguf-")
    hf = make_hf_llama(seed=7, **REFERENCE_CONFIGS[name])
    folder = tmp_path_factory.mktemp(request.param)
    if not quant:
        return hf, load_model(str(save_hf_llama(hf, folder)), device="cpu")
    kind = {"f32": F32, "q8_0": Q8_0}[quant]
    loaded = load_model(str(write_gguf(hf, folder / "m.gguf", kind)), device="cpu")
    assert loaded.source_quant == kind.name
    round_trip_model(hf, kind)
    return hf, loaded


@pytest.mark.reference
def test_config_read_back(pair: tuple[LlamaForCausalLM, LoadedModel]) -> None:
    hf, loaded = pair
    c = loaded.config
    hf_head_dim = getattr(hf.config, "head_dim", None)
    assert c.head_dim == (hf_head_dim or hf.config.hidden_size // hf.config.num_attention_heads)
    from_gguf = loaded.source_quant is not None
    assert c.family == (GGUF_ARCH if from_gguf else FAMILY_OF)[hf.config.model_type]
    assert c.num_kv_heads == hf.config.num_key_value_heads
    assert c.tie_word_embeddings == hf.config.tie_word_embeddings
    assert c.param_count == sum(p.numel() for p in hf.parameters())
    assert loaded.weight_bytes == c.param_count * 4
    assert loaded.tokenizer is None  # no tokenizer.json in these folders


@pytest.mark.reference
def test_full_prompt_prefill_matches(pair: tuple[LlamaForCausalLM, LoadedModel]) -> None:
    hf, loaded = pair
    ids = torch.randint(0, hf.config.vocab_size, (57,), generator=torch.Generator().manual_seed(1))
    ref = reference_logits(hf, ids.tolist())
    pool = loaded.model.new_kv_pool(NUM_BLOCKS, BLOCK)
    (table,) = block_tables([57], BLOCK, NUM_BLOCKS)
    out = loaded.model.forward(ids, [SeqInput(table, 0, 57)], pool)
    assert out.shape == (1, hf.config.vocab_size) and out.dtype == torch.float32
    _close(out[0], ref[-1])


@pytest.mark.reference
def test_chunked_prefill_and_decode_match(pair: tuple[LlamaForCausalLM, LoadedModel]) -> None:
    hf, loaded = pair
    ids = torch.randint(0, hf.config.vocab_size, (60,), generator=torch.Generator().manual_seed(2))
    ref = reference_logits(hf, ids.tolist())
    pool = loaded.model.new_kv_pool(NUM_BLOCKS, BLOCK)
    (table,) = block_tables([60], BLOCK, NUM_BLOCKS, seed=3)
    chunks = [13, 1, 8, 20, 1, 1, 7, 1, 1, 1, 1, 1, 1, 1, 1, 1]  # odd sizes cross blocks
    out = run_chunks(loaded.model, pool, ids.tolist(), table, chunks)
    ends = torch.tensor(chunks).cumsum(0) - 1
    _close(out, ref[ends])


@pytest.mark.reference
def test_greedy_tokens_match_generate(pair: tuple[LlamaForCausalLM, LoadedModel]) -> None:
    hf, loaded = pair
    model, vocab, new = loaded.model, hf.config.vocab_size, 20
    g = torch.Generator().manual_seed(4)
    lengths = [1, 3, 7, 12, 18, 25, 33, 40]
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]

    expected = []
    for p in prompts:
        out = hf.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        expected.append(out[0, len(p) :].tolist())

    # Ours as an engine would run it: chunked prefill, then one batched decode per step
    generated = greedy_engine_style(model, prompts, new, BLOCK, NUM_BLOCKS)
    assert generated == expected


@pytest.mark.reference
def test_batched_forward_equals_each_alone(pair: tuple[LlamaForCausalLM, LoadedModel]) -> None:
    hf, loaded = pair
    model, vocab = loaded.model, hf.config.vocab_size
    g = torch.Generator().manual_seed(6)
    # (tokens already cached, new tokens this tick): decodes, a first chunk, later chunks
    shapes = [(5, 1), (0, 9), (17, 1), (8, 6), (0, 1), (30, 1), (12, 12), (40, 1)]
    tables = block_tables([a + b for a, b in shapes], BLOCK, NUM_BLOCKS, seed=7)
    seqs_ids = [torch.randint(0, vocab, (a + b,), generator=g).tolist() for a, b in shapes]

    pool = model.new_kv_pool(NUM_BLOCKS, BLOCK)
    for ids, (cached, _), table in zip(seqs_ids, shapes, tables, strict=True):
        if cached:
            run_chunks(model, pool, ids[:cached], table, [cached])
    # Blocks nobody owns hold NaN: reading any of them (padding leaks) would show.
    owned = {b for t in tables for b in t}
    for b in set(range(NUM_BLOCKS)) - owned:
        pool.k[:, b] = float("nan")
        pool.v[:, b] = float("nan")
    alone_pool = model.new_kv_pool(NUM_BLOCKS, BLOCK)
    alone_pool.k.copy_(pool.k)
    alone_pool.v.copy_(pool.v)

    seqs = [SeqInput(t, a, b) for t, (a, b) in zip(tables, shapes, strict=True)]
    flat = torch.tensor([i for ids, (a, _) in zip(seqs_ids, shapes, strict=True) for i in ids[a:]])
    together = model.forward(flat, seqs, pool)
    assert together.shape == (8, vocab) and bool(torch.isfinite(together).all())

    alone = torch.stack(
        [
            model.forward(torch.tensor(ids[a:]), [s], alone_pool)[0]
            for ids, (a, _), s in zip(seqs_ids, shapes, seqs, strict=True)
        ]
    )
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    # and every sequence's logits still match the reference
    for row, ids in zip(together, seqs_ids, strict=True):
        _close(row, reference_logits(hf, ids)[-1])


@pytest.mark.reference
def test_sharded_checkpoint(tmp_path: Path) -> None:
    hf = make_hf_llama(seed=11, hidden_size=128, num_hidden_layers=3)
    save_hf_llama(hf, tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    loaded = load_model(str(tmp_path), device="cpu")
    ids = list(range(3, 40))
    pool = loaded.model.new_kv_pool(16, BLOCK)
    out = loaded.model.forward(torch.tensor(ids), [SeqInput(list(range(5)), 0, len(ids))], pool)
    _close(out[0], reference_logits(hf, ids)[-1])


@pytest.mark.reference
def test_bfloat16_load_smoke(tmp_path: Path) -> None:
    hf = make_hf_llama(seed=12)
    save_hf_llama(hf, tmp_path)
    loaded = load_model(str(tmp_path), dtype="bfloat16", device="cpu")
    assert loaded.dtype == torch.bfloat16 and loaded.model.dtype == torch.bfloat16
    assert loaded.weight_bytes == loaded.config.param_count * 2
    pool = loaded.model.new_kv_pool(16, BLOCK)
    assert pool.k.dtype == torch.bfloat16
    ids = list(range(5, 30))
    chunks = run_chunks(loaded.model, pool, ids, list(range(4)), [20, 1, 1, 1, 1, 1])
    ref = reference_logits(hf, ids)
    assert chunks.dtype == torch.float32 and bool(torch.isfinite(chunks).all())
    # bf16 keeps ~3 significant digits: loose agreement, same top token almost always
    assert float((chunks[-1] - ref[-1]).abs().max()) < 0.05 * float(ref.abs().max()) + 0.05


def test_bad_batches_are_refused() -> None:
    model = load_model("tiny-random", device="cpu").model
    pool = model.new_kv_pool(4, 4)
    with pytest.raises(ValueError, match="cannot hold position 8"):
        model.forward(torch.tensor([1, 2]), [SeqInput([0, 1], 7, 2)], pool)
    with pytest.raises(ValueError, match="outside the pool"):
        model.forward(torch.tensor([1]), [SeqInput([0, 9], 4, 1)], pool)
    with pytest.raises(ValueError, match="seqs claim 3"):
        model.forward(torch.tensor([1, 2]), [SeqInput([0], 0, 3)], pool)
    with pytest.raises(ValueError, match=r"KV pool is torch\.bfloat16"):
        model.forward(
            torch.tensor([1]),
            [SeqInput([0], 0, 1)],
            KVPool(model.config, 4, 4, dtype=torch.bfloat16),
        )


# ---- loading errors, config, presets (not reference comparisons) ---------------------


def test_load_errors_are_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="neither a preset"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="no model config"):
        load_model(str(tmp_path))
    hf = make_hf_llama(seed=0)
    hf.config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"no model\.safetensors"):
        load_model(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(architectures=["MambaForCausalLM"], model_type="mamba")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture") as err:
        load_model(str(tmp_path))
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3"):
        assert supported in str(err.value)
    with pytest.raises(ModelLoadError, match="unsupported dtype"):
        load_model("tiny-random", dtype="int8")


def test_checkpoint_not_matching_config(tmp_path: Path) -> None:
    hf = make_hf_llama(seed=0)
    save_hf_llama(hf, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"missing model\.layers\.2\."):
        load_model(str(tmp_path))


def test_config_validation_and_sizes() -> None:
    base = dict(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    c = ModelConfig.from_hf_dict({**base, "eos_token_id": [2, 5]})
    assert c.head_dim == 16 and c.eos_token_ids == (2, 5)
    assert c.kv_bytes_per_token(2) == 2 * 2 * 2 * 16 * 2
    assert c.scratch_bytes(64) > c.scratch_bytes(1) > 0
    assert c.scratch_bytes(1, context_len=4000) > c.scratch_bytes(1, context_len=10)
    with pytest.raises(ModelConfigError, match="multiple of"):
        ModelConfig.from_hf_dict({**base, "num_key_value_heads": 3})
    with pytest.raises(ModelConfigError, match="missing required key 'vocab_size'"):
        ModelConfig.from_hf_dict({k: v for k, v in base.items() if k != "vocab_size"})
    with pytest.raises(ModelConfigError, match="unsupported rope scaling 'yarn'"):
        ModelConfig.from_hf_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2}})
    legacy = ModelConfig.from_hf_dict(
        {
            **base,
            "rope_theta": 5e5,
            "rope_scaling": {
                "type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    assert legacy.rope_theta == 5e5 and legacy.rope_scaling is not None


def test_tiny_random_preset() -> None:
    loaded = load_model("tiny-random", device="cpu")
    c = loaded.config
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads) == (256, 4, 4, 2)
    assert isinstance(loaded.tokenizer, ByteTokenizer)
    assert loaded.tokenizer.vocab_size == c.vocab_size
    prompt = loaded.tokenizer.encode("Hello, fleet! 你好 🚀")
    pool = loaded.model.new_kv_pool(32, 16)
    table = list(range(8))
    logits = loaded.model.forward(torch.tensor(prompt), [SeqInput(table, 0, len(prompt))], pool)
    tokens = [int(logits[0].argmax())]
    for _ in range(39):
        pos = len(prompt) + len(tokens) - 1
        logits = loaded.model.forward(torch.tensor(tokens[-1:]), [SeqInput(table, pos, 1)], pool)
        tokens.append(int(logits[0].argmax()))
    assert len(set(tokens)) >= 10, f"greedy output collapsed: {tokens}"


def test_tiny_random_is_identical_across_processes() -> None:
    code = (
        "import hashlib, torch\n"
        "from tokenfleet.model import load_model\n"
        "m = load_model('tiny-random', device='cpu').model\n"
        "h = hashlib.sha256()\n"
        "[h.update(p.detach().numpy().tobytes()) for p in m.parameters()]\n"
        "print(h.hexdigest())\n"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    }
    assert len(digests) == 1 and len(next(iter(digests))) == 64


def test_family_flags_and_sliding_window_cap() -> None:
    base = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=4096,
    )
    # Mistral's and Phi-3's windows are run on every layer, as transformers does: no cap
    mistral = ModelConfig.from_hf_dict({**base, "model_type": "mistral", "sliding_window": 1024})
    assert mistral.family == "mistral" and mistral.max_position_embeddings == 4096
    assert mistral.window_of(0) == 1024 and mistral.rope_local_theta == mistral.rope_theta
    phi3 = ModelConfig.from_hf_dict({**base, "model_type": "phi3", "sliding_window": 2047})
    assert phi3.window_of(0) == 2047 and phi3.max_position_embeddings == 4096
    unwindowed = ModelConfig.from_hf_dict({**base, "model_type": "mistral", "sliding_window": None})
    assert unwindowed.max_position_embeddings == 4096 and unwindowed.window_of(0) is None
    qwen2 = ModelConfig.from_hf_dict(
        {
            **base,
            "architectures": ["Qwen2ForCausalLM"],
            "sliding_window": 512,
            "use_sliding_window": False,
        }
    )
    assert qwen2.family == "qwen2" and qwen2.qkv_bias and not qwen2.attention_bias
    assert qwen2.max_position_embeddings == 4096 and qwen2.window_of(0) is None  # off
    layered = {**base, "model_type": "qwen2", "num_hidden_layers": 3, "sliding_window": 512}
    on = ModelConfig.from_hf_dict({**layered, "use_sliding_window": True, "max_window_layers": 1})
    assert [on.window_of(i) for i in range(3)] == [None, 512, 512]
    assert on.max_position_embeddings == 4096
    qwen3 = ModelConfig.from_hf_dict({**base, "model_type": "qwen3", "head_dim": 16})
    assert qwen3.qk_norm and not qwen3.has_qkv_bias


def test_gemma3_config_fields() -> None:
    base = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=7,
        num_attention_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
    )
    # transformers 4.x keys: rope_theta / rope_local_base_freq, a sliding_window_pattern
    old = ModelConfig.from_hf_dict(
        {
            **base,
            "model_type": "gemma3_text",
            "sliding_window": 512,
            "rope_theta": 1e6,
            "rope_local_base_freq": 1e4,
            "query_pre_attn_scalar": 64,
            "hidden_activation": "gelu_pytorch_tanh",
        }
    )
    assert old.family == "gemma3" and old.qk_norm and old.hidden_act == "gelu_pytorch_tanh"
    assert [old.window_of(i) for i in range(7)] == [512] * 5 + [None, 512]
    assert (old.rope_theta, old.rope_local_theta) == (1e6, 1e4)
    assert old.max_position_embeddings == 4096  # windows run as windows: no cap
    assert old.query_scale == pytest.approx(0.5) and old.embed_scale == pytest.approx(32**0.5)
    with pytest.raises(ModelConfigError, match="final_logit_softcapping"):
        ModelConfig.from_hf_dict(
            {**base, "model_type": "gemma3_text", "final_logit_softcapping": 30.0}
        )
    with pytest.raises(ModelConfigError, match="layer_types"):
        ModelConfig.from_hf_dict(
            {**base, "model_type": "gemma3_text", "layer_types": ["full_attention"]}
        )
    with pytest.raises(ModelConfigError, match="hidden_act"):
        ModelConfig(**{**old.__dict__, "hidden_act": "relu"})
