"""The dashboard (``/ui``) without a browser: sign-in and its cookie, CSRF, the security
headers, tenant scoping, the jobs list's filters, actions, charts, the file preview and the
cluster view, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import re
import stat
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import select, update

from conftest import auth as H
from conftest import make_tenant, upload_chat
from dashboard_client import admin_key, csrf_of, move, new_job, sign_in
from tunefleet.api import create_app
from tunefleet.api.ui import _charts as charts
from tunefleet.api.ui import _queries as queries
from tunefleet.api.ui import _usage as usage
from tunefleet.api.ui._cluster import fetch_cluster, parse_nodes
from tunefleet.api.ui._render import CSP
from tunefleet.platform.db import ApiKey, JobEvent, Tenant, session_scope
from tunefleet.platform.progress import record_metrics
from tunefleet.platform.settings import Settings
from tunefleet.platform.status import JobStatus, add_event, transition
from tunefleet.platform.tenants import PREFIX_LEN

S = JobStatus


def status_of(client: TestClient, key: str, job_id: str) -> str:
    status: str = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=H(key)).json()["status"]
    return status


# -- sign-in, cookie, sign-out, revocation ----------------------------------------------


def test_sign_in_sets_a_signed_http_only_strict_cookie(app_client: TestClient, key_a: str) -> None:
    form = app_client.get("/ui/signin")
    resp = app_client.post(
        "/ui/signin",
        data={"csrf_token": csrf_of(form.text), "api_key": key_a, "next": "/ui/files"},
        follow_redirects=False,
    )
    assert resp.status_code == 303 and resp.headers["location"] == "/ui/files"
    cookies = {c.split("=", 1)[0]: c for c in resp.headers.get_list("set-cookie")}
    cookie = cookies["tunefleet_session"]
    flags = {f.strip().lower() for f in cookie.split(";")[1:]}
    assert {"httponly", "path=/ui", "samesite=strict", "max-age=43200"} <= flags, cookie
    assert "secure" not in flags  # plain HTTP here; Secure over HTTPS
    value = cookie.split(";", 1)[0].split("=", 1)[1]
    assert key_a not in value and key_a[PREFIX_LEN:] not in value  # never the key itself
    assert 'tunefleet_signin=""' in cookies["tunefleet_signin"]  # the form's token is spent
    page = app_client.get("/ui/files")
    assert page.status_code == 200 and "tenant-a" in page.text
    # the sign-in page (where a visitor from another site lands without the Strict
    # cookie) never replaces a session
    assert "tunefleet_session" not in app_client.get("/ui/signin").headers.get("set-cookie", "")
    assert app_client.get("/ui", follow_redirects=False).status_code == 200


def test_the_cookie_is_secure_behind_a_tls_proxy_the_api_believes(
    live_server: Any, settings: Settings
) -> None:
    """Behind the chart's TLS ingress the cookie was never Secure: uvicorn believed
    X-Forwarded-Proto from 127.0.0.1 alone. The proxies believed are
    ``forwarded_allow_ips`` (real uvicorn, as ``tunefleet api`` runs it); a request through
    one that says https gets Secure cookies, one from elsewhere saying so is not believed."""
    import httpx

    def signin_cookie(proxies: str) -> set[str]:
        url = live_server(settings=settings.model_copy(update={"forwarded_allow_ips": proxies}))
        resp = httpx.get(f"{url}/ui/signin", headers={"X-Forwarded-Proto": "https"})
        assert resp.status_code == 200
        (cookie,) = [c for c in resp.headers.get_list("set-cookie") if "tunefleet_signin=" in c]
        return {f.strip().lower() for f in cookie.split(";")[1:]}

    assert "secure" in signin_cookie("10.0.0.0/8,127.0.0.1")  # this test is the proxy
    assert "secure" not in signin_cookie("10.0.0.0/8")  # a client claiming https


def test_a_wrong_key_is_refused_and_signs_nobody_in(app_client: TestClient, key_a: str) -> None:
    form = app_client.get("/ui/signin")
    wrong = key_a[:-4] + "abcd"
    resp = app_client.post(
        "/ui/signin",
        data={"csrf_token": csrf_of(form.text), "api_key": wrong},
        follow_redirects=False,
    )
    assert resp.status_code == 401
    assert "is not valid or was revoked" in resp.text and wrong not in resp.text
    assert app_client.get("/ui/jobs", follow_redirects=False).status_code == 303
    not_a_key = app_client.post(
        "/ui/signin",
        data={"csrf_token": csrf_of(resp.text), "api_key": "hunter2"},
        follow_redirects=False,
    )
    assert not_a_key.status_code == 401 and "is not a TuneFleet key" in not_a_key.text


def test_pages_need_a_session(app_client: TestClient) -> None:
    resp = app_client.get("/ui/jobs?status=queued", follow_redirects=False)
    assert resp.status_code == 303
    assert resp.headers["location"] == "/ui/signin?next=%2Fui%2Fjobs%3Fstatus%3Dqueued"
    polled = app_client.get(
        "/ui/jobs/table",
        headers={"HX-Request": "true", "HX-Current-URL": "http://testserver/ui/jobs"},
        follow_redirects=False,
    )
    assert polled.headers["HX-Redirect"] == "/ui/signin?next=%2Fui%2Fjobs"
    # after signing in, only a dashboard path is followed
    form = app_client.get("/ui/signin")
    assert 'name="next" value="/ui"' in app_client.get("/ui/signin?next=//evil.example").text
    assert form.status_code == 200


def test_sign_out_ends_the_session(app_client: TestClient, key_a: str) -> None:
    csrf = sign_in(app_client, key_a)
    copied = app_client.cookies["tunefleet_session"]
    other = TestClient(app_client.app)  # the same key, signed in elsewhere
    sign_in(other, key_a)
    assert app_client.post("/ui/signout", follow_redirects=False).status_code == 403
    resp = app_client.post("/ui/signout", data={"csrf_token": csrf}, follow_redirects=False)
    assert resp.status_code == 303 and resp.headers["location"] == "/ui/signin"
    assert resp.headers["set-cookie"].startswith('tunefleet_session=""')
    assert app_client.get("/ui", follow_redirects=False).status_code == 303
    # a copy of the signed-out cookie is refused too, though its signature is still good
    thief = TestClient(app_client.app)
    thief.cookies.set("tunefleet_session", copied, path="/ui")
    resp = thief.get("/ui/jobs", follow_redirects=False)
    assert resp.status_code == 303 and resp.headers["location"].startswith("/ui/signin")
    # the key's other session goes on
    assert other.get("/ui/jobs", follow_redirects=False).status_code == 200


def test_a_revoked_keys_session_ends_at_once(
    app_client: TestClient, settings: Settings, key_a: str
) -> None:
    sign_in(app_client, key_a)
    assert app_client.get("/ui", follow_redirects=False).status_code == 200
    with session_scope(settings.resolved_database_url) as s:
        s.execute(update(ApiKey).where(ApiKey.prefix == key_a[:PREFIX_LEN]).values(revoked_at=1))
    resp = app_client.get("/ui", follow_redirects=False)
    assert resp.status_code == 303
    assert resp.headers["location"] == "/ui/signin?next=%2Fui&ended=revoked"
    assert "was revoked" in app_client.get(resp.headers["location"]).text


def test_the_signing_secret_is_kept_in_the_data_dir(settings: Settings, key_a: str) -> None:
    with TestClient(create_app(settings)) as first:
        sign_in(first, key_a)
        cookies = dict(first.cookies)
    secret = settings.data_dir / "ui-secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    with TestClient(create_app(settings), cookies=cookies) as restarted:
        assert restarted.get("/ui", follow_redirects=False).status_code == 200
    other = settings.model_copy(update={"ui_secret": "another-secret"})
    with TestClient(create_app(other), cookies=cookies) as rekeyed:
        assert rekeyed.get("/ui", follow_redirects=False).status_code == 303


# -- headers and CSRF -------------------------------------------------------------------


def test_every_ui_answer_has_the_security_headers(app_client: TestClient, key_a: str) -> None:
    sign_in(app_client, key_a)
    job_id = new_job(app_client, key_a)
    for path in (
        "/ui/signin",
        "/ui",
        "/ui/jobs",
        f"/ui/jobs/{job_id}",
        "/ui/files",
        "/ui/compare",
        "/ui/planner",
        "/ui/planner?model=tiny-llama&method=full&batch=2",
        "/ui/admin",
        "/ui/static/ui.css",
        "/ui/static/vendor/htmx/htmx.min.js",
        "/ui/jobs/ftjob-missing",
    ):
        resp = app_client.get(path)
        assert resp.headers["content-security-policy"] == CSP, path
        assert resp.headers["x-content-type-options"] == "nosniff"
        assert resp.headers["referrer-policy"] == "no-referrer"
        if resp.headers["content-type"].startswith("text/html"):
            assert resp.headers["cache-control"] == "no-store"
            # nothing the policy would block: no inline script, style or handler
            assert not re.search(r"<script(?![^>]*\bsrc=)", resp.text), path
            assert not re.search(r"<style|\sstyle=|\son[a-z]+=", resp.text), path
    assert "default-src 'self'" in CSP and "frame-ancestors 'none'" in CSP
    assert (
        app_client.get("/v1/models", headers=H(key_a)).headers.get("content-security-policy")
        is None
    )


def test_posts_without_the_right_csrf_token_are_refused(app_client: TestClient, key_a: str) -> None:
    csrf = sign_in(app_client, key_a)
    job_id = new_job(app_client, key_a)
    url = f"/ui/jobs/{job_id}/cancel"
    for data, headers in (({}, {}), ({"csrf_token": "forged"}, {}), ({}, {"X-CSRF-Token": "x"})):
        resp = app_client.post(url, data=data, headers=headers, follow_redirects=False)
        assert resp.status_code == 403, resp.text
        assert "CSRF token is missing or does not match" in resp.text
    assert status_of(app_client, key_a, job_id) == "validating_files"
    # the sign-in form is held to it too
    assert app_client.post("/ui/signin", data={"api_key": key_a}).status_code == 403
    # htmx sends the token as a header
    resp = app_client.post(url, headers={"X-CSRF-Token": csrf}, follow_redirects=False)
    assert resp.status_code == 303
    assert status_of(app_client, key_a, job_id) == "cancelled"


# -- scoping ----------------------------------------------------------------------------


def test_a_tenant_sees_only_its_jobs_and_an_admin_sees_all(
    app_client: TestClient, settings: Settings, key_a: str, key_b: str
) -> None:
    job_a = new_job(app_client, key_a)
    job_b = new_job(app_client, key_b)
    with TestClient(app_client.app) as b, TestClient(app_client.app) as ops:
        b_csrf = sign_in(b, key_b)
        listed = b.get("/ui/jobs").text
        assert job_b in listed and job_a not in listed
        assert job_a not in b.get("/ui").text
        assert b.get(f"/ui/jobs/{job_a}").status_code == 404
        assert b.get(f"/ui/jobs/{job_a}/live").status_code == 404
        assert b.get(f"/ui/compare?ids={job_a}").status_code == 404
        refused = b.post(f"/ui/jobs/{job_a}/cancel", data={"csrf_token": b_csrf})
        assert refused.status_code == 404
        file_a = app_client.get(f"/v1/fine_tuning/jobs/{job_a}", headers=H(key_a)).json()
        assert b.get(f"/ui/files/{file_a['training_file']}").status_code == 404

        sign_in(ops, admin_key(settings))
        everything = ops.get("/ui/jobs").text
        assert job_a in everything and job_b in everything and "tenant-a" in everything
        assert ops.get(f"/ui/jobs/{job_a}").status_code == 200
        tenant_a = file_a["organization_id"]
        only_a = ops.get(f"/ui/jobs?tenant={tenant_a}").text
        assert job_a in only_a and job_b not in only_a
    assert status_of(app_client, key_a, job_a) == "validating_files"


def test_jobs_list_filters(app_client: TestClient, settings: Settings, key_a: str) -> None:
    search = new_job(app_client, key_a, metadata={"team": "search"})
    ads = new_job(app_client, key_a, metadata={"team": "ads"})
    move(settings, ads, S.QUEUED)
    sign_in(app_client, key_a)

    def listed(query: str) -> set[str]:
        resp = app_client.get(f"/ui/jobs/table?{query}")
        assert resp.status_code == 200
        return set(re.findall(r'id="link-(ftjob-[A-Za-z0-9]+)"', resp.text)) & {search, ads}

    assert listed("") == {search, ads}
    assert listed("metadata=team%3Dsearch") == {search}
    assert listed("status=queued") == {ads}
    assert listed("status=queued&metadata=team%3Dsearch") == set()
    assert listed("model=tiny-llama") == {search, ads}
    assert listed("model=other") == set()
    assert "No job matches these filters" in app_client.get("/ui/jobs?model=other").text
    bad = app_client.get("/ui/jobs?metadata=team")
    assert bad.status_code == 400 and "is not key=value" in bad.text
    assert app_client.get("/ui/jobs?status=dancing").status_code == 400
    # the table polls itself with the same filters
    table = app_client.get("/ui/jobs?status=queued").text
    assert 'hx-get="/ui/jobs/table?status=queued"' in table and 'hx-trigger="every 3s"' in table


def test_jobs_list_pages(app_client: TestClient, key_a: str) -> None:
    made = [new_job(app_client, key_a) for _ in range(27)]
    sign_in(app_client, key_a)
    first = app_client.get("/ui/jobs").text
    older = re.search(r'href="(/ui/jobs\?after=[^"]+)" id="older-jobs"', first)
    assert older is not None
    second = app_client.get(older.group(1).replace("&amp;", "&")).text
    shown = set(re.findall(r'id="link-(ftjob-[A-Za-z0-9]+)"', first + second))
    assert shown == set(made) and 'id="older-jobs"' not in second


# -- actions ----------------------------------------------------------------------------


def test_pause_resume_and_cancel_through_the_state_machine(
    app_client: TestClient, settings: Settings, key_a: str
) -> None:
    csrf = sign_in(app_client, key_a)
    job_id = new_job(app_client, key_a)
    move(settings, job_id, S.QUEUED, S.RUNNING)
    page = app_client.get(f"/ui/jobs/{job_id}").text
    assert f'action="/ui/jobs/{job_id}/pause"' in page and "/resume" not in page

    def act(action: str) -> Any:
        return app_client.post(
            f"/ui/jobs/{job_id}/{action}", data={"csrf_token": csrf}, follow_redirects=False
        )

    resp = act("pause")
    assert resp.status_code == 303 and resp.headers["location"] == f"/ui/jobs/{job_id}?done=pause"
    assert "Pause requested." in app_client.get(resp.headers["location"]).text
    assert status_of(app_client, key_a, job_id) == "paused"
    assert act("resume").status_code == 303
    assert status_of(app_client, key_a, job_id) == "queued"
    assert act("cancel").status_code == 303
    assert status_of(app_client, key_a, job_id) == "cancelled"
    refused = act("cancel")
    assert refused.status_code == 409
    assert (
        f"job {job_id} is cancelled" in refused.text and "cannot move to cancelled" in refused.text
    )
    assert '/cancel"' not in app_client.get(f"/ui/jobs/{job_id}").text  # no button left


# -- charts and the job page -------------------------------------------------------------


def polyline_points(svg: str) -> list[list[tuple[float, float]]]:
    lines = re.findall(r'<polyline [^>]*points="([^"]*)"', svg)
    return [[tuple(map(float, p.split(","))) for p in line.split()] for line in lines]  # type: ignore[misc]


def test_line_chart_draws_each_point_and_log_scale_remaps_y() -> None:
    pts = [(1.0, 4.0), (2.0, 2.0), (3.0, 1.0), (4.0, 0.5)]
    linear = charts.line_chart([charts.Series("train", pts)], title="Loss", desc="d")
    log = charts.line_chart([charts.Series("train", pts)], title="Loss", desc="d", log_y=True)
    (lin,) = polyline_points(linear)
    (lg,) = polyline_points(log)
    assert len(lin) == len(lg) == 4
    assert [x for x, _ in lin] == [x for x, _ in lg]
    # linear: equal steps in y for equal differences; log: equal steps for equal ratios
    lin_gaps = [round(lin[i + 1][1] - lin[i][1], 1) for i in range(3)]
    log_gaps = [round(lg[i + 1][1] - lg[i][1], 1) for i in range(3)]
    assert len(set(log_gaps)) == 1 and len(set(lin_gaps)) == 3
    assert "<title id=" in linear and "<desc id=" in linear and 'role="img"' in linear
    assert ">step<" in linear and ">loss<" in linear and "loss (log scale)" in log
    assert all(f">{label}</text>" in log for label in ("0.5", "1", "2"))  # round log ticks
    # log scale leaves out what it cannot draw; long series are thinned
    with_zero = charts.line_chart([charts.Series("t", [(1, 0.0), (2, 1.0)])], title="t",
                                  desc="d", log_y=True)  # fmt: skip
    assert len(polyline_points(with_zero)[0]) == 1
    many = [(float(i), 1.0 / (i + 1)) for i in range(2000)]
    (thinned,) = polyline_points(charts.line_chart([charts.Series("t", many)], title="t", desc="d"))
    assert len(thinned) == charts.MAX_POINTS
    assert "No points yet" in charts.line_chart([charts.Series("t", [])], title="t", desc="d")
    assert "&lt;b&gt;" in charts.line_chart([charts.Series("<b>", pts)], title="t", desc="d")


def test_job_page_shows_loss_figures_and_polls_while_running(
    app_client: TestClient, settings: Settings, key_a: str
) -> None:
    job_id = new_job(app_client, key_a)
    move(settings, job_id, S.QUEUED, S.RUNNING)
    with session_scope(settings.resolved_database_url) as s:
        for step in (1, 2, 3):
            metrics = {"train_loss": 2.0 / step, "tokens_per_s": 1234.5, "mfu": 0.25,
                       "peak_memory_bytes": 3 * 2**30}  # fmt: skip
            if step == 3:
                metrics["valid_loss"] = 0.9
            record_metrics(s, job_id, step=step, total_steps=10, metrics=metrics,
                           trained_tokens=100 * step, eta_s=5.0)  # fmt: skip
    sign_in(app_client, key_a)
    page = app_client.get(f"/ui/jobs/{job_id}").text
    train, valid = polyline_points(page)
    assert len(train) == 3 and len(valid) == 1
    assert 'hx-get="/ui/jobs/' in page and 'hx-trigger="every 3s"' in page
    assert "step 3/10" in page and "1,234" in page and "25.0%" in page and "3.0 GiB" in page
    assert "Created fine-tuning job" in page  # the timeline
    live = app_client.get(f"/ui/jobs/{job_id}/live?scale=log").text
    assert live.startswith('<section id="job-live"') and "(log scale)" in live
    assert "?scale=log" in live  # it keeps polling on the log scale
    with session_scope(settings.resolved_database_url) as s:
        record_metrics(s, job_id, step=4, total_steps=10, metrics={"train_loss": 0.4},
                       trained_tokens=400, eta_s=None)  # fmt: skip
        add_event(s, job_id, "something odd", level="warn")
    assert len(polyline_points(app_client.get(f"/ui/jobs/{job_id}/live").text)[0]) == 4
    warn_only = app_client.get(f"/ui/jobs/{job_id}?level=warn").text
    events = warn_only[warn_only.index('id="events-h"') :]
    assert "something odd" in events and "Step 4/10" not in events
    move_to_cancelled = app_client.post(
        f"/ui/jobs/{job_id}/cancel", data={"csrf_token": csrf_of(page)}, follow_redirects=False
    )
    assert move_to_cancelled.status_code == 303
    assert "hx-trigger" not in app_client.get(f"/ui/jobs/{job_id}/live").text  # stops polling


def test_compare_draws_one_curve_per_job(
    app_client: TestClient, settings: Settings, key_a: str
) -> None:
    jobs = [new_job(app_client, key_a) for _ in range(3)]
    with session_scope(settings.resolved_database_url) as s:
        for n, job_id in enumerate(jobs):
            for step in range(1, n + 3):
                record_metrics(s, job_id, step=step, total_steps=9, metrics={"train_loss": 1.0},
                               trained_tokens=step, eta_s=None)  # fmt: skip
    sign_in(app_client, key_a)
    page = app_client.get(f"/ui/compare?ids={jobs[0]},{jobs[1]}&job={jobs[2]}").text
    assert [len(p) for p in polyline_points(page)] == [4, 2, 3]  # ?job= first, then ?ids=
    assert "Name the jobs to compare" in app_client.get("/ui/compare").text


def test_file_page_shows_its_first_lines_escaped(app_client: TestClient, key_a: str) -> None:
    evil = {
        "messages": [
            {"role": "user", "content": "<script>alert(1)</script>"},
            {"role": "assistant", "content": "ok"},
        ]
    }
    body = "\n".join(json.dumps(evil) for _ in range(30)).encode()
    f = app_client.post(
        "/v1/files",
        headers=H(key_a),
        data={"purpose": "fine-tune"},
        files={"file": ("evil.jsonl", body)},
    ).json()
    sign_in(app_client, key_a)
    assert f["id"] in app_client.get("/ui/files").text
    page = app_client.get(f"/ui/files/{f['id']}").text
    assert "<script>alert" not in page
    assert page.count("&lt;script&gt;alert(1)&lt;/script&gt;") == 20  # the first 20 lines
    assert "30 example(s)" in page and "these are its first 20 lines" in page


# -- overview and the cluster ------------------------------------------------------------


def test_overview_shows_queue_running_failures_and_an_unreachable_ray(
    settings: Settings, key_a: str
) -> None:
    offline = settings.model_copy(update={"ray_dashboard_url": "http://127.0.0.1:9"})
    with TestClient(create_app(offline)) as client:
        waiting = new_job(client, key_a)
        running = new_job(client, key_a)
        failed = new_job(client, key_a)
        move(settings, waiting, S.QUEUED)
        move(settings, running, S.QUEUED, S.RUNNING)
        move(settings, failed, S.QUEUED, S.RUNNING)
        with session_scope(settings.resolved_database_url) as s:
            add_event(s, waiting, "Waiting in queue at position 2: the cluster is full",
                      data={"queue_position": 2, "reason": "the cluster is full"})  # fmt: skip
            record_metrics(s, running, step=7, total_steps=20, metrics={"train_loss": 1.5},
                           trained_tokens=70, eta_s=None)  # fmt: skip
            transition(s, failed, S.RUNNING, S.FAILED, "failed",
                       error={"code": "x", "message": "out of memory", "param": None})  # fmt: skip
        sign_in(client, key_a)
        page = client.get("/ui").text
        queue = page[page.index('id="queue-h"') : page.index('id="running-h"')]
        assert waiting in queue and "the cluster is full" in queue
        assert 'data-label="Position">2</td>' in queue
        assert "step 7/20" in page and "out of memory" in page
        assert "Ray unreachable" not in page  # tenants are not shown the machines
        with TestClient(client.app) as ops:
            sign_in(ops, admin_key(settings))
            ops_page = ops.get("/ui/overview/live").text
            assert "Ray unreachable at http://127.0.0.1:9" in ops_page


def test_cluster_nodes_are_read_from_rays_node_summary() -> None:
    payload = {
        "result": True,
        "data": {
            "summary": [
                {
                    "hostname": "worker-1",
                    "mem": [64 * 2**30, 40 * 2**30, 37.5, 24 * 2**30],
                    "raylet": {"nodeId": "b" * 56, "state": "ALIVE",
                               "resourcesTotal": {"CPU": 16.0, "GPU": 2.0}},
                },
                {
                    "hostname": "head",
                    "mem": [8 * 2**30, 6 * 2**30, 25.0, 2 * 2**30],
                    "raylet": {"nodeId": "a" * 56, "state": "ALIVE", "isHeadNode": True,
                               "resourcesTotal": {"CPU": 4.0}},
                },
            ],
            "nodeLogicalResources": {"b" * 56: "6.0/16.0 CPU\n1.0/2.0 GPU\n0B/40GiB memory"},
        },
    }  # fmt: skip
    head, worker = parse_nodes(payload)
    assert head.head and head.host == "head" and head.cpus == 4 and head.cpus_used is None
    assert (worker.cpus, worker.cpus_used, worker.gpus, worker.gpus_used) == (16, 6, 2, 1)
    assert worker.memory == 64 * 2**30 and worker.memory_used == 24 * 2**30
    assert parse_nodes({"data": {}}) == []
    view = fetch_cluster("http://127.0.0.1:9", timeout=0.5)
    assert view.nodes == [] and view.error is not None
    assert view.error.startswith("Ray unreachable at http://127.0.0.1:9")


def test_empty_states(app_client: TestClient, settings: Settings) -> None:
    sign_in(app_client, make_tenant(settings.resolved_database_url, "tenant-c"))
    assert "No jobs yet" in app_client.get("/ui/jobs").text
    assert "No files yet" in app_client.get("/ui/files").text
    overview = app_client.get("/ui").text
    assert "No job is waiting" in overview and "No job is running" in overview
    assert "No job has failed" in overview


# -- the planner page and memory charts ---------------------------------------------------


def test_memory_chart_stacks_each_part_to_scale() -> None:
    rows = [
        ("DDP", {"weights": 600.0, "gradients": 200.0, "optimizer": 0.0, "activations": 200.0}),
        ("+ checkpointing", {"weights": 600.0, "activations": 100.0, "logits": 50.0}),
    ]
    svg = str(charts.memory_chart(rows, device_bytes=2000, budget_bytes=1800, title="T", desc="D"))
    segs = re.findall(r'class="part part-(\w+)" x="([\d.]+)" y="(\d+)" width="([\d.]+)"', svg)
    # one segment per non-zero part, in the stacking order, each as wide as its share
    assert [(name, y) for name, _, y, _ in segs] == [
        ("weights", "12"), ("gradients", "12"), ("activations", "12"),
        ("weights", "52"), ("activations", "52"), ("logits", "52"),
    ]  # fmt: skip
    scale = float(segs[0][3]) / 600
    assert abs(float(segs[1][3]) - 200 * scale) < 0.2 and abs(float(segs[5][3]) - 50 * scale) < 0.2
    first_x = [float(x) for _, x, _, _ in segs[:3]]
    assert first_x[1] == first_x[0] + float(segs[0][3])  # stacked end to end
    # the device line sits at the device's size on the same scale, the budget before it
    lines = dict(re.findall(r'class="limit limit-(\w+)" x1="([\d.]+)"', svg))
    assert abs(float(lines["device"]) - first_x[0] - 2000 * scale) < 0.2
    assert float(lines["budget"]) < float(lines["device"])
    assert "<title>DDP: gradients 0.0 MiB</title>" in svg  # each segment says its size
    assert 'role="img"' in svg and "<desc" in svg


def test_the_planner_page_draws_the_seeds_chart_of_the_same_plan_as_the_api(
    app_client: TestClient, key_a: str
) -> None:
    sign_in(app_client, key_a)
    empty = app_client.get("/ui/planner")
    assert empty.status_code == 200 and "Choose a model" in empty.text
    query = "model=tiny-llama&method=full&precision=fp32&batch=4&seq=256&gpus=2&memory=0.012"
    page = app_client.get(f"/ui/planner?{query}")
    assert page.status_code == 200, page.text
    body = {
        "model": "tiny-llama",
        "training_file": "file-planner",
        "hyperparameters": {"n_epochs": 1, "batch_size": 8},
        "device_memory_gb": 0.012,
        "tunefleet": {
            "method": "full",
            "precision": "fp32",
            "max_seq_len": 256,
            "micro_batch_size": 4,
            "resources": {"num_workers": 2, "gpus_per_worker": 1},
        },
    }
    plan = app_client.post("/v1/plans", headers=H(key_a), json=body).json()
    # four bars, one per step, and a table row per step with the API's numbers
    assert len(plan["chart"]) == 4
    assert page.text.count('<th scope="row">') >= 4
    for step in plan["chart"]:
        total = step["breakdown"]["total"]
        shown = f"{total / 2**20:.1f} MiB" if total < 2**30 else f"{total / 2**30:.1f} GiB"
        assert shown in page.text, (step, shown)
    # on this small device the chart has to climb: not every step fits
    fits = [s["fits"] for s in plan["chart"]]
    assert not fits[0] and any(fits)
    assert page.text.count('class="part part-weights"') == 4
    assert "Fits</strong> with" in page.text or "Does not fit" in page.text
    # what job creation would run is the API's advice
    advice = plan["advice"]
    assert f"{advice['per_device_batch']} example(s) per GPU" in page.text or not advice["fits"]


def test_the_planner_page_says_what_is_wrong_with_its_form(
    app_client: TestClient, key_a: str
) -> None:
    sign_in(app_client, key_a)
    for query, said in (
        ("model=tiny-llama&batch=lots", "batch 'lots' is not a whole number"),
        ("model=tiny-llama&gpus=0", "gpus 0 is out of range; use 1 to 4096"),
        ("model=tiny-llama&memory=-1", "device memory -1 GiB is out of range"),
        ("model=tiny-llama&method=sorcery", "method 'sorcery'"),
        ("model=no-such-model", "no-such-model"),
    ):
        resp = app_client.get(f"/ui/planner?{query}")
        assert resp.status_code == 400, query
        assert said in resp.text.replace("&#39;", "'"), (query, resp.text[-2000:])
        assert 'class="problem"' in resp.text


def test_a_job_page_draws_its_memory_plan(app_client: TestClient, key_a: str) -> None:
    sign_in(app_client, key_a)
    job_id = new_job(app_client, key_a)
    page = app_client.get(f"/ui/jobs/{job_id}")
    assert page.status_code == 200
    assert 'id="memory"' in page.text and page.text.count('class="part part-weights"') == 4
    plan = app_client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=H(key_a)).json()
    advice = plan["tunefleet"]["plan"]["advice"]
    assert f"the job runs <strong>{advice['strategy']}" in page.text


# -- the admin page ------------------------------------------------------------------------


def test_the_admin_page_is_for_admin_keys(
    app_client: TestClient, settings: Settings, key_a: str
) -> None:
    sign_in(app_client, key_a)
    resp = app_client.get("/ui/admin")
    assert resp.status_code == 403 and "needs an admin key" in resp.text
    assert 'href="/ui/admin"' not in app_client.get("/ui/jobs").text
    csrf = csrf_of(app_client.get("/ui/jobs").text)
    refused = app_client.post("/ui/admin/tenants", data={"csrf_token": csrf, "name": "sneaky"})
    assert refused.status_code == 403
    admin = TestClient(app_client.app)
    sign_in(admin, admin_key(settings))
    page = admin.get("/ui/admin")
    assert page.status_code == 200 and 'href="/ui/admin"' in page.text
    assert "tenant-a" in page.text and "ops" in page.text and "sneaky" not in page.text


def test_an_admin_adds_a_tenant_whose_key_is_shown_once_and_works(
    app_client: TestClient, settings: Settings
) -> None:
    admin = admin_key(settings)
    csrf = sign_in(app_client, admin)
    resp = app_client.post(
        "/ui/admin/tenants",
        data={
            "csrf_token": csrf,
            "name": "acme",
            "max_concurrent_jobs": "2",
            "max_gpus": "4",
            "max_waiting_jobs": "10",
        },
    )
    assert resp.status_code == 200 and resp.headers["cache-control"] == "no-store"
    key = re.search(r'value="(tf-[A-Za-z0-9_-]+)"', resp.text)
    assert key, resp.text
    assert app_client.get("/v1/fine_tuning/jobs", headers=H(key.group(1))).status_code == 200
    tenants = app_client.get("/v1/admin/tenants", headers=H(admin)).json()
    acme = next(t for t in tenants["data"] if t["name"] == "acme")
    assert (acme["max_concurrent_jobs"], acme["max_gpus"], acme["max_waiting_jobs"]) == (2, 4, 10)
    # shown once: the admin page lists the key by its prefix only
    page = app_client.get("/ui/admin").text
    assert key.group(1) not in page and key.group(1)[:PREFIX_LEN] in page
    # refusals name the bad value, and change nothing
    for data, status, said in (
        ({"name": "acme"}, 409, "tenant 'acme' already exists"),
        ({"name": "Bad Name"}, 400, "tenant name 'Bad Name' is invalid"),
        ({"name": "big", "max_gpus": "1000001"}, 400, "max_gpus"),
        ({"name": "nan", "max_gpus": "many"}, 400, "max_gpus"),
    ):
        resp = app_client.post("/ui/admin/tenants", data={"csrf_token": csrf, **data})
        assert resp.status_code == status, (data, resp.text[-1500:])
        assert said in resp.text.replace("&#39;", "'"), data
    listed = app_client.get("/v1/admin/tenants", headers=H(admin)).json()["data"]
    names = {t["name"] for t in listed}
    assert not names & {"big", "nan", "bad name"}


def test_quotas_set_on_the_admin_page_hold_at_the_api(
    app_client: TestClient, settings: Settings, key_a: str
) -> None:
    csrf = sign_in(app_client, admin_key(settings))
    with session_scope(settings.resolved_database_url) as s:
        tenant_id = s.scalar(select(Tenant.id).where(Tenant.name == "tenant-a"))
    url = f"/ui/admin/tenants/{tenant_id}/quotas"
    resp = app_client.post(
        url, data={"csrf_token": csrf, "max_waiting_jobs": "0"}, follow_redirects=False
    )
    assert resp.status_code == 303 and "done=quotas" in resp.headers["location"]
    f = upload_chat(app_client, key_a)
    refused = app_client.post(
        "/v1/fine_tuning/jobs",
        headers=H(key_a),
        json={"model": "tiny-llama", "training_file": f["id"]},
    )
    assert refused.status_code == 429, refused.text
    # the others were left as they were
    with session_scope(settings.resolved_database_url) as s:
        tenant = s.get(Tenant, tenant_id)
        assert tenant is not None
        assert (tenant.max_waiting_jobs, tenant.max_concurrent_jobs, tenant.max_gpus) == (0, 4, 8)
    bad = app_client.post(url, data={"csrf_token": csrf, "max_gpus": "-1"})
    assert bad.status_code == 400 and "max_gpus" in bad.text
    missing = app_client.post("/ui/admin/tenants/tenant-nope/quotas",
                              data={"csrf_token": csrf, "max_gpus": "1"})  # fmt: skip
    assert missing.status_code == 404 and "no tenant with id" in missing.text
    assert app_client.post(url, data={"max_gpus": "1"}).status_code == 403  # no CSRF token


def test_keys_created_and_revoked_on_the_admin_page(
    app_client: TestClient, settings: Settings, key_a: str
) -> None:
    csrf = sign_in(app_client, admin_key(settings))
    with session_scope(settings.resolved_database_url) as s:
        tenant_id = s.scalar(select(Tenant.id).where(Tenant.name == "tenant-a"))
    made = app_client.post(
        f"/ui/admin/tenants/{tenant_id}/keys",
        data={"csrf_token": csrf, "name": "ci runner", "admin": "on"},
    )
    assert made.status_code == 200 and "New admin key for tenant-a" in made.text
    secret = re.search(r'value="(tf-[A-Za-z0-9_-]+)"', made.text)
    assert secret
    assert app_client.get("/v1/admin/tenants", headers=H(secret.group(1))).status_code == 200
    with session_scope(settings.resolved_database_url) as s:
        key = s.scalar(select(ApiKey).where(ApiKey.name == "ci runner"))
        assert key is not None and key.is_admin and key.tenant_id == tenant_id
        key_id = key.id
    gone = app_client.post(
        f"/ui/admin/keys/{key_id}/revoke", data={"csrf_token": csrf}, follow_redirects=False
    )
    assert gone.status_code == 303 and "done=revoked" in gone.headers["location"]
    assert app_client.get("/v1/models", headers=H(secret.group(1))).status_code == 401
    assert app_client.get("/v1/models", headers=H(key_a)).status_code == 200  # others kept
    page = app_client.get("/ui/admin?done=revoked").text
    assert "Key revoked." in page and "revoked 20" in page
    missing = app_client.post("/ui/admin/keys/key-nope/revoke", data={"csrf_token": csrf})
    assert missing.status_code == 404 and "no API key with id" in missing.text


# -- adapters and serving ------------------------------------------------------------------

RAY_METRICS = """\
# HELP ray_tunefleet_adapter_requests_total Requests per adapter.
# TYPE ray_tunefleet_adapter_requests_total counter
ray_tunefleet_adapter_requests_total{adapter="ftjob-1",deployment="Base",replica="r1"} 3.0
ray_tunefleet_adapter_requests_total{adapter="ftjob-1",deployment="Base",replica="r2"} 1.0
ray_tunefleet_adapter_requests_total{adapter="base",deployment="Base",replica="r1"} 5.0
# HELP ray_tunefleet_adapter_generated_tokens_total Tokens generated.
# TYPE ray_tunefleet_adapter_generated_tokens_total counter
ray_tunefleet_adapter_generated_tokens_total{adapter="ftjob-1",replica="r1"} 40.0
# HELP ray_tunefleet_adapter_request_seconds Time from request to last token.
# TYPE ray_tunefleet_adapter_request_seconds histogram
ray_tunefleet_adapter_request_seconds_bucket{adapter="ftjob-1",le="0.1",replica="r1"} 1.0
ray_tunefleet_adapter_request_seconds_bucket{adapter="ftjob-1",le="0.5",replica="r1"} 3.0
ray_tunefleet_adapter_request_seconds_bucket{adapter="ftjob-1",le="+Inf",replica="r1"} 3.0
ray_tunefleet_adapter_request_seconds_sum{adapter="ftjob-1",replica="r1"} 0.9
ray_tunefleet_adapter_request_seconds_count{adapter="ftjob-1",replica="r1"} 3.0
ray_tunefleet_adapter_request_seconds_bucket{adapter="ftjob-1",le="0.1",replica="r2"} 0.0
ray_tunefleet_adapter_request_seconds_bucket{adapter="ftjob-1",le="0.5",replica="r2"} 1.0
ray_tunefleet_adapter_request_seconds_bucket{adapter="ftjob-1",le="+Inf",replica="r2"} 1.0
ray_tunefleet_adapter_request_seconds_sum{adapter="ftjob-1",replica="r2"} 0.3
ray_tunefleet_adapter_request_seconds_count{adapter="ftjob-1",replica="r2"} 1.0
# HELP ray_tunefleet_adapter_loads_total Adapters loaded into this replica.
# TYPE ray_tunefleet_adapter_loads_total counter
ray_tunefleet_adapter_loads_total{adapter="ftjob-1",replica="r1"} 1.0
ray_tunefleet_adapter_loads_total{adapter="ftjob-1",replica="r2"} 2.0
# HELP ray_tunefleet_adapter_evictions_total Adapters evicted (LRU).
# TYPE ray_tunefleet_adapter_evictions_total counter
ray_tunefleet_adapter_evictions_total{adapter="ftjob-1",replica="r2"} 2.0
# HELP ray_node_cpu_utilization Something else.
# TYPE ray_node_cpu_utilization gauge
ray_node_cpu_utilization{ip="10.0.0.1"} 12.0
"""


def test_adapter_usage_is_summed_from_rays_metrics_across_replicas() -> None:
    got: dict[str, usage.AdapterUsage] = {}
    usage.parse(RAY_METRICS, got)
    one = got["ftjob-1"]
    assert (one.requests, one.tokens) == (4.0, 40.0)
    assert one.mean_latency == 1.2 / 4
    # 1 of 4 under 0.1 s, all 4 under 0.5 s: the 95th percentile is inside (0.1, 0.5]
    assert one.buckets == {0.1: 1.0, 0.5: 4.0, float("inf"): 4.0}
    p95 = one.p95_latency
    assert p95 is not None and abs(p95 - (0.1 + 0.4 * (3.8 - 1) / 3)) < 1e-9
    assert one.replicas == {"r1"}  # r2 loaded it twice and evicted it twice
    assert got["base"].requests == 5.0 and set(got) == {"ftjob-1", "base"}
    assert usage.quantile({}, 0.95) is None
    assert usage.quantile({1.0: 0.0, float("inf"): 2.0}, 0.5) == 1.0  # in +Inf: the top bound


def test_adapters_page_shares_and_serving_changes(
    app_client: TestClient, settings: Settings, key_a: str, key_b: str, a_objects: dict[str, Any]
) -> None:
    model = a_objects["model"]
    csrf = sign_in(app_client, key_a)
    page = app_client.get("/ui/adapters")
    assert page.status_code == 200 and model in page.text
    assert "multiplexed on the shared base" in page.text and "Shared with" in page.text
    # Ray is not running here: the page says figures are missing, and still renders
    assert "serving figures are not available right now" in page.text
    assert "Serve merged" not in page.text  # serving changes are an admin's
    other = TestClient(app_client.app)
    other_csrf = sign_in(other, key_b)
    assert model not in other.get("/ui/adapters").text
    shared = app_client.post(
        "/ui/adapters/shares",
        data={"csrf_token": csrf, "model": model, "tenant": "tenant-b", "change": "share"},
        follow_redirects=False,
    )
    assert shared.status_code == 303 and "done=shared" in shared.headers["location"]
    seen = other.get("/ui/adapters").text
    assert model in seen and "Share with tenant" not in seen  # callable, not re-shareable
    assert "tenant-b" in app_client.get("/ui/adapters").text
    resharing = other.post(
        "/ui/adapters/shares",
        data={"csrf_token": other_csrf, "model": model, "tenant": "tenant-a"},
    )
    assert resharing.status_code == 404 and "of yours" in resharing.text
    for data, status, said in (
        ({"tenant": "No Such!"}, 400, "tenant name 'No Such!' is invalid"),
        ({"tenant": "tenant-a"}, 400, "always visible to its own tenant"),
        ({"tenant": "tenant-b", "change": "steal"}, 400, "'steal' is not share or unshare"),
    ):
        resp = app_client.post(
            "/ui/adapters/shares", data={"csrf_token": csrf, "model": model, **data}
        )
        assert resp.status_code == status and said in resp.text.replace("&#39;", "'")
    # a tenant key may not change serving
    refused = app_client.post(
        "/ui/adapters/serving", data={"csrf_token": csrf, "model": model, "change": "merged"}
    )
    assert refused.status_code == 403 and "needs an admin key" in refused.text
    unshared = app_client.post(
        "/ui/adapters/shares",
        data={"csrf_token": csrf, "model": model, "tenant": "tenant-b", "change": "unshare"},
        follow_redirects=False,
    )
    assert unshared.status_code == 303
    assert model not in other.get("/ui/adapters").text

    admin = admin_key(settings)
    admin_csrf = sign_in(other, admin)
    assert model in other.get("/ui/adapters").text  # an admin sees every tenant's
    for change, field, value in (
        ("merged", "serving_mode", "merged"),
        ("pin", "pinned", True),
        ("unpin", "pinned", False),
        ("multiplexed", "serving_mode", "multiplexed"),
    ):
        resp = other.post(
            "/ui/adapters/serving",
            data={"csrf_token": admin_csrf, "model": model, "change": change},
            follow_redirects=False,
        )
        assert resp.status_code == 303, resp.text
        listed = other.get("/v1/admin/adapters", headers=H(admin)).json()["data"]
        assert next(a for a in listed if a["model"] == model)[field] == value, change
    for data, status in (({"change": "melted"}, 400), ({"model": "ft:nope", "change": "pin"}, 404)):
        resp = other.post(
            "/ui/adapters/serving", data={"csrf_token": admin_csrf, "model": model, **data}
        )
        assert resp.status_code == status, resp.text
    no_csrf = other.post("/ui/adapters/serving", data={"model": model, "change": "merged"})
    assert no_csrf.status_code == 403


# -- the playground ------------------------------------------------------------------------


def test_the_playground_offers_what_the_key_may_call_and_refuses_the_rest(
    app_client: TestClient, key_a: str, key_b: str, a_objects: dict[str, Any]
) -> None:
    csrf = sign_in(app_client, key_a)
    page = app_client.get("/ui/playground")
    assert page.status_code == 200
    assert '<script src="/ui/static/playground.js" defer></script>' in page.text
    # column 1 the base model, column 2 the newest fine-tuned model, column 3 none
    selected = re.findall(r'<option value="([^"]*)" selected>', page.text)
    assert selected == ["tiny-llama", a_objects["model"], ""]
    assert app_client.get("/ui/static/playground.js").status_code == 200

    def ask(client: TestClient, token: str | None, body: Any) -> Any:
        headers = {"X-CSRF-Token": token} if token else {}
        return client.post("/ui/playground/chat", headers=headers, json=body)

    good = {"model": a_objects["model"], "prompt": "hi", "max_tokens": 4}
    assert ask(app_client, None, good).status_code == 403  # no CSRF token
    for body, said in (
        ({**good, "max_tokens": 0}, "max_tokens"),
        ({**good, "prompt": ""}, "prompt"),
        ({**good, "stream": False}, "stream"),
        ([1, 2], "Input should be"),
    ):
        resp = ask(app_client, csrf, body)
        assert resp.status_code == 400 and said in resp.json()["error"]["message"], body
    missing = ask(app_client, csrf, {**good, "model": "ft:nope"})
    assert (
        missing.status_code == 404
        and "'ft:nope' does not exist" in missing.json()["error"]["message"]
    )
    # Serve is not running here: the column says so, naming the base model
    down = ask(app_client, csrf, good)
    assert down.status_code == 503 and "tiny-llama" in down.json()["error"]["message"]
    other = TestClient(app_client.app)
    other_csrf = sign_in(other, key_b)
    assert a_objects["model"] not in other.get("/ui/playground").text
    assert ask(other, other_csrf, good).status_code == 404  # another tenant's model


def test_a_long_jobs_curve_is_thinned_by_the_database(
    app_client: TestClient, settings: Settings, key_a: str
) -> None:
    """Of more than MAX_REPORTS metrics events the database sends every k-th, the first
    and the last kept; up to MAX_REPORTS, every one (a resumed step keeps its newest
    value)."""
    long, short = new_job(app_client, key_a), new_job(app_client, key_a)
    most = queries.MAX_REPORTS
    with session_scope(settings.resolved_database_url) as s:
        for job_id, steps in ((long, 2 * most + 500), (short, most - 1)):
            s.add_all(
                JobEvent(
                    id=f"ev-{job_id}-{i}",
                    job_id=job_id,
                    type="metrics",
                    message="m",
                    data={"step": i, "train_loss": 1 / i},
                )
                for i in range(1, steps + 1)
            )
        # the short job's step 5 again, from a resumed run: its newest value wins
        s.add(JobEvent(id=f"ev-{short}-again", job_id=short, type="metrics", message="m",
                       data={"step": 5, "train_loss": 9.0}))  # fmt: skip
    with session_scope(settings.resolved_database_url) as s:
        thinned = queries.loss_curves(s, long).train
        whole = queries.loss_curves(s, short).train
    stride = 3  # ceil(4500 / 2000)
    assert [x for x, _ in thinned] == [*range(1, 2 * most + 501, stride), 2 * most + 500]
    assert thinned[1] == (4.0, 0.25)
    assert len(whole) == most - 1 and dict(whole)[5] == 9.0
