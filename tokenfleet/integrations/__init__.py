"""Adapters that let other job systems hand generations to a tokenfleet fleet.

`tokenfleet.integrations.rq`: a function a service enqueues on its own RQ queue.
"""
