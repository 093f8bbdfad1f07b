"""Graders in OpenAI's shapes (its fine-tuning and Evals API graders), run here: what
``POST /v1/fine_tuning/alpha/graders/run`` and ``/validate`` answer, and what evals and
reinforcement fine-tuning score with.

- ``string_check``: ``eq``, ``ne`` (1 or 0), ``like`` (the input contains the reference),
  ``ilike`` (the same, ignoring case).
- ``text_similarity``: a score from 0 to 1 by a maintained library, never by code of ours:
  ``fuzzy_match`` rapidfuzz's ``fuzz.ratio`` (normalized Indel similarity); ``bleu``
  sacrebleu's sentence BLEU (its defaults: 13a tokenization, exponential smoothing);
  ``gleu`` nltk's ``sentence_gleu``; ``meteor`` nltk's ``meteor_score`` with exact and
  Porter-stem matches (no WordNet synonyms: its corpus is a download, not a package);
  ``rouge_1`` to ``rouge_5`` and ``rouge_l`` Google's rouge-score F-measure. nltk's
  metrics read words split by ``wordpunct_tokenize``. ``cosine`` needs an embedding model,
  which TuneFleet does not serve yet: refused by name.
- ``python``: ``grade(sample, item)`` of the tenant's source, where the operator turned
  them on (``TUNEFLEET_PYTHON_GRADERS``), in ``sandbox.py``'s child process: its errors
  are OpenAI's ``python_grader_runtime_error`` (the code raised) and
  ``python_grader_server_error`` (a limit ended it: ``timeout``...).
- ``multi``: named graders combined by ``calculate_output``, a formula of their names,
  numbers, ``+ - * / ^`` and ``min max abs floor ceil exp sqrt log`` (read as a Python
  expression tree, only those nodes allowed).

Templates (``input``, ``reference``): ``{{ item.path }}``, ``{{ sample.output_text }}``,
``{{ sample.output_json.path }}`` (the sample parsed as JSON), paths through objects by key
and lists by index; a value that is not a string is put in as JSON. A variable that names
nothing, or ``output_json`` of a sample that is not JSON, gives a reward of 0 with its
error flag set, as OpenAI answers (``invalid_variable_error``, ``sample_parse_error``).
"""

from __future__ import annotations

import ast
import json
import math
import re
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tunefleet.platform.sandbox import GradeError, Limits, SandboxError, run_python

MAX_TEXT = 256 * 1024  # characters of a template or of what it becomes
MAX_FORMULA = 1000
_TEMPLATE = re.compile(r"\{\{\s*([^{}]*?)\s*\}\}")
ERROR_FLAGS = (
    "formula_parse_error",
    "invalid_variable_error",
    "model_grader_parse_error",
    "model_grader_refusal_error",
    "model_grader_server_error",
    "other_error",
    "python_grader_runtime_error",
    "python_grader_server_error",
    "sample_parse_error",
    "truncated_observation_error",
    "unresponsive_reward_error",
)
ROUGE = {f"rouge_{n}": f"rouge{n}" for n in range(1, 6)} | {"rouge_l": "rougeL"}
Metric = Literal[
    "cosine", "fuzzy_match", "bleu", "gleu", "meteor",
    "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l",
]  # fmt: skip
_FUNCTIONS = {
    "min": min,
    "max": max,
    "abs": abs,
    "floor": math.floor,
    "ceil": math.ceil,
    "exp": math.exp,
    "sqrt": math.sqrt,
    "log": math.log,
}


