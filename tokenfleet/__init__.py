"""tokenfleet: continuous-batching LLM workers coordinated through Redis."""

__version__ = "0.1.0"
