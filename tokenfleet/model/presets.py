"""Built-in models that need no files: seeded random weights plus a byte tokenizer.

`tiny-random` exists so a fresh machine can run the whole fleet (demo, tests,
benchmarks) with nothing downloaded. Its vocab is exactly the byte tokenizer's
259 ids (256 bytes + BOS/EOS/PAD), not padded to a round 512: with random
weights every id is about equally likely, and padding ids would decode to
nothing, so half of all sampled tokens would be silent. Its weights are drawn
from a CPU `torch.Generator` with a fixed seed in a fixed order, so every
process on every machine builds the same model. Linear layers use std 0.02 (the
Hugging Face default); embeddings use std 1.0 (torch's `nn.Embedding` default)
so the current token dominates the residual stream and greedy output wanders
instead of collapsing onto a two-token loop, as it does when every weight has
std 0.02.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tokenfleet.model.chat import SIMPLE_CHAT_TEMPLATE
from tokenfleet.model.config import ModelConfig
from tokenfleet.model.tokenizer import ByteTokenizer
from tokenfleet.model.weights import hf_weight_shapes


@dataclass(frozen=True)
class Preset:
    name: str
    config: ModelConfig
    seed: int
    init_std: float = 0.02
    embed_std: float = 1.0

    def hf_weights(self) -> dict[str, Tensor]:
        """Float32 CPU weights under Hugging Face names; identical in every process."""
        g = torch.Generator(device="cpu")
        g.manual_seed(self.seed)
        weights: dict[str, Tensor] = {}
        for name, shape in hf_weight_shapes(self.config).items():
            if name.endswith("norm.weight"):
                weights[name] = torch.ones(shape)
            elif name.endswith(".bias"):
                weights[name] = torch.zeros(shape)
            else:
                std = self.embed_std if name == "model.embed_tokens.weight" else self.init_std
                weights[name] = torch.randn(shape, generator=g) * std
        return weights

    def tokenizer(self) -> ByteTokenizer:
        return ByteTokenizer(self.config.vocab_size, chat_template=SIMPLE_CHAT_TEMPLATE)


PRESETS: dict[str, Preset] = {
    "tiny-random": Preset(
        name="tiny-random",
        config=ModelConfig(
            vocab_size=ByteTokenizer.PAD + 1,  # 259
            hidden_size=256,
            intermediate_size=688,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=64,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
            bos_token_id=ByteTokenizer.BOS,
            eos_token_ids=(ByteTokenizer.EOS,),
        ),
        seed=1234,
    ),
}
