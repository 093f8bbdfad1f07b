"""The dashboard in a real browser: Playwright driving Debian's Chromium (never a browser
Playwright downloads) against the real app under uvicorn on a migrated SQLite database.

A job's progress is written as the controller writes it (``progress.apply`` of a run's
metrics records), and the page must show it without reloading. Every page is checked for
Content-Security-Policy violations.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from browser import accessibility_problems, chromium, points, shoot, sign_in, watch_csp
from conftest import auth as H
from conftest import make_tenant
from tunefleet.platform.db import Adapter, Job, session_scope
from tunefleet.platform.ids import new_id
from tunefleet.platform.progress import apply
from tunefleet.platform.settings import Settings
from tunefleet.platform.status import JobStatus, transition
from tunefleet.platform.tenants import create_key, create_tenant

pytestmark = pytest.mark.slow

CHAT = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'
S = JobStatus


@pytest.fixture
def db_kind() -> str:
    return "sqlite"  # the browser checks the pages; the queries' dialects are tests/api's


@pytest.fixture(scope="module")
def chrome() -> Iterator[Any]:
    with chromium() as launched:
        yield launched


class Run:
    """A job's run as the controller sees it: records relayed from its channel."""

    def __init__(self, settings: Settings, job_id: str) -> None:
        self.url, self.job_id, self.seq = settings.resolved_database_url, job_id, 0

    def report(self, steps: range, total: int) -> None:
        records = []
        for step in steps:
            self.seq += 1
            records.append(
                {
                    "seq": self.seq,
                    "channel": "ch-1",
                    "kind": "metrics",
                    "step": step,
                    "total_steps": total,
                    "metrics": {
                        "train_loss": 3.0 / step,
                        "tokens_per_s": 2500.0,
                        "mfu": 0.31,
                        "peak_memory_bytes": 5 * 2**30,
                    },
                    "trained_tokens": 64 * step,
                    "eta_s": float(total - step),
                }
            )
        with session_scope(self.url) as s:
            job = s.get(Job, self.job_id)
            assert job is not None
            apply(s, job, f"{self.job_id}-1", records)


@pytest.fixture
def world(settings: Settings, live_server: Callable[..., str]) -> dict[str, Any]:
    """The server, two tenants' keys, tenant A's training job (running) and its job to
    cancel (queued), and tenant B's job."""
    url = live_server()
    key_a = make_tenant(settings.resolved_database_url, "tenant-a")
    key_b = make_tenant(settings.resolved_database_url, "tenant-b")

    def job(key: str) -> str:
        files = {"file": ("t.jsonl", (CHAT + "\n").encode() * 4)}
        f = httpx.post(f"{url}/v1/files", headers=H(key), data={"purpose": "fine-tune"},
                       files=files).json()  # fmt: skip
        body = {"model": "tiny-llama", "training_file": f["id"]}
        made = httpx.post(f"{url}/v1/fine_tuning/jobs", headers=H(key), json=body)
        assert made.status_code == 200, made.text
        job_id: str = made.json()["id"]
        return job_id

    training, to_cancel, other = job(key_a), job(key_a), job(key_b)
    with session_scope(settings.resolved_database_url) as s:
        for job_id in (training, to_cancel, other):
            transition(s, job_id, S.VALIDATING_FILES, S.QUEUED, "Files counted; queued")
        transition(s, training, S.QUEUED, S.RUNNING, "Started run 1")
    run = Run(settings, training)
    run.report(range(1, 4), total=40)
    return {"url": url, "key_a": key_a, "key_b": key_b, "training": training,
            "to_cancel": to_cancel, "other": other, "run": run}  # fmt: skip


