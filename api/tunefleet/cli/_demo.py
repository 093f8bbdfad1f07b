"""``make demo``: the whole loop on the built-in SmolLM2-135M-Instruct.

Starts the embedded stack, uploads the bundled pirate-speak dataset (written by this
project: every answer opens with "Arr, matey!"), fine-tunes a LoRA adapter with a progress
bar, then asks the base model and the adapter the same held-out questions through
``/v1/chat/completions`` and prints both answers side by side.
"""

from __future__ import annotations

import json
import time
from importlib.resources import files
from typing import Any

import httpx

from tunefleet.cli._client import follow
from tunefleet.cli._stack import running_stack
from tunefleet.platform.db import session_scope
from tunefleet.platform.models import BUILTIN_MODEL
from tunefleet.platform.settings import Settings
from tunefleet.platform.tenants import create_key, create_tenant

DATA = files("tunefleet.cli") / "data"
# The platform's defaults (LoRA r=32 on every linear layer, "auto" hyperparameters: see
# docs/training.md), on short sequences and a few dozen steps, which CPUs can afford.
DEMO_JOB: dict[str, Any] = {
    "model": BUILTIN_MODEL,
    "suffix": "pirate",
    "seed": 7,
    "tunefleet": {
        "max_seq_len": 128,
        "max_steps": 30,
        "resources": {"num_workers": 1, "cpus_per_worker": 2},
    },
}


def _key(settings: Settings) -> str:
    with session_scope(settings.resolved_database_url) as s:
        from sqlalchemy import select

        from tunefleet.platform.db import Tenant

        tenant = s.scalar(select(Tenant).where(Tenant.name == "demo"))
        tenant = tenant or create_tenant(s, "demo")
        return create_key(s, tenant.id, name="demo")[1]


def ask(client: httpx.Client, model: str, question: str) -> str:
    resp = client.post(
        "/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 40,
            "temperature": 0,
        },
    )
    resp.raise_for_status()
    return str(resp.json()["choices"][0]["message"]["content"]).strip()


def run_demo(settings: Settings, *, questions: int | None = None) -> None:
    """The demo; ``questions`` asks only the first few held-out questions."""
    started = time.monotonic()
    with running_stack(settings, builtin_model=True) as stack:
        key = _key(settings)
        client = httpx.Client(
            base_url=stack.api_url, timeout=600, headers={"Authorization": f"Bearer {key}"}
        )
        data = (DATA / "demo_train.jsonl").read_bytes()
        up = client.post(
            "/v1/files",
            data={"purpose": "fine-tune"},
            files={"file": ("pirate.jsonl", data, "application/jsonl")},
        )
        up.raise_for_status()
        file = up.json()
        print(f"Uploaded {file['id']}: {file['tunefleet']['stats']['examples']} examples")
        job = client.post(
            "/v1/fine_tuning/jobs", json={**DEMO_JOB, "training_file": file["id"]}
        ).json()
        print(f"Created {job['id']} on {job['model']}")
        job = follow(client, job["id"])
        if job["status"] != "succeeded":
            raise SystemExit(f"job ended {job['status']}: {job['error']}")
        tuned = job["fine_tuned_model"]
        asked: list[str] = json.loads((DATA / "demo_heldout.json").read_text())[:questions]
        print(f"\nHeld-out questions, base {BUILTIN_MODEL} vs {tuned}:\n")
        hits = 0
        for q in asked:
            base, ft = ask(client, BUILTIN_MODEL, q), ask(client, tuned, q)
            hits += ft.startswith("Arr")
            print(f"Q: {q}\n  base : {base}\n  tuned: {ft}\n")
        print(
            f"{hits}/{len(asked)} tuned answers speak like a pirate "
            f"(the dataset's lesson). Demo took {time.monotonic() - started:.0f}s."
        )
