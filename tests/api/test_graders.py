"""OpenAI's grader routes (``/v1/fine_tuning/alpha/graders/run`` and ``/validate``) through
the official SDK: every string_check operation, every text_similarity metric against a
hand computation or the library's definition, multi graders' formulas, the templates'
namespaces, and each way a grader or a grade fails named (a 400 for a grader that cannot
run, a reward of 0 with OpenAI's error flag for a grade that fails on its inputs); python
graders off by default, and where turned on each of the sandbox's limits holding."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from conftest import auth as H

HYP, REF = "the cat sat on the mat", "the cat is on the mat"


@pytest.fixture
def sdk(app_client: TestClient, key_a: str) -> OpenAI:
    return OpenAI(
        base_url="http://testserver/v1", api_key=key_a, http_client=app_client, max_retries=0
    )


def _run(sdk: OpenAI, grader: dict[str, Any], sample: str, item: Any = None) -> Any:
    return sdk.fine_tuning.alpha.graders.run(
        grader=grader,  # type: ignore[arg-type]
        model_sample=sample,
        item=item,
    )


def _similarity(metric: str) -> dict[str, Any]:
    return {"type": "text_similarity", "name": metric, "evaluation_metric": metric,
            "input": "{{sample.output_text}}", "reference": "{{item.answer}}"}  # fmt: skip


@pytest.mark.parametrize(
    ("operation", "sample", "reward"),
    [("eq", "Paris", 1), ("eq", "paris", 0), ("ne", "Lyon", 1), ("ne", "Paris", 0),
     ("like", "It is Paris.", 1), ("like", "it is paris.", 0),
     ("ilike", "it is PARIS.", 1), ("ilike", "Lyon", 0)],
)  # fmt: skip
def test_string_check_operations(sdk: OpenAI, operation: str, sample: str, reward: int) -> None:
    grader = {"type": "string_check", "name": "city", "operation": operation,
              "input": "{{ sample.output_text }}", "reference": "{{ item.city.name }}"}  # fmt: skip
    got = _run(sdk, grader, sample, {"city": {"name": "Paris"}})
    assert got.reward == reward
    assert got.metadata.name == "city" and got.metadata.type == "string_check"
    assert not any(v for k, v in got.metadata.errors.model_dump().items() if k.endswith("error"))


def test_text_similarity_metrics_are_the_libraries_and_the_hand_counts(sdk: OpenAI) -> None:
    import sacrebleu
    from rapidfuzz import fuzz

    item = {"answer": REF}
    scores = {m: _run(sdk, _similarity(m), HYP, item).reward for m in
              ("fuzzy_match", "bleu", "gleu", "meteor", "rouge_1", "rouge_2", "rouge_3",
               "rouge_4", "rouge_5", "rouge_l")}  # fmt: skip
    # by hand: the two share 5 of their 6 words (rouge_1 F = 5/6), the bigrams "the cat",
    # "on the", "the mat" (3 of 5: rouge_2 = 3/5), one trigram "on the mat" (1/4), no
    # 4-gram; the longest common subsequence "the cat on the mat" (5 of 6). GLEU: 9 of the
    # 18 1- to 4-grams of each match (5 + 3 + 1 + 0): 0.5.
    assert scores["rouge_1"] == pytest.approx(5 / 6)
    assert scores["rouge_2"] == pytest.approx(3 / 5)
    assert scores["rouge_3"] == pytest.approx(1 / 4)
    assert scores["rouge_4"] == scores["rouge_5"] == 0
    assert scores["rouge_l"] == pytest.approx(5 / 6)
    assert scores["gleu"] == pytest.approx(0.5)
    # the libraries' own definitions
    assert scores["fuzzy_match"] == pytest.approx(fuzz.ratio(HYP, REF) / 100)
    assert scores["bleu"] == pytest.approx(sacrebleu.sentence_bleu(HYP, [REF]).score / 100)
    # METEOR (alpha 0.9, beta 3, gamma 0.5): 5 of 6 words match both ways, so the F-mean
    # is 5/6; in 2 chunks ("the cat", "on the mat"), a penalty of 0.5 x (2/5)^3
    assert scores["meteor"] == pytest.approx(5 / 6 * (1 - 0.5 * (2 / 5) ** 3))
    for metric in scores:  # the same text scores 1 on every metric but METEOR, whose
        # fragmentation penalty is 0.5 x (1 chunk / 6 matches)^3 even for one chunk
        same = 1 - 0.5 / 6**3 if metric == "meteor" else 1
        assert _run(sdk, _similarity(metric), REF, item).reward == pytest.approx(same), metric


def test_a_multi_grader_combines_its_graders_by_its_formula(sdk: OpenAI) -> None:
    grader = {
        "type": "multi", "name": "both",
        "graders": {
            "exact": {"type": "string_check", "name": "exact", "operation": "eq",
                      "input": "{{sample.output_json.city}}", "reference": "{{item.city}}"},
            "close": {**_similarity("rouge_1"), "input": "{{sample.output_json.why}}",
                      "reference": "{{item.answer}}"},
        },
        "calculate_output": "0.5 * exact + 0.5 * max(close, 0) ^ 1",
    }  # fmt: skip
    sample = json.dumps({"city": "Paris", "why": HYP})
    got = _run(sdk, grader, sample, {"city": "Paris", "answer": REF})
    assert got.sub_rewards == {"exact": 1.0, "close": pytest.approx(5 / 6)}
    assert got.reward == pytest.approx(0.5 + 0.5 * 5 / 6)
    valid = sdk.fine_tuning.alpha.graders.validate(grader=grader)  # type: ignore[arg-type]
    assert valid.grader.type == "multi"  # type: ignore[union-attr]


def test_a_grade_that_fails_on_its_inputs_is_0_with_openais_flag(
    app_client: TestClient, key_a: str
) -> None:
    def run(grader: dict[str, Any], sample: str, item: Any) -> dict[str, Any]:
        body = {"grader": grader, "model_sample": sample, "item": item}
        out = app_client.post("/v1/fine_tuning/alpha/graders/run", headers=H(key_a), json=body)
        assert out.status_code == 200, out.text
        return dict(out.json())

    check = {"type": "string_check", "name": "c", "operation": "eq",
             "input": "{{sample.output_text}}", "reference": "{{item.missing}}"}  # fmt: skip
    for grader, sample, flag in (
        (check, "x", "invalid_variable_error"),
        ({**check, "reference": "{{item.list.5}}"}, "x", "invalid_variable_error"),
        ({**check, "input": "{{sample.output_json.a}}", "reference": "x"}, "not json",
         "sample_parse_error"),
        ({**check, "input": "{{ other.thing }}", "reference": "x"}, "x", "invalid_variable_error"),
        ({"type": "multi", "name": "m", "graders": {"a": {**check, "reference": "x"}},
          "calculate_output": "a / (a - a)"}, "x", "formula_parse_error"),
    ):  # fmt: skip
        got = run(grader, sample, {"list": [1]})
        assert got["reward"] == 0 and got["metadata"]["errors"][flag], (grader, got)
        assert got["metadata"]["error_details"], got
    listed = run({**check, "reference": "{{item.list}}"}, "[1, 2]", {"list": [1, 2]})
    assert listed["reward"] == 1  # a value that is not a string goes in as JSON


@pytest.mark.parametrize(
    ("grader", "needle"),
    [
        ({"type": "python", "name": "p", "source": "def grade(s, i): return 1"},
         "TUNEFLEET_PYTHON_GRADERS=true"),
        ({"type": "score_model", "name": "s", "model": "x", "input": []}, "score_model"),
        ({**_similarity("cosine")}, "TuneFleet serves no embedding model"),
        ({"type": "string_check", "name": "c", "operation": "regex", "input": "a",
          "reference": "b"}, "operation"),
        ({"type": "multi", "name": "m", "graders": {"a": _similarity("bleu")},
          "calculate_output": "a + b"}, "names ['b'], which are not among the graders ['a']"),
        ({"type": "multi", "name": "m", "graders": {"a": _similarity("bleu")},
          "calculate_output": "__import__('os').system('id')"}, "calculate_output"),
        ({"type": "multi", "name": "m", "graders": {"a": _similarity("bleu")},
          "calculate_output": "a.real"}, "uses Attribute"),
    ],
)  # fmt: skip
def test_a_grader_that_cannot_run_is_a_400_naming_it(
    sdk: OpenAI, grader: dict[str, Any], needle: str
) -> None:
    for call in (
        lambda: sdk.fine_tuning.alpha.graders.validate(grader=grader),  # type: ignore[arg-type]
        lambda: _run(sdk, grader, "x"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        assert needle in str(refused.value), refused.value


@pytest.fixture
def python_on(settings: Any, key_a: str) -> Any:
    from tunefleet.api import create_app

    on = settings.model_copy(update={"python_graders": True, "python_grader_cpu_s": 2})
    with TestClient(create_app(on)) as client:
        yield client


def _python(client: TestClient, key: str, source: str, sample: str = "4") -> dict[str, Any]:
    body = {"grader": {"type": "python", "name": "py", "source": source},
            "model_sample": sample, "item": {"answer": 4}}  # fmt: skip
    out = client.post("/v1/fine_tuning/alpha/graders/run", headers=H(key), json=body)
    assert out.status_code == 200, out.text
    return dict(out.json())


@pytest.mark.skipif(
    __import__("tunefleet.platform.sandbox", fromlist=["x"]).available() is not None,
    reason="no Landlock in this kernel: python graders are refused here (their own test)",
)
def test_a_python_grader_runs_in_its_sandbox_and_each_limit_holds(
    python_on: TestClient, key_a: str, settings: Any, tmp_path: Any
) -> None:
    import socket

    ok = _python(python_on, key_a, "def grade(sample, item):\n"
                 "    return float(sample['output_json'] == item['answer'])")  # fmt: skip
    assert ok["reward"] == 1 and not ok["metadata"]["errors"]["python_grader_runtime_error"]
    threads = _python(python_on, key_a, "import threading\ndef grade(s, i):\n"
                      "    t = threading.Thread(target=lambda: None); t.start(); t.join()\n"
                      "    return 0.5")  # fmt: skip
    assert threads["reward"] == 0.5  # threads may start: only new processes are refused

    # a socket listening here: the sandbox's connect never reaches it (a connection that
    # did would wait in its backlog, accepted or not)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cr3t")
    outside = tmp_path / "escaped.txt"
    cases = {  # what the code does -> (OpenAI's error flag, what its details say)
        "fork bomb": ("import os\ndef grade(s, i):\n    while True: os.fork()",
                      "runtime", "Operation not permitted"),
        "a program": ("import subprocess\ndef grade(s, i):\n    subprocess.run(['id'])",
                      "runtime", "Operation not permitted"),
        "infinite loop": ("def grade(s, i):\n    while True: pass", "server", "CPU time"),
        "sleeping": ("import time\ndef grade(s, i):\n    time.sleep(60)", "server",
                     "wall-clock"),
        "10 GB": ("def grade(s, i):\n    x = bytearray(10 * 10**9)\n    return 1",
                  "runtime", "MemoryError"),
        # nothing of the API's environment; Python itself sets LC_CTYPE (PEP 538)
        "environment": ("import os\ndef grade(s, i):\n    return float(set(os.environ) <= "
                        "{'LC_CTYPE'})", None, ""),
        "socket": (f"import socket\ndef grade(s, i):\n    socket.create_connection("
                   f"('127.0.0.1', {port}), timeout=2)", "runtime", "Error"),
        "write outside": (f"def grade(s, i):\n    open({str(outside)!r}, 'w').write('x')",
                          "runtime", "Permission denied"),
        "read a file": (f"def grade(s, i):\n    return len(open({str(secret)!r}).read())",
                        "runtime", "Permission denied"),
        "write its own": ("def grade(s, i):\n    open('mine', 'w').write('abc')\n"
                          "    return len(open('mine').read())", None, ""),
    }  # fmt: skip
    for name, (source, flag, needle) in cases.items():
        got = _python(python_on, key_a, source)
        errors = got["metadata"]["errors"]
        if flag is None:  # it ran: no credentials in its environment, its own folder
            assert got["reward"] == (1 if name == "environment" else 3), (name, got)
            assert not errors["python_grader_runtime_error"], (name, got)
            continue
        assert got["reward"] == 0 and errors[f"python_grader_{flag}_error"], (name, got)
        assert needle in got["metadata"]["error_details"], (name, got)
        if flag == "server":
            assert errors["python_grader_server_error_type"] == "timeout", (name, got)
    server.setblocking(False)
    with pytest.raises(BlockingIOError):
        server.accept()
    server.close()
    assert not outside.exists()
    # and the API goes on answering
    assert _python(python_on, key_a, "def grade(s, i):\n    return 1")["reward"] == 1
