"""OpenAI-compatible HTTP gateway over the fleet (`tokenfleet gateway`; docs/http.md)."""

from tokenfleet.gateway.app import create_app
from tokenfleet.gateway.service import Gateway, GatewayConfig

__all__ = ["Gateway", "GatewayConfig", "create_app"]
