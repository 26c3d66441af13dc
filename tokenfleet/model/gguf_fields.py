"""Reading one GGUF metadata field as a plain Python value (shared by the weight and
tokenizer readers)."""

from __future__ import annotations

from typing import Any

from gguf import GGUFReader, GGUFValueType

from tokenfleet.errors import ModelLoadError


def field_value(reader: GGUFReader, name: str, default: Any = None) -> Any:
    """A metadata value as a Python scalar, str or list (`default` when absent)."""
    f = reader.get_field(name)
    if f is None:
        return default
    try:
        if f.types and f.types[0] == GGUFValueType.ARRAY:
            return list(f.contents())
        return f.contents()
    except Exception as e:  # malformed field parts
        raise ModelLoadError(f"cannot read GGUF metadata {name}: {e}") from e
