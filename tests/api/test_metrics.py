"""``GET /metrics``: the API's requests counted and timed by route template (never by id),
jobs by status and the queue's length from the database, in Prometheus's text format."""

from __future__ import annotations

from fastapi.testclient import TestClient

from conftest import auth, upload_chat


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
