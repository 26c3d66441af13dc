"""Stable reason strings shared by the wire, the admission core and the worker.

These are `str` enums: their values are what clients in any language read back
from Redis, so a value never changes once released.
"""

from __future__ import annotations

from enum import StrEnum


class FinishReason(StrEnum):
    """Why a job ended. Exactly one terminal event per job carries one of these."""

    STOP = "stop"  # a stop token id or stop string was produced
    LENGTH = "length"  # max_new_tokens reached
    CANCELLED = "cancelled"  # the client cancelled it
    DEADLINE = "deadline"  # its deadline passed before it finished
    # refused before any generation (admission or invalid input), or a structured job
    # whose output cannot satisfy its grammar (error.reason grammar_unsatisfied / _failed)
    REJECTED = "rejected"
    ERROR = "error"  # the engine failed while serving it


class AdmissionReason(StrEnum):
    """The outcome of checking one job against a node's budgets."""

    ADMITTED = "admitted"
    QUEUED = "queued"  # fits in principle; waits in the small local list for room
    REJECTED_KV_BUDGET = "rejected_kv_budget"  # prompt + max_new_tokens can never fit in KV
    REJECTED_SCRATCH_BUDGET = "rejected_scratch_budget"  # its scratch can never fit
    REJECTED_QUEUE_FULL = "rejected_queue_full"  # no room now and the local list is full
    REJECTED_DUPLICATE = "rejected_duplicate"  # a session with this job id is already here
    REJECTED_INVALID = "rejected_invalid"  # malformed (empty prompt, out-of-range values)

    @property
    def accepted(self) -> bool:
        return self in (AdmissionReason.ADMITTED, AdmissionReason.QUEUED)


# `error.reason` of a job that ended as `deadline` because no worker had started it by
# its `queue_deadline` (no prefill was spent on it).
QUEUE_DEADLINE_REASON = "queue_deadline"
