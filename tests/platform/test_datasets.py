"""Training-file validation: formats, errors that name the line, the first 20 only."""

from __future__ import annotations

import json

import pytest

from tunefleet.platform.datasets import raise_for_report, validate_lines
from tunefleet.platform.errors import InvalidFile


def lines(*objs: object) -> list[bytes]:
    return [(o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n" for o in objs]


CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
PAIR = {
    "input": {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2?"},
        ]
    },
    "preferred_output": [{"role": "assistant", "content": "4"}],
    "non_preferred_output": [{"role": "assistant", "content": "It is four, I believe."}],
}


def pair(**changes: object) -> dict[str, object]:
    """PAIR with fields replaced (or removed, given None)."""
    return {k: v for k, v in {**PAIR, **changes}.items() if v is not None}


@pytest.mark.parametrize(
    "obj,fmt",
    [
        (CHAT, "chat"),
        ({"prompt": "a", "completion": "b"}, "prompt_completion"),
        ({"instruction": "a", "input": "", "output": "b"}, "alpaca"),
        ({"text": "hello"}, "text"),
        (PAIR, "preference"),
    ],
)
def test_each_format_is_recognised(obj: object, fmt: str) -> None:
    report = validate_lines(lines(obj, obj))
    assert (report.format, report.examples, report.errors) == (fmt, 2, [])


@pytest.mark.parametrize(
    "raw,needle",
    [
        (lines(CHAT, b"{not json"), "line 2: not valid JSON"),
        (lines(CHAT, {"prompt": "a", "completion": "b"}), "line 2: looks like prompt_completion"),
        ([], "no examples"),
        (lines({"messages": [{"role": "user", "content": "hi"}]}), "no assistant message"),
        (lines({"messages": [{"role": "robot", "content": "x"}]}), "role is 'robot'"),
        (lines({"messages": [{"role": "user", "content": 3}]}), "content must be a string"),
        ([b"\xff\xfe{}\n"], "not valid UTF-8"),
        ([b"\xef\xbb\xbf" + json.dumps(CHAT).encode()], "byte-order mark"),
        (lines([1, 2]), "unrecognised example"),
        (lines({"foo": 1}), "unrecognised example"),
        (
            lines(
                {
                    "messages": [
                        {"role": "user", "content": "q"},
                        {"role": "assistant", "content": "a", "weight": 2},
                    ]
                }
            ),
            "use 0 or 1",
        ),
        (lines({"messages": []}), "non-empty list"),
        (lines({"prompt": "a", "completion": 5}), "'completion' must be a string"),
        (lines({"text": "   "}), "'text' is empty"),
        # preference (DPO) lines, OpenAI's format
        (lines(PAIR, pair(preferred_output=None)), "line 2: missing field 'preferred_output'"),
        (lines(pair(input=None)), "missing field 'input'"),
        (lines(pair(input={"messages": []})), "'input.messages' must be a non-empty list"),
        (
            lines(pair(input={"messages": [{"role": "bot", "content": "x"}]})),
            "input.messages[0].role is 'bot'",
        ),
        (
            lines(
                pair(
                    input={
                        "messages": [
                            {"role": "user", "content": "q"},
                            {"role": "assistant", "content": "a"},
                        ]
                    }
                )
            ),
            "ends with an assistant message",
        ),
        (
            lines(pair(non_preferred_output={"role": "assistant", "content": "x"})),
            "'non_preferred_output' must be a list of exactly one",
        ),
        (
            lines(pair(preferred_output=[{"role": "user", "content": "4"}])),
            "preferred_output[0].role is 'user'; use 'assistant'",
        ),
        (
            lines(pair(preferred_output=[{"role": "assistant", "content": " "}])),
            "preferred_output[0].content must be a non-empty string",
        ),
        (lines(pair(non_preferred_output=PAIR["preferred_output"])), "are the same"),
        (lines(PAIR, CHAT), "line 2: looks like chat but the file started as preference"),
    ],
)
def test_malformed_files_name_the_line_and_problem(raw: list[bytes], needle: str) -> None:
    report = validate_lines(raw)
    with pytest.raises(InvalidFile) as err:
        raise_for_report(report, "train.jsonl")
    assert needle in err.value.message
    assert "line " in err.value.message


def test_only_the_first_twenty_errors_are_listed() -> None:
    report = validate_lines([b"nope\n"] * 30)
    assert report.error_count == 30 and len(report.errors) == 20
    with pytest.raises(InvalidFile, match=r"and 10 more"):
        raise_for_report(report, "x.jsonl")
