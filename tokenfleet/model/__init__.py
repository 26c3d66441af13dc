"""Llama-family model in torch: config, paged KV pool, checkpoint loading, tokenizers, sampling.

The engine never calls the model directly: it talks to a `ModelRunner`
(`tokenfleet.seam`), and `TorchRunner` (`model/runner.py`) runs this
model behind it. Names are imported lazily, so the torch-free parts (config,
tokenizers, the detokenizer, chat templates) load without torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenfleet.errors import ModelConfigError, ModelLoadError
    from tokenfleet.model.build import LoadedModel
    from tokenfleet.model.config import Llama3RopeScaling, ModelConfig
    from tokenfleet.model.detokenizer import IncrementalDetokenizer
    from tokenfleet.model.kv_pool import KVPool
    from tokenfleet.model.llama import LlamaModel
    from tokenfleet.model.loader import load_model
    from tokenfleet.model.presets import PRESETS
    from tokenfleet.model.sampling import Sampler, SamplingState
    from tokenfleet.model.tick_inputs import SeqInput
    from tokenfleet.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
    from tokenfleet.model.torch_runner import TorchRunner

_WHERE = {
    "SeqInput": "tick_inputs",
    "Llama3RopeScaling": "config",
    "ModelConfig": "config",
    "IncrementalDetokenizer": "detokenizer",
    "ModelConfigError": "tokenfleet.errors",
    "ModelLoadError": "tokenfleet.errors",
    "KVPool": "kv_pool",
    "LlamaModel": "llama",
    "LoadedModel": "build",
    "load_model": "loader",
    "PRESETS": "presets",
    "TorchRunner": "torch_runner",
    "Sampler": "sampling",
    "SamplingState": "sampling",
    "ByteTokenizer": "tokenizer",
    "HFTokenizer": "tokenizer",
    "Tokenizer": "tokenizer",
}

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
    "TorchRunner",
    "load_model",
]


def __getattr__(name: str) -> object:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module if "." in module else f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
