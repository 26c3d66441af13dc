"""A gateway for tests: `create_app(config)` served by uvicorn in a background thread."""

from __future__ import annotations

import threading

import openai
import uvicorn
from support import free_port, wait_for

from tokenfleet.gateway import GatewayConfig, create_app


class ServedGateway:
    """`create_app(config)` served by uvicorn in a background thread on a free port."""

    def __init__(self, config: GatewayConfig) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(
                create_app(config),
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                timeout_graceful_shutdown=5,
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, 20, "the gateway to start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
