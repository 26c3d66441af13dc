"""Grouped-query self-attention over the paged KV cache, with the kernels behind a backend.

`Attention` (the layer) owns the projections and rotary embedding and writes each
new token's K/V into its pool slot; an `AttentionBackend` does the attending.
`prepare` turns the tick's backend-neutral `BatchPlan` (block tables, context
lengths) into whatever its kernels want, once per forward; `attend` runs per
layer. `SdpaBackend` (gather + `scaled_dot_product_attention`) is the portable
one; a paged-attention kernel is another backend, and no layer changes.
"""

from __future__ import annotations

from tokenfleet.model.attention.backend import BACKENDS, AttentionBackend, get_backend
from tokenfleet.model.attention.layer import Attention
from tokenfleet.model.attention.sdpa import SdpaBackend

__all__ = ["BACKENDS", "Attention", "AttentionBackend", "SdpaBackend", "get_backend"]
