"""Settings read once at the edge (the CLI, a worker's or gateway's start), never deep
in the code: one declaration per kind of process, each field with its default,
constraints, description, environment variables and flag (`common` says how).

    Settings         every command: the fleet's Redis URL, key prefix, default queue cap
                     (`$REDIS_URL` or `$TOKENFLEET_REDIS_URL`, `$TOKENFLEET_PREFIX`, ...)
    WorkerSettings   `tokenfleet worker`: the model, the engine's budget, the loop
    GatewayConfig    what a gateway app runs with; built directly, it reads no environment
    GatewaySettings  `tokenfleet gateway`: a GatewayConfig from flags over the environment
                     (`$TOKENFLEET_GATEWAY_*`, `$TOKENFLEET_API_KEYS`), and where to listen
"""

from tokenfleet.config.common import Env, Flag, FleetConfig, Settings
from tokenfleet.config.gateway import GatewayConfig, GatewaySettings
from tokenfleet.config.worker import WorkerSettings

__all__ = [
    "Env",
    "Flag",
    "FleetConfig",
    "GatewayConfig",
    "GatewaySettings",
    "Settings",
    "WorkerSettings",
]
