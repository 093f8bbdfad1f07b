"""What the SmolLM2 efficacy tests share (the demo's and DPO's, through the session's
``smol_base`` fixture): the built-in base model, loaded once, and its greedy answers to the
demo's questions, generated once."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunefleet.cli._demo import DATA
from tunefleet.platform.models import BUILTIN_MODEL

BASE_NEW_TOKENS = 24  # the longest opening a test reads (DPO's first sentence)


def greedy_ids(model: Any, tokenizer: Any, questions: list[str], new_tokens: int) -> Any:
    """Greedy answers to ``questions`` in one left-padded batch: the new tokens only."""
    import torch

    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in questions
    ]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=new_tokens, do_sample=False)
    return out[:, batch["input_ids"].shape[1] :]


@dataclass(frozen=True)
class SmolBase:
    model: Any
    tokenizer: Any
    path: Path
    train: list[dict[str, Any]]  # the demo's training lines
    heldout: list[str]  # the demo's held-out questions
    answers: dict[str, Any]  # question -> the base's greedy answer (token ids, 24 tokens)

    def answer(self, question: str, tokens: int = BASE_NEW_TOKENS) -> str:
        """The base's greedy answer's first ``tokens`` tokens, as text."""
        ids = self.answers[question][:tokens]
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))


def load_smol_base(smollm_registry: Path) -> SmolBase:
    """SmolLM2-135M-Instruct (fp32, as converted) and its greedy answers to the demo's
    training and held-out questions, in one batch."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm_registry / BUILTIN_MODEL
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    train = [json.loads(line) for line in (DATA / "demo_train.jsonl").read_text().splitlines()]
    heldout: list[str] = json.loads((DATA / "demo_heldout.json").read_text())
    questions = [t["messages"][0]["content"] for t in train] + heldout
    ids = greedy_ids(model, tokenizer, questions, BASE_NEW_TOKENS)
    return SmolBase(model, tokenizer, path, train, heldout, dict(zip(questions, ids, strict=True)))
