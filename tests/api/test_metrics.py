"""``GET /metrics``: the API's requests counted and timed by route template (never by id),
jobs by status and the queue's length from the database, in Prometheus's text format; the
operator's bearer token for it; ``/readyz``'s answer."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from conftest import auth, upload_chat
from raycluster import free_port
from tunefleet.api import create_app
from tunefleet.platform import metrics
from tunefleet.platform.settings import Settings, get_settings


def _value(text: str, sample: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(sample + " "))
    return float(line.rsplit(" ", 1)[1])


def test_metrics_count_requests_by_route_and_jobs_by_status(
    app_client: TestClient, key_a: str
) -> None:
    for _ in range(3):
        missing = app_client.get("/v1/fine_tuning/jobs/ftjob-nothere", headers=auth(key_a))
        assert missing.status_code == 404
    f = upload_chat(app_client, key_a)
    job = app_client.post(
        "/v1/fine_tuning/jobs",
        headers=auth(key_a),
        json={"model": "tiny-llama", "training_file": f["id"]},
    )
    assert job.status_code == 200, job.text

    scraped = app_client.get("/metrics")
    assert scraped.status_code == 200
    assert scraped.headers["content-type"].startswith("text/plain")
    text = scraped.text
    by_route = (
        'tunefleet_api_requests_total{method="GET",route="/v1/fine_tuning/jobs/{job_id}",'
        'status="404"}'
    )
    assert _value(text, by_route) >= 3
    assert "ftjob-nothere" not in text  # ids never become label values
    assert _value(text, 'tunefleet_jobs{status="validating_files"}') == 1
    assert _value(text, 'tunefleet_jobs{status="running"}') == 0
    assert _value(text, "tunefleet_queue_length") == 1
    timed = 'tunefleet_api_request_seconds_count{method="POST",route="/v1/fine_tuning/jobs"}'
    assert _value(text, timed) >= 1


TOKEN = "metrics-token-of-the-operator"


def test_with_a_token_set_only_its_bearer_scrapes_the_api_and_the_controller(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/metrics was open to whoever reached the port. With TUNEFLEET_METRICS_TOKEN set,
    the API's and the controller's health port's /metrics answer 401 without it."""
    client = TestClient(create_app(settings.model_copy(update={"metrics_token": TOKEN})))
    for sent in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        refused = client.get("/metrics", headers=sent)
        assert refused.status_code == 401, sent
        assert "TUNEFLEET_METRICS_TOKEN" in refused.json()["error"]["message"]
        assert "tunefleet_jobs" not in refused.text
    scraped = client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert scraped.status_code == 200 and "tunefleet_queue_length" in scraped.text
    assert TestClient(create_app(settings)).get("/metrics").status_code == 200  # no token

    from tunefleet.cli.main import serve_health

    monkeypatch.setenv("TUNEFLEET_METRICS_TOKEN", TOKEN)
    monkeypatch.setenv("TUNEFLEET_DATABASE_URL", settings.resolved_database_url)
    get_settings.cache_clear()
    port = free_port()
    server = serve_health(port, lambda: (True, {}))
    try:
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/metrics").status_code == 401
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert "tunefleet_queue_length" in httpx.get(f"{url}/metrics", headers=bearer).text
        assert httpx.get(f"{url}/healthz").status_code == 200  # probes need no token
    finally:
        server.shutdown()
        server.server_close()
        get_settings.cache_clear()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_jobs_are_counted_once_per_few_seconds_of_scrapes(
    app_client: TestClient, key_a: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every scrape counted every job in the database, by every process; now a count
    serves scrapes for JOBS_CACHE_S."""
    clock = Clock()
    monkeypatch.setattr(metrics, "time", clock)
    assert _value(app_client.get("/metrics").text, "tunefleet_queue_length") == 0
    f = upload_chat(app_client, key_a)
    body = {"model": "tiny-llama", "training_file": f["id"]}
    assert app_client.post("/v1/fine_tuning/jobs", headers=auth(key_a), json=body).is_success
    clock.now += metrics.JOBS_CACHE_S - 0.1
    assert _value(app_client.get("/metrics").text, "tunefleet_queue_length") == 0
    clock.now += 0.2
    assert _value(app_client.get("/metrics").text, "tunefleet_queue_length") == 1


def test_readyz_names_what_is_away_but_no_internal_address(settings: Settings) -> None:
    """/readyz, which anyone reaching the API may ask, said where Ray's dashboard is;
    now it says only that Ray is unreachable (the address goes to the API's log)."""
    away = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    app = create_app(settings.model_copy(update={"ray_dashboard_url": away}))
    answer: Any = TestClient(app).get("/readyz")
    assert answer.status_code == 503
    assert answer.json() == {
        "status": "not ready",
        "database": "ok",
        "ray": "unreachable: ConnectError",
    }
    assert "127.0.0.1" not in answer.text
