"""OpenAI-compatible HTTP gateway over the fleet (`tokenfleet gateway`; docs/http.md)."""

from tokenfleet.config import GatewayConfig
from tokenfleet.gateway.app import create_app
from tokenfleet.gateway.service import Gateway

__all__ = ["Gateway", "GatewayConfig", "create_app"]
