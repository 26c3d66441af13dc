"""Named errors a user can hit when configuring or loading a model.

`ModelLoadError` is the package-wide one from `tokenfleet.errors`, re-exported so
model code and its callers can import both from here.
"""

from __future__ import annotations

from tokenfleet.errors import ModelLoadError

__all__ = ["ModelConfigError", "ModelLoadError"]


class ModelConfigError(ModelLoadError, ValueError):
    """A model config is malformed or describes something this engine cannot run."""
