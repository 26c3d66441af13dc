"""Node budgets and per-job admission decisions (pure arithmetic, no Redis)."""

from __future__ import annotations

from tokenfleet.admission.budget import (
    Admission,
    AdmissionDecision,
    AdmissionRequest,
    NodeBudget,
)
from tokenfleet.reasons import AdmissionReason

__all__ = [
    "Admission",
    "AdmissionDecision",
    "AdmissionReason",
    "AdmissionRequest",
    "NodeBudget",
]
