"""compose/: the compose file, its Prometheus config and the Dockerfile, checked offline.

No Docker engine is needed: the compose file is validated against the
compose-spec schema (check-jsonschema) and, where installed, by
`docker-compose config`; every `tokenfleet` command it runs is parsed by the
real CLI (click's own parser, so unknown options and bad values fail here).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import typer.main
import yaml
from typer.testing import CliRunner

from tokenfleet.cli import app

ROOT = Path(__file__).parent.parent
COMPOSE = ROOT / "compose" / "docker-compose.yml"
DOCKERFILE = ROOT / "compose" / "Dockerfile"
PROMETHEUS = ROOT / "compose" / "prometheus.yml"

_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(value: str) -> str:
    """`${VAR:-default}` → default, `${VAR}` → '' (compose with an empty environment)."""
    return _VAR.sub(lambda m: m.group(2) or "", value)


def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())  # resolves the `<<: *tokenfleet` merges
    assert isinstance(data, dict)
    return data


def services() -> dict[str, dict[str, Any]]:
    result: dict[str, dict[str, Any]] = compose()["services"]
    return result


def tokenfleet_commands() -> dict[str, list[str]]:
    """service → its command, for every service running the tokenfleet image."""
    return {
        name: [interpolate(str(arg)) for arg in svc["command"]]
        for name, svc in services().items()
        if str(svc.get("image", "")).startswith("tokenfleet")
    }


def option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def seconds(duration: str) -> float:
    """A compose duration ('45s', '1m30s', '90') in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)?", duration)
    return sum(float(n) * units[u or "s"] for n, u in parts)


@pytest.mark.parametrize("path", ["docker-compose.yml", "docker-compose.cluster.yml"])
def test_the_compose_file_matches_the_compose_spec_schema(path: str) -> None:
    pytest.importorskip(
        "check_jsonschema", reason="check-jsonschema belongs in pyproject's test extras"
    )
    schema = ["--builtin-schema", "vendor.compose-spec"]
    proc = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", *schema, str(ROOT / "compose" / path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_docker_compose_config_accepts_every_profile() -> None:
    args = ["docker-compose", "-f", str(COMPOSE), "--profile", "gpu", "--profile", "metrics"]
    proc = subprocess.run(
        [*args, "config", "-q"], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compose_runs_the_tokenfleet_image_in_these_services() -> None:
    assert set(tokenfleet_commands()) == {"worker", "worker-gpu", "gateway"}


@pytest.mark.parametrize("service", ["worker", "worker-gpu", "gateway"])
def test_the_tokenfleet_command_of_each_service_parses_with_the_cli(service: str) -> None:
    group = typer.main.get_command(app)  # a click group (typer may vendor its own click)
    command = tokenfleet_commands()[service]
    sub, args = command[0], command[1:]
    assert sub in getattr(group, "commands", {}), f"`tokenfleet {sub}` does not exist (yet)"
    help_run = CliRunner().invoke(app, [sub, "--help"])
    assert help_run.exit_code == 0, help_run.output
    known = {opt for param in group.commands[sub].params for opt in param.opts}
    missing = [arg for arg in args if arg.startswith("--") and arg not in known]
    assert missing == [], f"`tokenfleet {sub}` has no option(s) {missing}"
    # Parse (and type-convert) the whole command line without running it.
    group.commands[sub].make_context(sub, list(args))


def test_redis_is_durable_never_evicts_and_is_health_checked() -> None:
    redis_svc = services()["redis"]
    assert redis_svc["image"] == "redis:7"
    command = [str(arg) for arg in redis_svc["command"]]
    assert option(command, "--appendonly") == "yes"
    assert option(command, "--maxmemory-policy") == "noeviction"
    test = redis_svc["healthcheck"]["test"]
    assert "redis-cli" in test and "ping" in test
    volume, target = str(redis_svc["volumes"][0]).split(":")[:2]
    assert target == "/data" and volume in compose()["volumes"]


@pytest.mark.parametrize("name", ["worker", "worker-gpu"])
def test_workers_scale_wait_for_redis_and_get_time_to_drain(name: str) -> None:
    worker = services()[name]
    command = tokenfleet_commands()[name]
    assert "container_name" not in worker  # --scale worker=N needs generated names
    assert "ports" not in worker  # ... and no fixed host ports
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    assert option(command, "--redis-url") == "redis://redis:6379/0"
    assert option(command, "--model") == "tiny-random"  # ${TOKENFLEET_MODEL:-tiny-random}
    assert worker.get("stop_signal", "SIGTERM") == "SIGTERM"
    assert seconds(worker["stop_grace_period"]) > float(option(command, "--drain-timeout"))


def test_the_gpu_worker_is_a_cuda_build_with_a_gpu_reserved() -> None:
    gpu = services()["worker-gpu"]
    cpu = services()["worker"]
    assert gpu["profiles"] == ["gpu"]
    assert "profiles" not in cpu
    assert gpu["image"] != cpu["image"]  # two builds must not share a tag
    assert "/whl/cu" in interpolate(gpu["build"]["args"]["TORCH_INDEX"])
    assert cpu["build"]["args"]["TORCH_INDEX"].endswith("/whl/cpu")
    assert option(tokenfleet_commands()["worker-gpu"], "--device") == "cuda"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d["capabilities"] for d in devices)


