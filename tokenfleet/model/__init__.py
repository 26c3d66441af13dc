"""Llama-family model in torch: config, paged KV pool, checkpoint loading, tokenizers, sampling.

The engine calls `LlamaModel.forward(input_ids, seqs, kv)` once per tick.
"""

from __future__ import annotations

from tokenfleet.model.batch import SeqInput
from tokenfleet.model.config import Llama3RopeScaling, ModelConfig
from tokenfleet.model.detokenizer import IncrementalDetokenizer
from tokenfleet.model.errors import ModelConfigError, ModelLoadError
from tokenfleet.model.kv_pool import KVPool
from tokenfleet.model.llama import LlamaModel
from tokenfleet.model.loader import LoadedModel, load_model
from tokenfleet.model.presets import PRESETS
from tokenfleet.model.sampling import Sampler, SamplingState
from tokenfleet.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = [
    "PRESETS",
    "ByteTokenizer",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "KVPool",
    "Llama3RopeScaling",
    "LlamaModel",
    "LoadedModel",
    "ModelConfig",
    "ModelConfigError",
    "ModelLoadError",
    "Sampler",
    "SamplingState",
    "SeqInput",
    "Tokenizer",
    "load_model",
]
