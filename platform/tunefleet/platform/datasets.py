"""Training-file validation: JSONL, one object a line, one format per file.

Formats: ``chat`` (OpenAI ``messages``, optional per-assistant ``weight`` 0/1),
``prompt_completion``, ``alpaca`` (instruction/input/output) and ``text`` for supervised
jobs; ``preference`` (OpenAI's DPO format: ``input.messages``, ``preferred_output``,
``non_preferred_output``) for preference tuning. The file is read line by line, never
whole. Errors name the line and the fix; the first 20 are reported.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunefleet.platform.errors import InvalidFile

MAX_REPORTED_ERRORS = 20
CHAT_ROLES = {"system", "user", "assistant", "tool"}
FORMATS = ("chat", "prompt_completion", "alpaca", "text", "preference")
# What a supervised job trains on; ``preference`` files are for preference tuning.
SUPERVISED_FORMATS = FORMATS[:4]


@dataclass
class ValidationReport:
    format: str | None = None
    examples: int = 0
    errors: list[str] = field(default_factory=list)
    error_count: int = 0

    def error(self, line_no: int, message: str) -> None:
        self.error_count += 1
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(f"line {line_no}: {message}")


def detect_format(obj: dict[str, Any]) -> str | None:
    if "preferred_output" in obj or "non_preferred_output" in obj:
        return "preference"
    if "messages" in obj:
        return "chat"
    if "prompt" in obj or "completion" in obj:
        return "prompt_completion"
    if "instruction" in obj or "output" in obj:
        return "alpaca"
    if "text" in obj:
        return "text"
    return None


def _check_str(obj: dict[str, Any], key: str, *, required: bool = True) -> str | None:
    if key not in obj:
        return f"missing field '{key}'" if required else None
    if not isinstance(obj[key], str):
        return f"field '{key}' must be a string, got {type(obj[key]).__name__}"
    return None


def _check_chat(obj: dict[str, Any]) -> list[str]:
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        return ["'messages' must be a non-empty list of {role, content} objects"]
    problems: list[str] = []
    has_trained_assistant = False
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            problems.append(f"{where} must be an object, got {type(msg).__name__}")
            continue
        role = msg.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            problems.append(f"{where}.role is {role!r}; use one of {', '.join(sorted(CHAT_ROLES))}")
            continue
        content = msg.get("content")
        if role == "assistant" and content is None and msg.get("tool_calls"):
            pass
        elif not isinstance(content, str):
            problems.append(f"{where}.content must be a string, got {type(content).__name__}")
        if "weight" in msg:
            if role != "assistant":
                problems.append(f"{where}.weight is only allowed on assistant messages")
            elif msg["weight"] not in (0, 1) or isinstance(msg["weight"], bool):
                problems.append(f"{where}.weight is {msg['weight']!r}; use 0 or 1")
        if role == "assistant" and msg.get("weight", 1) == 1:
            has_trained_assistant = True
    if not problems and not has_trained_assistant:
        problems.append("no assistant message to learn from (add one with weight 1)")
    return problems


def _check_output(obj: dict[str, Any], key: str) -> tuple[list[str], str | None]:
    """Problems with a preference line's ``key`` output (a list of one assistant message),
    and its content when there are none."""
    output = obj.get(key)
    if output is None:
        return [f"missing field '{key}' (a list of one assistant message)"], None
    if not isinstance(output, list) or len(output) != 1 or not isinstance(output[0], dict):
        return [f"'{key}' must be a list of exactly one {{role, content}} object"], None
    message = output[0]
    if message.get("role") != "assistant":
        return [f"{key}[0].role is {message.get('role')!r}; use 'assistant'"], None
    content = message.get("content")
    if not isinstance(content, str) or not content.strip():
        return [f"{key}[0].content must be a non-empty string"], None
    return [], content


def _check_preference(obj: dict[str, Any]) -> list[str]:
    """OpenAI's preference (DPO) line: the prompt in ``input.messages``, then the answer
    preferred and the one not."""
    problems: list[str] = []
    prompt = obj.get("input")
    if not isinstance(prompt, dict) or "messages" not in prompt:
        problems.append("missing field 'input' (an object with the prompt's 'messages')")
    else:
        messages = prompt["messages"]
        if not isinstance(messages, list) or not messages:
            problems.append("'input.messages' must be a non-empty list of {role, content} objects")
        else:
            for i, msg in enumerate(messages):
                where = f"input.messages[{i}]"
                role = msg.get("role") if isinstance(msg, dict) else None
                if role not in CHAT_ROLES:
                    problems.append(
                        f"{where}.role is {role!r}; use one of {', '.join(sorted(CHAT_ROLES))}"
                    )
                elif not isinstance(msg.get("content"), str):
                    problems.append(f"{where}.content must be a string")
            if not problems and messages[-1].get("role") == "assistant":
                problems.append(
                    "input.messages ends with an assistant message; the answers to compare "
                    "go in preferred_output and non_preferred_output"
                )
    preferred_problems, preferred = _check_output(obj, "preferred_output")
    rejected_problems, rejected = _check_output(obj, "non_preferred_output")
    problems += preferred_problems + rejected_problems
    if preferred is not None and preferred == rejected:
        problems.append(
            "preferred_output and non_preferred_output are the same; a pair teaches only "
            "where they differ"
        )
    return problems


def check_example(obj: Any, fmt: str) -> list[str]:
    """Problems with one parsed line of a file in format ``fmt`` (empty list: fine)."""
    if not isinstance(obj, dict):
        return [f"expected a JSON object, got {type(obj).__name__}"]
    if fmt == "chat":
        return _check_chat(obj)
    if fmt == "preference":
        return _check_preference(obj)
    keys = {
        "prompt_completion": [("prompt", True), ("completion", True)],
        "alpaca": [("instruction", True), ("input", False), ("output", True)],
        "text": [("text", True)],
    }[fmt]
    problems = [p for key, req in keys if (p := _check_str(obj, key, required=req))]
    if not problems and fmt == "text" and not obj["text"].strip():
        problems.append("field 'text' is empty")
    return problems


def validate_lines(lines: Iterable[bytes]) -> ValidationReport:
    """Validate a JSONL stream. The first parsable object fixes the file's format."""
    report = ValidationReport()
    for line_no, raw in enumerate(lines, start=1):
        if line_no == 1 and raw.startswith(b"\xef\xbb\xbf"):
            report.error(1, "file starts with a UTF-8 byte-order mark; save it without BOM")
            raw = raw[3:]
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            report.error(line_no, f"not valid UTF-8 (byte {exc.start}); re-encode as UTF-8")
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            report.error(line_no, f"not valid JSON ({exc.msg} at column {exc.colno})")
            continue
        except ValueError as exc:  # an integer past Python's digit limit
            report.error(line_no, f"not valid JSON ({str(exc).split(':')[0]}); shorten it")
            continue
        except RecursionError:
            report.error(line_no, "JSON nested too deeply to read; flatten the example")
            continue
        fmt = detect_format(obj) if isinstance(obj, dict) else None
        if fmt is None:
            report.error(
                line_no,
                "unrecognised example; expected 'messages' (chat), 'prompt'+'completion', "
                "'instruction'+'output' (alpaca), 'text', or 'input'+'preferred_output'+"
                "'non_preferred_output' (preference)",
            )
            continue
        if report.format is None:
            report.format = fmt
        elif fmt != report.format:
            report.error(
                line_no,
                f"looks like {fmt} but the file started as {report.format}; "
                "use one format per file",
            )
            continue
        for problem in check_example(obj, fmt):
            report.error(line_no, problem)
        report.examples += 1
    if report.examples == 0 and report.error_count == 0:
        report.error(1, "file has no examples; upload at least one JSON line")
    return report


def validate_file(path: Path) -> ValidationReport:
    with path.open("rb") as fh:
        return validate_lines(fh)


def raise_for_report(report: ValidationReport, filename: str) -> None:
    """Turn a failed report into one ``InvalidFile`` error listing the first problems."""
    if report.error_count == 0:
        return
    more = report.error_count - len(report.errors)
    tail = f" (and {more} more)" if more > 0 else ""
    raise InvalidFile(
        f"{filename} is not a valid fine-tuning file: " + "; ".join(report.errors) + tail,
        param="file",
    )
