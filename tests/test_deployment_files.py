"""compose.yaml and the Dockerfile, checked as far as a machine without a Docker engine can:
they parse, every command is a real `llmbus` subcommand, and ports, health checks and
environment names agree with what the code reads."""

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SERVICE_COMMANDS = {"model-fetch", "scheduler", "tokenizer", "worker", "gateway"}


class _ComposeLoader(yaml.SafeLoader):
    pass


# Compose's own `!reset` tag (override files) means "drop this key".
_ComposeLoader.add_constructor("!reset", lambda loader, node: None)


def load(name: str) -> dict:
    return yaml.load((ROOT / name).read_text(), Loader=_ComposeLoader)


@pytest.fixture(scope="module")
def compose() -> dict:
    return load("compose.yaml")


def test_compose_has_every_part_of_a_deployment(compose):
    services = compose["services"]
    assert {"nats-1", "nats-2", "nats-3", "jaeger"} | SERVICE_COMMANDS <= set(services)
    assert services["tokenizer"]["deploy"]["replicas"] == 2
    gpu = services["worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert "models" in compose["volumes"]
    cpu = load("compose.cpu.yaml")["services"]["worker"]
    assert cpu["deploy"] is None  # `!reset`: no GPU reservation
    for name in SERVICE_COMMANDS - {"model-fetch"}:
        assert services[name]["depends_on"]["model-fetch"]["condition"] == "service_completed_successfully"


def test_every_compose_command_is_a_real_llmbus_subcommand(compose):
    for name in SERVICE_COMMANDS:
        command = compose["services"][name]["command"]
        result = subprocess.run([sys.executable, "-m", "llmbus", *command, "--help"],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"{name}: {result.stderr}"
        assert "usage: llmbus" in result.stdout


def test_environment_names_are_ones_the_code_reads(compose):
    import argparse

    from llmbus.cli.main import build_parser
    from shared.flags import env_name

    # every flag of every command reads its LLMBUS_* variable (shared/flags.py), the engine's
    # (shared/engine_args.py) as the services' own
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    read = {env_name(a.dest) for command in commands.values() for a in command._actions if a.option_strings}
    read |= {"LLMBUS_HOME"}
    standard_otel = {"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG"}
    for name, service in compose["services"].items():
        for key in service.get("environment") or {}:
            if key.startswith("LLMBUS_"):
                assert key in read, f"{name} sets {key}, which no flag reads"
            elif key.startswith("OTEL_"):
                assert key in standard_otel, f"{name} sets {key}"
    assert "LLMBUS_HOME" in (ROOT / "llmbus" / "model_fetch.py").read_text()


def test_gateway_port_and_health_check_match_the_code(compose):
    gateway = compose["services"]["gateway"]
    env = gateway["environment"]
    assert env["LLMBUS_HOST"] == "0.0.0.0"
    assert gateway["ports"] == [f"{env['LLMBUS_PORT']}:{env['LLMBUS_PORT']}"]
    check = " ".join(gateway["healthcheck"]["test"])
    assert f"127.0.0.1:{env['LLMBUS_PORT']}/health" in check
    app = (ROOT / "services" / "gateway" / "app.py").read_text()
    assert '@app.get("/health")' in app and '@app.get("/metrics")' in app
    nodes = ["nats-1", "nats-2", "nats-3"]
    for name in SERVICE_COMMANDS:
        urls = compose["services"][name]["environment"]["LLMBUS_NATS_URL"].split(",")
        assert urls == [f"nats://{node}:4222" for node in nodes]
    for node in nodes:  # a full mesh: each node routes to the other two
        command = compose["services"][node]["command"]
        routes = command[command.index("--routes") + 1].split(",")
        assert routes == [f"nats://{other}:6222" for other in nodes if other != node]
        assert command[command.index("--cluster_name") + 1] == "llmbus"


def test_jaeger_receives_otlp_where_services_send_it(compose):
    endpoint = compose["services"]["gateway"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
    assert "jaeger:4318" in endpoint  # OTLP/HTTP, what shared/tracing.py exports
    assert compose["services"]["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert "from opentelemetry.exporter.otlp.proto.http" in (ROOT / "shared" / "tracing.py").read_text()


def test_dockerfile_installs_the_project_from_pyproject_like_make_install():
    dockerfile = (ROOT / "Dockerfile").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert dockerfile.count("FROM ") >= 2  # multi-stage
    assert re.search(r"^USER llmbus$", dockerfile, re.M)
    assert 'ENTRYPOINT ["llmbus"]' in dockerfile
    # Both install the project itself from pyproject.toml (no second list of pins), with
    # extras that pyproject defines.
    assert "COPY pyproject.toml" in dockerfile and 'pip install ".${EXTRAS:+[$EXTRAS]}"' in dockerfile
    assert "-e '.[test]'" in makefile
    for package in ("llmbus", "shared", "services", "kernels"):
        assert f"COPY {package} ./{package}" in dockerfile
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_the_image_can_build_the_cpu_kernels(tmp_path):
    """The wheel carries the C++ sources of kernels/cpu and the run stage has a compiler,
    so a worker in a container builds them for its CPU like one started by `make serve`."""
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                             "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (wheel,) = tmp_path.glob("llmbus-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {f"kernels/cpu/{p.name}" for p in (ROOT / "kernels" / "cpu").iterdir() if p.suffix in (".cpp", ".h")}
    assert sources and sources <= names
    run_stage = (ROOT / "Dockerfile").read_text().rsplit("FROM ", 1)[1]
    assert re.search(r"apt-get install[^\n]*\bg\+\+", run_stage)