def test_sign_in_watch_a_job_train_and_cancel_another(chrome: Any, world: dict[str, Any]) -> None:
    url = world["url"]
    context = chrome.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    violations = watch_csp(page)
    navigations: list[str] = []
    page.on("framenavigated", lambda f: navigations.append(f.url) if f == page.main_frame else None)

    # sign in with the keyboard alone: the key field has focus, Tab reaches the button
    page.goto(f"{url}/ui")
    assert page.url.startswith(f"{url}/ui/signin")
    assert page.evaluate("document.activeElement.id") == "api_key"
    page.keyboard.type(world["key_a"])
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent.trim()") == "Sign in"
    page.keyboard.press("Enter")
    page.wait_for_url(f"{url}/ui")
    assert page.locator("h1").inner_text() == "Overview"
    shoot(page, "overview")

    # the jobs list: tenant A's own jobs, with links, and no one else's
    page.click("nav >> text=Jobs")
    page.wait_for_url(f"{url}/ui/jobs")
    rows = page.locator("table.jobs tbody tr")
    assert rows.count() == 2
    assert page.locator(f"#link-{world['other']}").count() == 0
    shoot(page, "jobs")
    # the skip link is the first stop of the keyboard
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.className") == "skip-link"
    # a focused link keeps the focus through the table's refresh (htmx polls every 3 s and
    # swaps the table out whole: the focused link is replaced by a new one of its id)
    link = f"link-{world['training']}"
    page.focus(f"#{link}")
    page.evaluate(f"window.tunefleetFocused = document.getElementById('{link}')")
    assert page.evaluate("document.activeElement === window.tunefleetFocused")
    page.wait_for_function(  # the swap happened: the link now is another element
        "(id) => document.getElementById(id) !== window.tunefleetFocused",
        arg=link,
        timeout=15_000,
    )
    assert page.evaluate("window.tunefleetFocused.isConnected") is False
    assert page.evaluate(f"document.activeElement === document.getElementById('{link}')")

    # a running job: its loss curve, and the figures of its newest step
    page.click(f"#link-{world['training']}")
    page.wait_for_url(f"{url}/ui/jobs/{world['training']}")
    assert points(page) == 3
    assert "step 3/40" in page.locator("#job-live").inner_text()
    assert page.locator("#loss > title").text_content() == f"Loss of {world['training']}"

    # more steps arrive: the chart grows by htmx polling, in the same document
    page.evaluate("window.tunefleetMarker = 'same document'")
    seen_navigations = len(navigations)
    world["run"].report(range(4, 9), total=40)
    deadline = time.monotonic() + 15
    while points(page) < 8 and time.monotonic() < deadline:
        page.wait_for_timeout(250)
    assert points(page) == 8
    assert "step 8/40" in page.locator("#job-live").inner_text()
    assert page.evaluate("window.tunefleetMarker") == "same document"
    assert len(navigations) == seen_navigations
    shoot(page, "job")

    # the log scale is a link away
    page.click("#scale-log")
    page.wait_for_url(f"{url}/ui/jobs/{world['training']}?scale=log")
    assert "(log scale)" in page.locator("#loss").inner_html()

    # cancel the other job with its button
    page.goto(f"{url}/ui/jobs/{world['to_cancel']}")
    page.click("button.action-cancel")
    page.wait_for_url(f"{url}/ui/jobs/{world['to_cancel']}?done=cancel")
    assert page.locator("[role=status]").inner_text() == "Cancel requested."
    assert "cancelled" in page.locator("#job-live .status").inner_text()
    status = httpx.get(f"{url}/v1/fine_tuning/jobs/{world['to_cancel']}",
                       headers=H(world["key_a"])).json()["status"]  # fmt: skip
    assert status == "cancelled"

    # a POST without the session's CSRF token is refused, even with its cookie
    forged = context.request.post(f"{url}/ui/jobs/{world['training']}/pause", form={"x": "1"})
    assert forged.status == 403 and "CSRF" in forged.text()

    # another tenant's job: no link, and 404 by URL
    assert page.goto(f"{url}/ui/jobs/{world['other']}").status == 404

    for path in ("/ui", "/ui/jobs", "/ui/files", f"/ui/compare?ids={world['training']}"):
        assert page.goto(f"{url}{path}").status == 200
    shoot(page, "compare")
    page.goto(f"{url}/ui/files")
    shoot(page, "files")
    assert violations == []
    context.close()