def test_the_gateway_listens_on_8000_with_keys_from_the_environment() -> None:
    gateway = services()["gateway"]
    command = tokenfleet_commands()["gateway"]
    assert option(command, "--host") == "0.0.0.0"
    assert option(command, "--port") == "8000"
    assert [interpolate(str(p)).split(":")[-1] for p in gateway["ports"]] == ["8000"]
    assert "TOKENFLEET_API_KEYS" in gateway["environment"]


def test_prometheus_scrapes_every_worker_replica_on_its_metrics_port() -> None:
    prom = services()["prometheus"]
    assert prom["profiles"] == ["metrics"]
    source = str(prom["volumes"][0]).split(":")[0]
    assert (COMPOSE.parent / source).resolve() == PROMETHEUS.resolve()
    config = yaml.safe_load(PROMETHEUS.read_text())
    sd = [sd for job in config["scrape_configs"] for sd in job.get("dns_sd_configs", [])]
    for name in ("worker", "worker-gpu"):
        port = int(option(tokenfleet_commands()[name], "--metrics-port"))
        assert any(name in s["names"] and s["port"] == port for s in sd), name
    gateway = f"gateway:{option(tokenfleet_commands()['gateway'], '--port')}"
    static = [c for job in config["scrape_configs"] for c in job.get("static_configs", [])]
    assert [gateway] in [c["targets"] for c in static]


def test_the_dockerfile_pins_cpu_torch_runs_as_a_user_and_enters_tokenfleet() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11-slim$", text, re.M)
    assert re.search(r"^ARG TORCH_VERSION=2\.13\.0$", text, re.M)
    assert re.search(r"^ARG TORCH_INDEX=https://download\.pytorch\.org/whl/cpu$", text, re.M)
    assert 'pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"' in text
    user = re.findall(r"^USER (\S+)$", text, re.M)
    assert user and user[-1] not in ("root", "0")
    assert re.search(r'^ENTRYPOINT \["tokenfleet"\]$', text, re.M)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["tokenfleet"] == "tokenfleet.cli:main"
    for copied in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for path in copied.split():
            assert (ROOT / path).exists(), f"COPY {path}: not in the build context"
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    ignored = {line.strip() for line in lines if line.strip() and not line.startswith("#")}
    assert {".git", ".venv"} <= ignored
    assert not {"tokenfleet", "pyproject.toml", "README.md"} & ignored
    assert interpolate(services()["worker"]["build"]["context"]) == ".."


# ---- the cluster file: 6 nodes, durable mode ------------------------------------------

CLUSTER_COMPOSE = ROOT / "compose" / "docker-compose.cluster.yml"


def cluster_services() -> dict[str, dict[str, Any]]:
    data = yaml.safe_load(CLUSTER_COMPOSE.read_text())
    result: dict[str, dict[str, Any]] = data["services"]
    return result


def test_the_cluster_has_six_durable_nodes_formed_with_a_replica_each() -> None:
    svcs = cluster_services()
    nodes = {name: svc for name, svc in svcs.items() if name.startswith("redis-")}
    assert len(nodes) == 6
    for svc in nodes.values():
        command = [str(arg) for arg in svc["command"]]
        assert option(command, "--cluster-enabled") == "yes"
        assert option(command, "--appendonly") == "yes"
        assert option(command, "--maxmemory-policy") == "noeviction"
    init = " ".join(str(part) for part in svcs["cluster-init"]["command"])
    assert "--cluster create" in init and "--cluster-replicas 1" in init
    assert all(f"redis-{i}" in init for i in range(1, 7))


@pytest.mark.parametrize("service", ["worker", "gateway"])
def test_the_cluster_fleet_runs_durable_on_a_cluster_url(service: str) -> None:
    svc = cluster_services()[service]
    command = [interpolate(str(arg)) for arg in svc["command"]]
    assert option(command, "--redis-url").startswith("redis+cluster://")
    assert option(command, "--wait-replicas") == "1"
    assert svc["environment"]["TOKENFLEET_PARTITIONS"] == "12"  # one P for the fleet
    assert svc["depends_on"]["cluster-init"]["condition"] == "service_completed_successfully"
    group = typer.main.get_command(app)
    sub, args = command[0], command[1:]
    group.commands[sub].make_context(sub, list(args))  # the real CLI parses it
