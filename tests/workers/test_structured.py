"""Structured outputs on the bundled SmolLM2-135M: 50 ``json_schema`` requests over four
adapters, decoded as one batch, all parse against their schemas (issue 20)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import jsonschema
import pytest
import torch
from openai.lib._parsing._completions import type_to_response_format_param
from pydantic import BaseModel, Field

from tinyllm import save_random_lora
from tunefleet.platform.models import BUILTIN_MODEL
from tunefleet.workers.serve._adapter_cache import AdapterCache
from tunefleet.workers.serve._adapters import load_serving_base
from tunefleet.workers.serve._engine import BatchEngine, generate_all
from tunefleet.workers.serve._generate import Sampling, eos_ids
from tunefleet.workers.serve._multilora import MultiLoraModel
from tunefleet.workers.serve._structured import Grammars

pytestmark = pytest.mark.slow

ADAPTERS = 4
REQUESTS = 50


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_thousands: int = Field(ge=0, le=50_000)


class Review(BaseModel):
    sentiment: Literal["positive", "negative", "neutral"]
    stars: int = Field(ge=1, le=5)
    summary: str = Field(max_length=60)


class Recipe(BaseModel):
    title: str = Field(max_length=40)
    ingredients: list[str] = Field(min_length=1, max_length=4)
    vegetarian: bool


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=120)
    home: City


class Ticket(BaseModel):
    priority: Literal["low", "medium", "high"]
    tags: list[Literal["bug", "billing", "login", "other"]] = Field(max_length=3)
    escalate: bool


# Questions whose answers a client reads with ``chat.completions.parse(response_format=
# Model)``, which sends the model's strict schema (``type_to_response_format_param``).
TASKS: list[tuple[type[BaseModel], str]] = [
    (City, "Describe the capital of France as JSON."),
    (Review, "Review this: the soup was cold but the staff were kind. Answer in JSON."),
    (Recipe, "Give a simple pancake recipe as JSON."),
    (Person, "Invent a person who lives in Rome, as JSON."),
    (Ticket, "Classify this support ticket: I cannot log in since Monday. JSON please."),
]


@pytest.fixture(scope="module")
def smollm(smollm_registry: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from transformers import AutoTokenizer

    path = smollm_registry / BUILTIN_MODEL
    tokenizer = AutoTokenizer.from_pretrained(path)
    base = load_serving_base(path)
    folders = tmp_path_factory.mktemp("adapters")
    for i in range(ADAPTERS):  # four different fine-tunes (small random B factors)
        save_random_lora(
            load_serving_base(path),
            folders / f"ad{i}",
            r=8,
            targets=("q_proj", "k_proj", "v_proj", "o_proj"),
            seed=i,
            std=0.02,
        )
    lora = MultiLoraModel(base, max_adapters=ADAPTERS)
    cache = AdapterCache(lora, locate=lambda a: folders / a)
    slots = [cache.acquire(f"ad{i}", hold=False) for i in range(ADAPTERS)]
    eos = eos_ids(base, tokenizer)
    grammars = Grammars(tokenizer, eos)
    engine = BatchEngine(lora, eos, max_batch_size=REQUESTS, grammars=grammars)
    return {"tok": tokenizer, "engine": engine, "slots": slots, "grammars": grammars}


def test_fifty_json_schema_requests_over_four_adapters_all_parse(smollm: dict[str, Any]) -> None:
    tok, grammars = smollm["tok"], smollm["grammars"]
    items = []
    schemas = []
    for i in range(REQUESTS):
        model, question = TASKS[i % len(TASKS)]
        response_format: Any = type_to_response_format_param(model)
        schema = response_format["json_schema"]["schema"]
        grammar = grammars.compile(response_format)
        messages = [{"role": "user", "content": question}]
        prompt = tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        # every field is bounded, so every answer is too: the budget is never the limit
        sampling = Sampling(max_tokens=512, temperature=0.7, seed=i, grammar=grammar)
        items.append((list(prompt), sampling, smollm["slots"][i % ADAPTERS]))
        schemas.append((model, schema))
    with torch.inference_mode():
        done = generate_all(smollm["engine"], tok, items)
    cut = [a.text for a in done if a.finish_reason != "stop"]
    assert not cut, f"{len(cut)} of {REQUESTS} ran to max_tokens: {cut}"
    parsed = 0
    for (model, schema), answer in zip(schemas, done, strict=True):
        value = json.loads(answer.text)
        jsonschema.validate(value, schema)
        model.model_validate(value)
        parsed += 1
    assert parsed == REQUESTS