class _Grader(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(min_length=1, max_length=256, description="The grader's name.")


class StringCheckGrader(_Grader):
    type: Literal["string_check"]
    input: str = Field(max_length=MAX_TEXT, description="Text to check; may be a template.")
    reference: str = Field(max_length=MAX_TEXT, description="Reference; may be a template.")
    operation: Literal["eq", "ne", "like", "ilike"]


class TextSimilarityGrader(_Grader):
    type: Literal["text_similarity"]
    input: str = Field(max_length=MAX_TEXT)
    reference: str = Field(max_length=MAX_TEXT)
    evaluation_metric: Metric
    pass_threshold: float | None = Field(
        default=None, ge=0, le=1, description="Evals: a score at least this passes."
    )

    @field_validator("evaluation_metric")
    @classmethod
    def _metric(cls, v: str) -> str:
        if v == "cosine":
            raise ValueError(
                "evaluation_metric 'cosine' compares embeddings, and TuneFleet serves no "
                "embedding model yet; use fuzzy_match, bleu, gleu, meteor or rouge_*"
            )
        return v


class PythonGrader(_Grader):
    type: Literal["python"]
    source: str = Field(min_length=1, max_length=MAX_TEXT, description="Defines grade().")
    image_tag: str | None = Field(default=None, max_length=128, description="Ignored here.")


SimpleGrader = Annotated[
    StringCheckGrader | TextSimilarityGrader | PythonGrader, Field(discriminator="type")
]


class MultiGrader(_Grader):
    type: Literal["multi"]
    graders: dict[str, SimpleGrader] = Field(min_length=1, max_length=32)
    calculate_output: str = Field(min_length=1, max_length=MAX_FORMULA)

    @field_validator("graders", mode="before")
    @classmethod
    def _one_or_named(cls, v: Any) -> Any:
        """OpenAI's SDK types ``graders`` as one grader; its API takes them by name."""
        if isinstance(v, dict) and isinstance(v.get("type"), str):
            return {str(v.get("name", "grader")): v}
        return v

    def model_post_init(self, _context: Any) -> None:
        formula_names(self.calculate_output, set(self.graders))


Grader = Annotated[
    StringCheckGrader | TextSimilarityGrader | PythonGrader | MultiGrader,
    Field(discriminator="type"),
]
_REFUSED_TYPES = {
    "score_model": "model graders (score_model) are not available here yet",
    "label_model": "model graders (label_model) are not available here yet",
}


def refused_type(grader: Any) -> str | None:
    """Why TuneFleet refuses a grader of a type OpenAI has (None: it is not refused)."""
    kind = grader.get("type") if isinstance(grader, dict) else None
    return _REFUSED_TYPES.get(kind) if isinstance(kind, str) else None


class GraderFailed(Exception):
    """A grade that fails on its inputs: a reward of 0 with ``flag`` set (and, for the
    sandbox's failures, their ``kind``)."""

    def __init__(self, flag: str, details: str):
        super().__init__(details)
        self.flag = flag
        self.kind: str | None = None


def formula_names(formula: str, names: set[str]) -> ast.Expression:
    """``calculate_output`` parsed, refused (ValueError) unless it is an expression of
    ``names``, numbers, ``+ - * / ^`` and the allowed functions."""
    try:
        tree = ast.parse(formula.replace("^", "**"), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"calculate_output {formula[:200]!r} does not parse: {exc.msg}") from None
    allowed = (
        ast.Expression,
        ast.BinOp,
        ast.UnaryOp,
        ast.Add,
        ast.Sub,
        ast.Mult,
        ast.Div,
        ast.Pow,
        ast.USub,
        ast.UAdd,
        ast.Call,
        ast.Name,
        ast.Load,
        ast.Constant,
    )
    for node in ast.walk(tree):
        if not isinstance(node, allowed):
            raise ValueError(
                f"calculate_output {formula[:200]!r} uses {type(node).__name__}; "
                "use grader names, numbers, + - * / ^ and "
                f"{', '.join(_FUNCTIONS)}"
            )
        if isinstance(node, ast.Constant) and not isinstance(node.value, int | float):
            raise ValueError(f"calculate_output {formula[:200]!r}: {node.value!r} is not a number")
        if isinstance(node, ast.Call) and not (
            isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS and not node.keywords
        ):
            raise ValueError(
                f"calculate_output {formula[:200]!r} calls something other than "
                f"{', '.join(_FUNCTIONS)}"
            )
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call)}  # type: ignore[attr-defined]
    unknown = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} - names - called
    if unknown:
        raise ValueError(
            f"calculate_output names {sorted(unknown)}, which are not among the "
            f"graders {sorted(names)}"
        )
    return tree


