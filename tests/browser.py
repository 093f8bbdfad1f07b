"""Playwright driving Debian's Chromium (`make chromium`), never a browser Playwright
downloads (`playwright install` cannot reach its servers here): the dashboard's browser
tests share how it starts and what they check on every page."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
# as the machine's own probe starts it: without the background-networking flags Chromium
# keeps dialling Google's hosts, which this machine's closed network refuses
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium for one test module. Playwright's sync API holds an event loop
    as the running one while it lives, which must not leak into later tests: so not
    pytest-playwright's session-wide fixtures."""
    if not CHROMIUM.exists():
        pytest.fail("no /usr/bin/chromium: `make chromium` (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=ARGS, headless=True)
        yield browser
        browser.close()


# A folder for each page's screenshot (`make screenshots` gives docs/img); unset: none. Not
# TUNEFLEET_-prefixed: tests/conftest.py clears those.
SCREENSHOTS = os.environ.get("SCREENSHOTS_DIR", "")


def shoot(page: Any, name: str) -> None:
    """The visible part of ``page`` as ``name``.png in ``SCREENSHOTS_DIR``, if set."""
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SCREENSHOTS) / f"{name}.png"))


def watch_csp(page: Any) -> list[str]:
    """Every Content-Security-Policy violation the page reports (console and events)."""
    seen: list[str] = []
    page.on(
        "console",
        lambda msg: seen.append(msg.text) if "Content Security Policy" in msg.text else None,
    )
    page.add_init_script(
        "document.addEventListener('securitypolicyviolation', e => "
        "console.error('Content Security Policy violation: ' + e.violatedDirective))"
    )
    return seen


def sign_in(page: Any, url: str, key: str) -> None:
    page.goto(f"{url}/ui/jobs")
    assert "/ui/signin" in page.url
    page.fill("#api_key", key)
    page.click("button[type=submit]")
    page.wait_for_url(f"{url}/ui/jobs")


def points(page: Any) -> int:
    """How many steps the job page's loss chart draws."""
    attr = page.locator("#loss polyline").first.get_attribute("points") or ""
    return len(attr.split())


def accessibility_problems(page: Any) -> list[str]:
    """axe-core's serious and critical violations on ``page`` (all its default rules: WCAG
    2 A/AA and best practices), one line per rule naming the elements. axe is evaluated
    through the DevTools protocol, which the page's CSP does not govern."""
    from axe_playwright_python.sync_playwright import Axe

    violations = Axe().run(page).response["violations"]
    return [
        f"{v['id']} ({v['impact']}): {v['help']} at "
        + ", ".join(str(t) for n in v["nodes"] for t in n["target"])
        for v in violations
        if v["impact"] in ("serious", "critical")
    ]
