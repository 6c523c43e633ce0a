"""docker-compose.yaml cannot run here (no Docker engine); check its structure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.servers import ROOT


def load() -> dict[str, Any]:
    data = yaml.safe_load(Path(ROOT, "docker-compose.yaml").read_text())
    assert isinstance(data, dict)
    return data


def test_services_redis_two_workers_and_beat() -> None:
    services = load()["services"]
    assert set(services) >= {"redis", "worker1", "worker2", "beat"}
    assert services["redis"]["image"].startswith("redis:")
    assert "noeviction" in services["redis"]["command"]


def test_celery_services_run_the_example_app_against_the_compose_redis() -> None:
    services = load()["services"]
    for name in ("worker1", "worker2", "beat"):
        service = services[name]
        assert "celery -A examples.app" in service["command"]
        assert service["environment"]["REDIS_URL"] == "redis://redis:6379"
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
        assert service["volumes"] == [".:/app"]
    assert " worker " in services["worker1"]["command"]
    assert " beat " in services["beat"]["command"]
    assert services["worker1"]["command"] != services["worker2"]["command"]  # distinct node names


def test_the_app_module_the_services_name_exists() -> None:
    assert Path(ROOT, "examples", "app.py").is_file()