def _evaluate(node: ast.AST, values: dict[str, float]) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, values)
    if isinstance(node, ast.Constant):
        assert isinstance(node.value, int | float)  # formula_names let only numbers in
        return float(node.value)
    if isinstance(node, ast.Name):
        return values[node.id]
    if isinstance(node, ast.UnaryOp):
        inner = _evaluate(node.operand, values)
        return -inner if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.Call):
        assert isinstance(node.func, ast.Name)
        function: Any = _FUNCTIONS[node.func.id]
        return float(function(*(_evaluate(a, values) for a in node.args)))
    assert isinstance(node, ast.BinOp)
    a, b = _evaluate(node.left, values), _evaluate(node.right, values)
    if isinstance(node.op, ast.Pow) and abs(b) > 64:
        raise ArithmeticError(f"an exponent of {b:g} is out of range")
    if isinstance(node.op, ast.Add):
        return a + b
    if isinstance(node.op, ast.Sub):
        return a - b
    if isinstance(node.op, ast.Mult):
        return a * b
    if isinstance(node.op, ast.Div):
        return a / b
    return float(a**b)


def _lookup(root: Any, path: list[str], variable: str) -> Any:
    value = root
    for part in path:
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise GraderFailed("invalid_variable_error", f"{{{{{variable}}}}} names nothing")
    return value


def template_variables(template: str) -> list[str]:
    """The variables of ``template``: ``item.x``, ``sample.output_text``..."""
    return [m.group(1) for m in _TEMPLATE.finditer(template)]


def render(template: str, item: Any, sample: str) -> str:
    """``template`` with its ``{{ namespace.path }}`` variables put in."""

    def put(match: re.Match[str]) -> str:
        variable = match.group(1)
        namespace, *path = variable.split(".")
        if namespace == "item":
            value = _lookup(item, path, variable)
        elif namespace == "sample" and path[:1] == ["output_text"] and len(path) == 1:
            value = sample
        elif namespace == "sample" and path[:1] == ["output_json"]:
            try:
                parsed = json.loads(sample)
            except ValueError:
                raise GraderFailed(
                    "sample_parse_error",
                    f"the sample is not JSON, and {{{{{variable}}}}} reads it as JSON",
                ) from None
            value = _lookup(parsed, path[1:], variable)
        else:
            raise GraderFailed(
                "invalid_variable_error",
                f"{{{{{variable}}}}}: use item.*, sample.output_text or sample.output_json.*",
            )
        return value if isinstance(value, str) else json.dumps(value)

    out = _TEMPLATE.sub(put, template)
    if len(out) > MAX_TEXT:
        raise GraderFailed(
            "truncated_observation_error",
            f"a rendered text of {len(out)} characters is over {MAX_TEXT}",
        )
    return out


class _NoSynonyms:
    """nltk's METEOR without WordNet: no synonym matches (exact and stem stages only)."""

    def synsets(self, *_: Any, **__: Any) -> list[Any]:
        return []


def similarity(metric: str, text: str, reference: str) -> float:
    """The ``evaluation_metric`` score of ``text`` against ``reference``, 0 to 1."""
    if metric == "fuzzy_match":
        from rapidfuzz import fuzz

        return float(fuzz.ratio(text, reference)) / 100
    if metric == "bleu":
        import sacrebleu

        return float(sacrebleu.sentence_bleu(text, [reference]).score) / 100
    if metric in ("gleu", "meteor"):
        from nltk.tokenize import wordpunct_tokenize

        words, ref = wordpunct_tokenize(text), wordpunct_tokenize(reference)
        if metric == "gleu":
            from nltk.translate.gleu_score import sentence_gleu

            return float(sentence_gleu([ref], words))
        from nltk.translate.meteor_score import meteor_score

        return float(meteor_score([ref], words, wordnet=_NoSynonyms()))
    from rouge_score import rouge_scorer

    kind = ROUGE[metric]
    return float(rouge_scorer.RougeScorer([kind]).score(reference, text)[kind].fmeasure)


