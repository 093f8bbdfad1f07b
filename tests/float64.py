"""Float64 references and rounding bounds for tests that compare two computations of the
same numbers on the tiny Llama of ``tinyllm.py``.

Two float32 computations of one quantity by different routes (a packed row and the rows
alone, one forward pass and two, a batch and each row by itself, an adapter merged and
not) differ by rounding, and by how much depends on the CPU's kernels: the vector width
(AVX2, AVX-512), the library (MKL's sgemm, oneDNN, ATen's own loops), the blocking each
picks for a shape. A float32 tolerance that holds on one machine fails on another: the
DPO gradient test's 1e-5 did, by 2.3e-5, on an AVX2 EPYC. So such tests compare in
float64 (``assert_close64``), or hold float32 results (a greedy decode's tokens) to a
float64 computation within float32 rounding (``assert_greedy``), with bounds derived here
from the unit roundoff, never fitted to what one machine printed.

The bounds. Summing n terms in floating point, in any order, with any blocking or vector
width, with or without FMA, is off by at most about n * u * (the sum of the terms'
magnitudes), u the unit roundoff (Higham, Accuracy and Stability of Numerical Algorithms,
2nd ed., section 4.2). Through a network the reductions chain: to first order the
result is off by u times the sum of the reduction lengths along the way (``FORWARD``,
``STEPS``) times the magnitudes summed. Where the terms of a sum cancel, those
magnitudes exceed the result's: ``CANCEL`` allows a factor of 100.

``float64()`` makes a model's every step float64. transformers runs RMSNorm and RoPE in
float32 on purpose, and the loss code casts logits with ``.float()``; inside the block a
cast to float32 (``.float()``, ``.to(torch.float32)``, ``dtype=torch.float32``) gives
float64 instead, the default dtype is float64, and an op that returns a tensor narrower
than float64 is an error: "the two differ only by float64 rounding" is checked, not
assumed. The model's parameters and buffers must be float64 already (``double``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

U64 = 2.0**-53  # 1.1e-16
U32 = 2.0**-24  # 6.0e-8

# The reduction lengths along the longest path through the tiny Llama (2 layers, hidden
# 64, MLP 128, head dim 16, vocabulary 320) for rows of up to 64 tokens, added up. Per
# layer: RMSNorm's mean 64, q/k/v 64, attention scores 16, softmax 64, values 64, o 64,
# RMSNorm 64, gate/up 64, down 128 (592), and LoRA's A (at most 128) and B (rank at most
# 16) beside up to four projections (576). Then the final RMSNorm 64, the output layer 64
# and the log-softmax 320.
FORWARD = 2 * (592 + 576) + 64 + 64 + 320  # 2,784
# A backward pass runs the same reductions transposed and sums each weight's gradient
# over the batch's tokens (at most 4 rows of 64).
STEPS = 2 * FORWARD + 4 * 64  # 5,824
# How far the terms of a sum may cancel: its result down to 1/100 of their magnitudes.
CANCEL = 100

_NARROW = (torch.float32, torch.float16, torch.bfloat16)


def _widen(value: Any) -> Any:
    return torch.float64 if value is torch.float32 else value


class float64(TorchFunctionMode):  # lower case: it reads as a function, ``with float64():``
    """A block in which every floating-point step is float64 (see the module docstring)."""

    def __enter__(self) -> float64:
        self._default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        torch.set_default_dtype(self._default)

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        args, kwargs = tree_map(_widen, (args, kwargs or {}))
        out = func(*args, **kwargs)
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and value.dtype in _NARROW:
                raise AssertionError(f"{func} gave a {value.dtype} tensor inside float64()")
        return out


def double(model: Any) -> Any:
    """``model`` in float64, every floating-point parameter and buffer checked."""
    model = model.double()
    narrow = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
              if t.is_floating_point() and t.dtype != torch.float64]  # fmt: skip
    assert not narrow, narrow
    return model


def gamma(n: int, u: float = U32) -> float:
    """Higham's gamma_n = n u / (1 - n u): a dot product of n terms computed in any order,
    with or without FMA, is off by at most gamma_n times the sum of the terms' magnitudes
    (Accuracy and Stability of Numerical Algorithms, 2nd ed., section 3.1)."""
    return n * u / (1 - n * u)


def bound64(scale: float, steps: int = STEPS) -> float:
    """How far two float64 computations of a quantity whose values reach ``scale`` may be
    apart: each is off by at most ``steps * U64`` of the magnitudes summed, which are at
    most ``CANCEL * scale``. For the tiny Llama's gradients (scale 26): 3.3e-9, where a
    wrong mask or position moves them by 0.89 or more (tests/workers/test_dpo.py)."""
    return 2 * steps * U64 * CANCEL * scale


def assert_close64(actual: torch.Tensor, expected: torch.Tensor, msg: Any = None) -> None:
    """Two float64 computations of the same tensor agree within ``bound64``."""
    assert actual.dtype == expected.dtype == torch.float64, (actual.dtype, expected.dtype)
    atol = bound64(float(expected.abs().max()))
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol, msg=msg)


# What other architectures' layers add to FORWARD's path, per layer (the tiny models of
# ``tinyllm.build_tiny_model``: hidden 64, head dim 16): Gemma 2 and 3 normalize four
# times a layer where Llama does twice (+2 x 64), Qwen3 and Gemma 3 normalize each head's
# queries and keys (+16). Qwen2's biases and Mistral's window add no reduction.
LAYER_EXTRA = {"gemma2": 128, "gemma3_text": 128 + 16, "qwen3": 16}


def forward_for(model_type: str, layers: int = 2) -> int:
    """FORWARD for the tiny model of ``model_type``."""
    return FORWARD + layers * LAYER_EXTRA.get(model_type, 0)


def logit_error(model: Any, hidden: torch.Tensor, forward: int = FORWARD) -> torch.Tensor:
    """For each position of ``hidden`` (the last hidden states of ``model``, float64,
    ``[positions, hidden]``), how far a float32 computation of its logits may be from the
    exact ones: ``FORWARD * U32`` times the magnitudes the output layer sums, the largest
    of ``|W_out| @ |h|`` (to first order; ``h`` is RMS-normalized, so no large
    cancellation upstream), plus float64's own (2**29 times smaller). For the tiny Llama
    2,784 * 6e-8 * (11 to 14) = 1.8e-3 to 2.3e-3; its float32 logits measured on an AVX2
    EPYC were 1.4e-5 at most from the float64 ones."""
    head = model.get_output_embeddings().weight.detach().abs()
    magnitude = (hidden.abs() @ head.T).amax(-1)
    return forward * (U32 + U64) * magnitude


def assert_greedy(
    model: Any,
    prompt: list[int],
    tokens: list[int],
    max_tokens: int,
    eos: set[int],
    adjust: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None,
    msg: Any = None,
    forward: int = FORWARD,
) -> int:
    """``tokens`` (cut before an end-of-text token) are a float32 greedy decode of
    ``prompt`` by ``model`` (given in float64, ``double``): at every step the token chosen
    (or the end of text, where the decode stopped short of ``max_tokens``) scores within
    two float32 logit errors (``logit_error``) of the float64 top score. A float32 argmax
    always does: each score is off by at most one such error. So where the top two scores
    are further apart, the token is the float64 argmax itself, on every CPU; at a near tie
    either will do, and the decode goes on from the one it chose. ``adjust(scores,
    tokens_so_far)`` changes the scores first (penalties, biases; one more rounding).
    ``forward``: the model's reduction lengths (``forward_for`` its architecture).
    Returns how many choices were decided (no near tie)."""
    assert len(tokens) <= max_tokens, msg
    with torch.inference_mode(), float64():
        out = model(input_ids=torch.tensor([prompt + tokens]), output_hidden_states=True)
        at = slice(len(prompt) - 1, len(prompt) + len(tokens))
        logits, hidden = out.logits[0, at], out.hidden_states[-1][0, at]
        errors = logit_error(model, hidden, forward).tolist()
        decided = 0
        for step, error in enumerate(errors):
            scores = logits[step] if adjust is None else adjust(logits[step], tokens[:step])
            error += U32 * float(scores.abs().max())  # the adjusted scores rounded once more
            top = float(scores.max())
            if step < len(tokens):
                chosen = [tokens[step]]
                assert tokens[step] not in eos, (msg, step, "an end-of-text token was kept")
            elif step < max_tokens:  # it stopped here
                assert eos, (msg, step, "stopped short of max_tokens with no end of text")
                chosen = sorted(eos)
            else:
                break
            best = max(float(scores[c]) for c in chosen)
            assert best >= top - 2 * error, (
                msg, step, f"chose {chosen} scoring {best}, the top scores {top} "
                f"(token {int(scores.argmax())}), allowed {2 * error:.2e} below it",
            )  # fmt: skip
            second = float(scores.topk(2).values[1])
            decided += top - second > 2 * error
    return decided
