"""Training files to token ids and loss labels, with the tests' byte-level BPE tokenizer
and ChatML template: which text carries loss in each format (checked by decoding the
labelled tokens), truncation, examples with nothing to learn, the per-epoch shuffle, and
how batches are padded and packed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tinyllm import build_tokenizer
from tunefleet.workers.train.data import (
    IGNORE,
    Example,
    collate,
    collate_packed,
    epoch_order,
    load_dataset,
    pack,
    token_stats,
    tokenize_example,
)

END = "<|im_end|>"  # the tokenizer's eos, and ChatML's end of turn

CONVERSATION = [
    {"role": "system", "content": "be red"},
    {"role": "user", "content": "what color"},
    {"role": "assistant", "content": "blue"},
    {"role": "user", "content": "name a number"},
    {"role": "assistant", "content": "seven"},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tokenizer of ``tiny_registry``'s model, built alone (no model weights)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)


def trained_text(tokenizer: Any, ex: Example) -> list[str]:
    """The decoded text of each run of consecutive tokens that carry loss."""
    assert len(ex.labels) == len(ex.input_ids)
    runs: list[list[int]] = []
    previous = IGNORE
    for token, label in zip(ex.input_ids, ex.labels, strict=True):
        if label != IGNORE:
            assert label == token  # labels are unshifted: the loss shifts them
            if previous == IGNORE:
                runs.append([])
            runs[-1].append(token)
        previous = label
    return [tokenizer.decode(run) for run in runs]


def untrained_text(tokenizer: Any, ex: Example) -> str:
    return str(
        tokenizer.decode(
            [t for t, label in zip(ex.input_ids, ex.labels, strict=True) if label == IGNORE]
        )
    )


def write_jsonl(path: Path, objs: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


# --- what carries loss, per format ------------------------------------------------------


def test_chat_trains_only_assistant_turns(tokenizer: Any) -> None:
    ex = tokenize_example(tokenizer, {"messages": CONVERSATION})
    assert tokenizer.decode(ex.input_ids) == tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False
    )
    # each reply with its end-of-turn marker; no role header, system or user text
    assert trained_text(tokenizer, ex) == [f"blue{END}\n", f"seven{END}\n"]
    assert untrained_text(tokenizer, ex) == (
        f"<|im_start|>system\nbe red{END}\n<|im_start|>user\nwhat color{END}\n"
        f"<|im_start|>assistant\n<|im_start|>user\nname a number{END}\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    ("weights", "expected"),
    [
        ((1, 1), [f"blue{END}\n", f"seven{END}\n"]),
        ((0, 1), [f"seven{END}\n"]),
        ((1, 0), [f"blue{END}\n"]),
    ],
)
def test_chat_weight_zero_excludes_that_turn(
    tokenizer: Any, weights: tuple[int, int], expected: list[str]
) -> None:
    messages = [dict(m) for m in CONVERSATION]
    messages[2]["weight"], messages[4]["weight"] = weights
    ex = tokenize_example(tokenizer, {"messages": messages})
    assert trained_text(tokenizer, ex) == expected
    # weights choose the loss only; the model still reads the whole conversation
    assert ex.input_ids == tokenize_example(tokenizer, {"messages": CONVERSATION}).input_ids


def test_chat_leading_assistant_turn_trains_only_its_content(tokenizer: Any) -> None:
    messages = [
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "a color"},
        {"role": "assistant", "content": "red"},
    ]
    ex = tokenize_example(tokenizer, {"messages": messages})
    assert trained_text(tokenizer, ex) == [f"hi{END}\n", f"red{END}\n"]


class CountingTokenizer:
    """The tokenizer, counting its chat-template renders; ``strip`` makes its template
    change contents (strip them), as some templates do."""

    def __init__(self, tokenizer: Any, strip: bool = False) -> None:
        self.tokenizer, self.strip, self.renders = tokenizer, strip, 0

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> Any:
        self.renders += 1
        if self.strip:
            messages = [{**m, "content": m["content"].strip()} for m in messages]
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.tokenizer(*args, **kwargs)


def test_a_long_conversation_renders_the_template_a_fixed_number_of_times(
    tokenizer: Any,
) -> None:
    """Labelling rendered the conversation once per assistant turn (quadratic: one line of
    50,000 turns stalled the controller for every tenant); now the renders do not grow
    with the turns, and the labels are those of the turn-by-turn reading."""
    turns = [
        m
        for i in range(2000)
        for m in ({"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"})
    ]
    counting = CountingTokenizer(tokenizer)
    ex = tokenize_example(counting, {"messages": turns})
    assert counting.renders <= 3
    assert trained_text(tokenizer, ex) == [f"a{i}{END}\n" for i in range(2000)]

    for messages in (CONVERSATION, [{"role": "assistant", "content": "hi"}, *CONVERSATION[1:]]):
        fast = tokenize_example(tokenizer, {"messages": messages})
        per_turn = tokenize_example(
            CountingTokenizer(tokenizer, strip=True), {"messages": messages}
        )
        assert fast == per_turn  # (contents here have nothing to strip)


def test_a_template_that_changes_contents_is_labelled_turn_by_turn_up_to_a_limit(
    tokenizer: Any,
) -> None:
    padded = [{"role": "user", "content": " q "}, {"role": "assistant", "content": " blue "}]
    ex = tokenize_example(CountingTokenizer(tokenizer, strip=True), {"messages": padded})
    assert trained_text(tokenizer, ex) == [f"blue{END}\n"]
    many = padded * 65
    with pytest.raises(ValueError, match=r"65 trained assistant turns.*split it into shorter"):
        tokenize_example(CountingTokenizer(tokenizer, strip=True), {"messages": many})


@pytest.mark.parametrize(
    ("obj", "user"),
    [
        (
            {"instruction": "name a color", "input": "apple", "output": "red"},
            "name a color\n\napple",
        ),
        ({"instruction": "name a color", "output": "red"}, "name a color"),
        ({"instruction": "name a color", "input": "", "output": "red"}, "name a color"),
    ],
)
def test_alpaca_is_a_user_turn_and_a_trained_reply(
    tokenizer: Any, obj: dict[str, str], user: str
) -> None:
    ex = tokenize_example(tokenizer, obj)
    assert tokenizer.decode(ex.input_ids) == (
        f"<|im_start|>user\n{user}{END}\n<|im_start|>assistant\nred{END}\n"
    )
    assert trained_text(tokenizer, ex) == [f"red{END}\n"]


def test_prompt_completion_trains_only_the_completion_and_eos(tokenizer: Any) -> None:
    ex = tokenize_example(tokenizer, {"prompt": "what color is the apple", "completion": " red"})
    assert tokenizer.decode(ex.input_ids) == f"what color is the apple red{END}"
    assert untrained_text(tokenizer, ex) == "what color is the apple"
    assert trained_text(tokenizer, ex) == [f" red{END}"]
    assert ex.input_ids[-1] == tokenizer.eos_token_id


def test_text_trains_every_token(tokenizer: Any) -> None:
    ex = tokenize_example(tokenizer, {"text": "one two three apple"})
    assert ex.labels == ex.input_ids
    assert tokenizer.decode(ex.input_ids) == f"one two three apple{END}"
    assert ex.input_ids[-1] == tokenizer.eos_token_id


# --- loading a file: truncation and empty examples ---------------------------------------


def test_load_dataset_truncates_to_max_seq_len_and_counts(tokenizer: Any, tmp_path: Path) -> None:
    long_text = {"text": " ".join(["red green blue"] * 10)}
    short_text = {"text": "red"}
    long_chat = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "one two three four five six seven"},
        ]
    }
    objs = [long_text, short_text, long_chat]
    full = [tokenize_example(tokenizer, o) for o in objs]
    max_seq_len = 20
    assert [len(e.input_ids) > max_seq_len for e in full] == [True, False, True]

    path = write_jsonl(tmp_path / "train.jsonl", objs)
    data = load_dataset(path, tokenizer, max_seq_len)

    assert data.truncated == 2
    assert [len(e.input_ids) for e in data.examples] == [20, len(full[1].input_ids), 20]
    assert data.tokens == 40 + len(full[1].input_ids)
    for got, whole in zip(data.examples, full, strict=True):
        assert got.input_ids == whole.input_ids[: len(got.input_ids)]
        assert got.labels == whole.labels[: len(got.labels)]
    # the chat reply is cut mid-way: its tail and end-of-turn are no longer trained
    [reply] = trained_text(tokenizer, data.examples[2])
    assert "one two three four five six seven".startswith(reply)
    assert reply and END not in reply


def test_load_dataset_drops_examples_with_nothing_to_learn(tokenizer: Any, tmp_path: Path) -> None:
    all_weight_zero = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo", "weight": 0},
        ]
    }
    only_eos = {"text": ""}  # its one token has nothing before it to predict it from
    # the reply lies wholly past max_seq_len, so truncation leaves no trained token
    reply_cut_off = {
        "messages": [
            {"role": "user", "content": " ".join(["apple banana cherry"] * 10)},
            {"role": "assistant", "content": "red"},
        ]
    }
    kept = {"text": "red green"}
    assert all(label == IGNORE for label in tokenize_example(tokenizer, all_weight_zero).labels)
    assert tokenize_example(tokenizer, only_eos).input_ids == [tokenizer.eos_token_id]
    path = write_jsonl(tmp_path / "t.jsonl", [all_weight_zero, only_eos, reply_cut_off, kept])

    data = load_dataset(path, tokenizer, max_seq_len=24)

    assert [tokenizer.decode(e.input_ids) for e in data.examples] == [f"red green{END}"]
    assert data.truncated == 1  # counted even though it was then dropped


def test_load_dataset_skips_blank_lines(tokenizer: Any, tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('\n{"text": "red"}\n   \n{"text": "blue"}\n\n')
    data = load_dataset(path, tokenizer, max_seq_len=64)
    assert [tokenizer.decode(e.input_ids) for e in data.examples] == [f"red{END}", f"blue{END}"]


def test_token_stats_counts_every_example_untruncated(tokenizer: Any, tmp_path: Path) -> None:
    completions = [" red", " " + " ".join(["one two three"] * 8), ""]
    objs = [{"prompt": "what color is", "completion": c} for c in completions]
    examples = [tokenize_example(tokenizer, o) for o in objs]
    path = write_jsonl(tmp_path / "t.jsonl", objs)

    stats = token_stats(path, tokenizer, max_seq_len=16)

    assert stats == {
        "examples": 3,
        "tokens": sum(len(e.input_ids) for e in examples),
        # each completion and its eos, the long one in full
        "trained_tokens": sum(len(tokenizer(c)["input_ids"]) + 1 for c in completions),
        "over_max_seq_len": 1,
        "max_seq_len": 16,
    }


# --- the order of an epoch ---------------------------------------------------------------


def test_epoch_order_is_a_seeded_permutation() -> None:
    order = epoch_order(50, seed=7, epoch=0)
    assert sorted(order) == list(range(50))
    assert order != list(range(50))
    # a function of (seed, epoch) alone: the same after other calls, as on resume
    epoch_order(50, seed=7, epoch=3)
    epoch_order(50, seed=8, epoch=0)
    assert epoch_order(50, seed=7, epoch=0) == order
    assert epoch_order(50, seed=7, epoch=1) != order
    assert epoch_order(50, seed=8, epoch=0) != order
    assert len({tuple(epoch_order(50, seed=7, epoch=e)) for e in range(10)}) == 10
    assert epoch_order(0, seed=7, epoch=0) == []
    assert epoch_order(1, seed=7, epoch=5) == [0]


# --- batches ------------------------------------------------------------------------------


def test_collate_pads_to_the_longest_example_only() -> None:
    batch = collate([Example([5, 6, 7], [IGNORE, 6, 7]), Example([8, 9], [8, 9])], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 6, 7], [8, 9, IGNORE]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert all(t.dtype == torch.long for t in batch.values())


def test_collate_packed_positions_and_attention_per_document() -> None:
    docs = [
        Example([11, 12, 13], [11, 12, 13]),
        Example([21, 22], [21, 22]),
        Example([31, 32, 33, 34], [31, 32, 33, 34]),
    ]
    rows = pack(docs, max_seq_len=5)
    assert [r.lengths for r in rows] == [[4], [3, 2]]

    batch = collate_packed(rows, pad_id=0)

    assert batch["input_ids"].tolist() == [[31, 32, 33, 34, 0], [11, 12, 13, 21, 22]]
    # every document's first label is ignored; padding is ignored
    assert batch["labels"].tolist() == [
        [IGNORE, 32, 33, 34, IGNORE],
        [IGNORE, 12, 13, IGNORE, 22],
    ]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]
    mask = batch["attention_mask"]
    assert mask.shape == (2, 1, 5, 5) and mask.dtype == torch.bool
    # row 0: one causal document, then a pad that sees only itself
    assert mask[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [0, 0, 0, 0, 1],
    ]
    # row 1: two causal blocks that never see each other
    assert mask[1, 0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ]


def test_packed_file_keeps_each_documents_trained_text(tokenizer: Any, tmp_path: Path) -> None:
    replies = ["red", "one two", "green apple", "blue"]
    objs = [
        {
            "messages": [
                {"role": "user", "content": f"what is {i}"},
                {"role": "assistant", "content": reply},
            ]
        }
        for i, reply in enumerate(replies)
    ]
    data = load_dataset(write_jsonl(tmp_path / "t.jsonl", objs), tokenizer, max_seq_len=64)
    rows = pack(data.examples, max_seq_len=64)
    assert len(rows) < len(replies)

    batch = collate_packed(rows, pad_id=tokenizer.pad_token_id)

    found = []
    for row, r in enumerate(rows):
        start = 0
        for n in r.lengths:
            ids = batch["input_ids"][row, start : start + n].tolist()
            labels = batch["labels"][row, start : start + n].tolist()
            assert batch["position_ids"][row, start : start + n].tolist() == list(range(n))
            [text] = trained_text(tokenizer, Example(ids, labels))
            found.append(text)
            start += n
    assert sorted(found) == sorted(f"{reply}{END}\n" for reply in replies)