def uses_python(grader: Any) -> bool:
    """Whether ``grader`` is or holds a python grader."""
    if isinstance(grader, MultiGrader):
        return any(isinstance(g, PythonGrader) for g in grader.graders.values())
    return isinstance(grader, PythonGrader)


def _python(grader: PythonGrader, item: Any, sample: str, limits: Limits | None) -> float:
    """``grade(sample, item)`` of the grader's source, in the sandbox: ``sample`` holds
    ``output_text`` and ``output_json`` (None unless the text is JSON), as OpenAI's."""
    if limits is None:
        raise GraderFailed("python_grader_server_error", "python graders are off here")
    try:
        parsed = json.loads(sample)
    except ValueError:
        parsed = None
    try:
        return run_python(
            grader.source, {"output_text": sample, "output_json": parsed}, item, limits
        )
    except GradeError as exc:
        raise GraderFailed("python_grader_runtime_error", str(exc)) from None
    except SandboxError as exc:
        failed = GraderFailed("python_grader_server_error", str(exc))
        failed.kind = exc.kind
        raise failed from None


def _grade(
    grader: StringCheckGrader | TextSimilarityGrader | PythonGrader,
    item: Any,
    sample: str,
    limits: Limits | None,
) -> float:
    if isinstance(grader, PythonGrader):
        return _python(grader, item, sample, limits)
    text, reference = render(grader.input, item, sample), render(grader.reference, item, sample)
    if isinstance(grader, StringCheckGrader):
        passed = {
            "eq": text == reference,
            "ne": text != reference,
            "like": reference in text,
            "ilike": reference.lower() in text.lower(),
        }[grader.operation]
        return 1.0 if passed else 0.0
    return similarity(grader.evaluation_metric, text, reference)


def run_grader(
    grader: StringCheckGrader | TextSimilarityGrader | PythonGrader | MultiGrader,
    item: Any,
    sample: str,
    *,
    python: Limits | None = None,
) -> dict[str, Any]:
    """OpenAI's ``graders/run`` answer for ``grader`` on ``sample`` and ``item``: the
    reward, a multi grader's ``sub_rewards``, and ``metadata`` with the error flags (a
    failed grade is a reward of 0, never an exception). ``python``: the sandbox's limits
    for python graders (None: they are off, and one fails as a server error)."""
    start = time.perf_counter()
    errors: dict[str, Any] = {flag: False for flag in ERROR_FLAGS}
    errors |= {
        "model_grader_server_error_details": None,
        "python_grader_runtime_error_details": None,
        "python_grader_server_error_type": None,
    }
    sub: dict[str, float] = {}
    reward = 0.0
    details = None
    try:
        if isinstance(grader, MultiGrader):
            for name, inner in grader.graders.items():
                sub[name] = _grade(inner, item, sample, python)
            try:
                reward = _evaluate(formula_names(grader.calculate_output, set(sub)), sub)
            except (ArithmeticError, ValueError, TypeError, OverflowError) as exc:
                raise GraderFailed("formula_parse_error", f"calculate_output: {exc}") from None
            if not math.isfinite(reward):
                raise GraderFailed("formula_parse_error", f"calculate_output gave {reward}")
        else:
            reward = _grade(grader, item, sample, python)
    except GraderFailed as exc:
        errors[exc.flag], reward, details = True, 0.0, str(exc)
        if exc.flag == "python_grader_runtime_error":
            errors["python_grader_runtime_error_details"] = details
        if exc.flag == "python_grader_server_error":
            errors["python_grader_server_error_type"] = exc.kind
    metadata = {
        "name": grader.name,
        "type": grader.type,
        "errors": errors,
        "execution_time": time.perf_counter() - start,
        "scores": dict(sub) if sub else {grader.name: reward},
        "token_usage": None,
        "sampled_model_name": None,
        "error_details": details,  # TuneFleet's: what the flag set means here
    }
    return {
        "reward": reward,
        "metadata": metadata,
        "sub_rewards": sub,
        "model_grader_token_usage_per_model": {},
    }
