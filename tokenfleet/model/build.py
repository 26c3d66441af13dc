"""A `LoadedModel` out of a config, mapped weights and a tokenizer: what every loader
(presets, checkpoint folders, GGUF files) ends with."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tokenfleet.model.config import ModelConfig
from tokenfleet.model.llama import LlamaModel
from tokenfleet.model.quant import PackedWeight
from tokenfleet.model.tokenizer import Tokenizer
from tokenfleet.seam import SamplingDefaults


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaModel
    config: ModelConfig
    tokenizer: Tokenizer | None  # None when the folder has no tokenizer.json
    dtype: torch.dtype
    device: torch.device
    weight_bytes: int  # resident bytes of all weights (a tied head counted once)
    source_quant: str | None = None  # a GGUF file's most common matrix type, e.g. "Q4_1"
    quant: str | None = None  # "int8" / "int4": the weights are kept quantized
    # applied to what a job leaves unset (a folder's generation_config.json)
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # a GGUF file's own Q4_0 / Q4_1 blocks, packed, by module name, kept aside for the
    # engine plan (`load_model(..., q4_aside=True)`); not part of the model
    q4_blocks: Mapping[str, PackedWeight] | None = None


def build_model(
    config: ModelConfig,
    state: dict[str, Tensor],
    tokenizer: Tokenizer | None,
    dtype: torch.dtype,
    device: torch.device,
) -> LoadedModel:
    # Build on the meta device (no allocation, no random init), then adopt the
    # loaded tensors as the parameters.
    with torch.device("meta"):
        model = LlamaModel(config)
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # assign=True unties them
    model.eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # deduplicated
    return LoadedModel(model, config, tokenizer, dtype, device, weight_bytes)