def test_the_jobs_list_fits_a_phone(chrome: Any, world: dict[str, Any]) -> None:
    context = chrome.new_context(viewport={"width": 390, "height": 844}, is_mobile=True)
    page = context.new_page()
    violations = watch_csp(page)
    sign_in(page, world["url"], world["key_a"])
    assert page.locator("table.jobs tbody tr").count() == 2
    assert page.locator(f"#link-{world['training']}").is_visible()
    widths = page.evaluate(
        "[document.documentElement.scrollWidth, document.documentElement.clientWidth]"
    )
    assert widths[0] <= widths[1], f"the page scrolls sideways: {widths}"
    shoot(page, "jobs-phone")
    page.goto(f"{world['url']}/ui/jobs/{world['training']}")
    assert points(page) == 3
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    plan = "model=tiny-llama&method=lora&batch=4&seq=256&gpus=2&memory=0.012"
    for path in (f"/ui/planner?{plan}", "/ui/playground", "/ui/adapters", "/ui/files"):
        page.goto(f"{world['url']}{path}")
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, f"{path} scrolls sideways on a phone: {width}"
    shoot(page, "files-phone")
    page.goto(f"{world['url']}/ui/planner?{plan}")
    shoot(page, "planner-phone")
    assert violations == []
    context.close()


def test_every_page_passes_axe_and_the_admin_tools_work(
    chrome: Any, world: dict[str, Any], settings: Settings
) -> None:
    """axe-core finds no serious or critical violation on any page; an admin makes a key
    on the admin page (shown once, working at /v1) and revokes it, switches an adapter to
    merged, plans a job and opens the playground."""
    url = world["url"]
    with session_scope(settings.resolved_database_url) as s:
        tenant = create_tenant(s, "ops")
        admin = create_key(s, tenant.id, is_admin=True)[1]
        job = s.get(Job, world["training"])
        assert job is not None
        model = f"ft:tiny-llama:tenant-a::{job.id}"
        s.add(Adapter(id=new_id("adapter"), tenant_id=job.tenant_id, job_id=job.id, name=model,
                      base_model="tiny-llama", path=f"adapters/{job.id}"))  # fmt: skip
    context = chrome.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    violations = watch_csp(page)
    problems: dict[str, list[str]] = {}

    def check(path: str, shot: str = "") -> None:
        response = page.goto(f"{url}{path}")
        assert response is not None and response.status == 200, path
        problems[path] = accessibility_problems(page)
        if shot:
            shoot(page, shot)

    check("/ui/signin", "signin")
    sign_in(page, url, admin)
    check("/ui")
    check("/ui/jobs")
    check(f"/ui/jobs/{world['training']}")
    check(f"/ui/compare?ids={world['training']}+{world['other']}")
    check("/ui/files")
    check("/ui/adapters", "adapters")
    check("/ui/playground", "playground")
    check("/ui/planner")
    plan = "model=tiny-llama&method=full&precision=fp32&batch=4&seq=256&gpus=2&memory=0.012"
    check(f"/ui/planner?{plan}", "planner")
    assert page.locator("#memory rect.part-weights").count() == 4
    check("/ui/admin", "admin")
    assert {p: v for p, v in problems.items() if v} == {}

    # a key for tenant A, made on the admin page: shown once, and it works at /v1
    tenant_a = page.locator(f"#tenant-{job.tenant_id}")  # the training job's tenant: A
    tenant_a.locator("input[name=name]").fill("browser key")
    tenant_a.locator("button", has_text="Create key").click()
    page.wait_for_url(f"{url}/ui/admin/tenants/**")
    secret = page.input_value("#secret")
    assert httpx.get(f"{url}/v1/models", headers=H(secret)).status_code == 200
    assert accessibility_problems(page) == []
    page.click("text=Back to the admin page")
    row = page.locator("tr[id^=key-]", has_text="browser key")  # not its audit entry
    row.locator("button", has_text="Revoke").click()
    page.wait_for_url(f"{url}/ui/admin?done=revoked**")
    assert "revoked" in page.locator("tr[id^=key-]", has_text="browser key").inner_text()
    assert httpx.get(f"{url}/v1/models", headers=H(secret)).status_code == 401

    # the adapter to merged, with its button
    page.goto(f"{url}/ui/adapters")
    page.click(f"#adapter-{job.id} button.action-merged")
    page.wait_for_url(f"{url}/ui/adapters?done=merged**")
    assert "merged into its own copy" in page.locator(f"#adapter-{job.id}").inner_text()
    admin_view = httpx.get(f"{url}/v1/admin/adapters", headers=H(admin)).json()["data"]
    assert next(a for a in admin_view if a["model"] == model)["serving_mode"] == "merged"
    assert violations == []
    context.close()
