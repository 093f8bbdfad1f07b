"""The memory planner reproduces the seeds' figures and walks their tuning chart."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from tunefleet.platform.errors import InvalidRequest
from tunefleet.platform.planner import (
    GiB,
    ModelShape,
    PlanInput,
    advise,
    lora_params,
    parameter_counts,
    plan_input_from_spec,
    plan_memory,
    resolve_spec,
)
from tunefleet.platform.spec import JobSpec

# Llama-2-7B's config.json (the fields memory depends on); no download needed.
LLAMA2_7B = ModelShape.from_config({
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "tie_word_embeddings": False,
})  # fmt: skip
LLAMA3_70B = ModelShape.from_config({
    "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
})  # fmt: skip
SMOLLM2_135M = ModelShape.from_config({
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "tie_word_embeddings": True,
})  # fmt: skip


def test_llama2_7b_parameter_count() -> None:
    assert LLAMA2_7B.total_params == 6_738_415_616


def test_lora_r8_on_q_and_v_matches_peft() -> None:
    trainable, total = parameter_counts(
        LLAMA2_7B, PlanInput(method="lora", lora_r=8, lora_targets=("q_proj", "v_proj"))
    )
    assert (trainable, total) == (4_194_304, 6_742_609_920)
    assert f"{100 * trainable / total:.4f}" == "0.0622"


def test_one_4096_square_layer_with_r8_adds_65536() -> None:
    square = ModelShape(
        vocab_size=1,
        hidden_size=4096,
        intermediate_size=4096,
        num_layers=1,
        num_heads=32,
        num_kv_heads=32,
        head_dim=128,
        tie_word_embeddings=True,
    )
    added = lora_params(square, 8, ["q_proj"])
    assert added == 65_536
    assert f"{100 * added / (4096 * 4096):.2f}" == "0.39"


def test_smollm2_135m_parameter_count() -> None:
    assert SMOLLM2_135M.total_params == 134_515_008  # what transformers reports


def test_full_fine_tune_mixed_precision_is_16_bytes_per_parameter() -> None:
    plan = plan_memory(LLAMA2_7B, PlanInput(method="full", precision="bf16"))
    assert plan.states / LLAMA2_7B.total_params == 16
    assert (plan.weights, plan.gradients, plan.optimizer) == (
        2 * LLAMA2_7B.total_params,
        2 * LLAMA2_7B.total_params,
        12 * LLAMA2_7B.total_params,
    )
    # "7B x 16 bytes = 112 GB": 6.74e9 real parameters give 107.8 GB
    assert abs(plan.states - 112e9) / 112e9 < 0.05


@pytest.mark.parametrize(
    "stage,sharded",
    [
        ("zero1", {"optimizer"}),
        ("zero2", {"optimizer", "gradients"}),
        ("zero3", {"optimizer", "gradients", "weights"}),
    ],
)
def test_zero_stages_divide_what_they_shard_by_the_workers(stage: str, sharded: set[str]) -> None:
    ddp = plan_memory(LLAMA2_7B, PlanInput(method="full", num_workers=8))
    zero = plan_memory(LLAMA2_7B, PlanInput(method="full", num_workers=8, strategy=stage))  # type: ignore[arg-type]
    for part in ("weights", "gradients", "optimizer"):
        ratio = getattr(zero, part) / getattr(ddp, part)
        assert ratio == (1 / 8 if part in sharded else 1), part
    if stage == "zero3":
        assert zero.states == ddp.states / 8  # 1/8 of the 112 GB on each of 8 GPUs


def test_lora_and_qlora_shrink_the_states() -> None:
    full = plan_memory(LLAMA2_7B, PlanInput(method="full"))
    lora = plan_memory(LLAMA2_7B, PlanInput(method="lora", lora_r=16, lora_targets=("all-linear",)))
    qlora = plan_memory(
        LLAMA2_7B, PlanInput(method="qlora", lora_r=16, lora_targets=("all-linear",))
    )
    assert lora.states < full.states / 7
    assert 3.5 * GiB < qlora.weights < 4.5 * GiB  # the seeds: 7B QLoRA fits a 24 GB card
    no_dq = plan_memory(
        LLAMA2_7B,
        PlanInput(method="qlora", lora_r=16, lora_targets=("all-linear",), double_quant=False),
    )
    saved_bits = 8 * (no_dq.weights - qlora.weights) / (32 * LLAMA2_7B.layer_linear_params)
    assert 0.35 < saved_bits < 0.4  # double quantization saves ~0.37 bits per parameter


def test_gradient_checkpointing_cuts_activations() -> None:
    args = {"method": "lora", "per_device_batch": 8, "seq_len": 2048}
    plain = plan_memory(LLAMA2_7B, PlanInput(**args))  # type: ignore[arg-type]
    ckpt = plan_memory(LLAMA2_7B, PlanInput(**args, gradient_checkpointing=True))  # type: ignore[arg-type]
    assert ckpt.activations < plain.activations / 5
    assert ckpt.states == plain.states


def test_chart_small_model_fits_ddp_with_batch_and_accumulation() -> None:
    advice = advise(SMOLLM2_135M, PlanInput(method="lora", seq_len=512), 24 * GiB, global_batch=64)
    assert (advice.strategy, advice.gradient_checkpointing, advice.fits) == ("ddp", False, True)
    assert advice.per_device_batch * advice.gradient_accumulation_steps >= 64
    assert advice.breakdown.total <= 0.9 * 24 * GiB


def test_chart_goes_to_checkpointing_then_zero3_then_offload() -> None:
    on_80g = advise(LLAMA2_7B, PlanInput(method="lora", seq_len=4096), 80 * GiB, global_batch=8)
    assert on_80g.strategy == "ddp" and on_80g.fits
    on_24g = advise(LLAMA2_7B, PlanInput(method="lora", seq_len=4096), 24 * GiB, global_batch=8)
    assert (on_24g.strategy, on_24g.gradient_checkpointing) == ("ddp", True)
    full_8x80 = advise(
        LLAMA2_7B, PlanInput(method="full", num_workers=8), 80 * GiB, global_batch=64
    )
    assert (full_8x80.strategy, full_8x80.fits) == ("zero3", True)
    full_1x80 = advise(
        LLAMA2_7B, PlanInput(method="full"), 80 * GiB, global_batch=64, host_bytes=512 * GiB
    )
    assert (full_1x80.strategy, full_1x80.fits) == ("zero3_offload", True)


def test_70b_full_fine_tune_on_one_24gb_gpu_says_what_is_needed() -> None:
    advice = advise(LLAMA3_70B, PlanInput(method="full"), 24 * GiB, global_batch=64)
    assert not advice.fits
    text = " ".join(advice.reasons)
    assert "nothing fits" in text and "LoRA or QLoRA" in text
    assert "host memory of at least" in text and "ZeRO-3 over at least" in text


LLAMA2_7B_CONFIG = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "tie_word_embeddings": False,
}  # fmt: skip


def _spec(**tunefleet: Any) -> JobSpec:
    return JobSpec.model_validate(
        {
            "job_id": "ftjob-1",
            "tenant_id": "t",
            "model": "llama-2-7b",
            "training_file": "file-1",
            "hyperparameters": {"n_epochs": 1, "batch_size": 64, "learning_rate_multiplier": 1},
            "seed": 0,
            "tunefleet": tunefleet,
        }
    )


def test_auto_strategy_is_settled_by_the_chart_and_a_given_one_is_kept() -> None:
    gpus = {"resources": {"num_workers": 8, "gpus_per_worker": 1}}
    # full fine-tuning of 7B: 112 GB of states need ZeRO-3 over 8 x 80 GB
    full, plan = resolve_spec(
        LLAMA2_7B_CONFIG, _spec(method="full", **gpus), device_bytes=80 * GiB, host_bytes=0
    )
    assert full.tunefleet.strategy == "zero3" and full.tunefleet.gradient_checkpointing is True
    assert plan["input"]["strategy"] == "zero3"
    lora, _ = resolve_spec(LLAMA2_7B_CONFIG, _spec(**gpus), device_bytes=80 * GiB, host_bytes=0)
    assert lora.tunefleet.strategy == "ddp"
    kept, plan = resolve_spec(
        LLAMA2_7B_CONFIG, _spec(strategy="zero2", **gpus), device_bytes=80 * GiB, host_bytes=0
    )
    assert kept.tunefleet.strategy == "zero2" and plan["input"]["strategy"] == "zero2"
    # CPU workers cannot offload: the job is refused, saying so
    cpus = {"resources": {"num_workers": 1}}
    with pytest.raises(InvalidRequest, match="zero3_offload"):
        resolve_spec(
            LLAMA2_7B_CONFIG,
            _spec(method="full", **cpus),
            device_bytes=80 * GiB,
            host_bytes=512 * GiB,
        )


@pytest.mark.parametrize("method", ["prefix_tuning", "prompt_tuning"])
def test_what_the_planner_settles_is_a_spec_the_spec_accepts(method: str) -> None:
    """The planner wrote its settled values without validating them: for a method that
    cannot shard, the chart's step up to ZeRO-3 gave a stored spec the spec itself refuses
    (and the controller could not read). Such a method stays on DDP, and the job that does
    not fit there is refused at creation, saying so."""
    # a 7B base in fp32 (28 GB): more than one 24 GiB GPU holds, whatever the strategy
    gpus = {"resources": {"num_workers": 8, "gpus_per_worker": 1}, "precision": "fp32"}
    with pytest.raises(InvalidRequest, match=r"ddp: .* does not fit") as refused:
        resolve_spec(
            LLAMA2_7B_CONFIG, _spec(method=method, **gpus), device_bytes=24 * GiB, host_bytes=0
        )
    assert refused.value.code == "does_not_fit"
    spec, plan = resolve_spec(
        LLAMA2_7B_CONFIG, _spec(method=method, **gpus), device_bytes=80 * GiB, host_bytes=0
    )
    assert spec.tunefleet.strategy == "ddp" and plan["input"]["strategy"] == "ddp"
    assert JobSpec.model_validate(spec.model_dump(mode="json")) == spec


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"strategy": "zero3_offload"}, "'zero3_offload'"),
        ({"strategy": "zero3", "method": "prompt_tuning"}, "prompt_tuning"),
        ({"merged_model": True, "method": "adapter"}, "adapter cannot be merged"),
        ({"packing": True, "method": "prefix_tuning"}, "packing: prefix_tuning"),
    ],
)
def test_options_a_job_cannot_use_are_refused(options: dict[str, Any], named: str) -> None:
    with pytest.raises(ValidationError, match=named):
        _spec(**options)


def test_a_probe_setting_the_job_gave_is_kept_and_each_plan_is_its_own() -> None:
    """The planner set probe_micro_batch whenever it chose the micro-batch, overwriting a
    job that asked not to probe; and the cache handed every caller the same plan dict."""
    gpus = {"resources": {"num_workers": 1, "gpus_per_worker": 1}}
    chosen, plan = resolve_spec(
        LLAMA2_7B_CONFIG, _spec(**gpus), device_bytes=80 * GiB, host_bytes=0
    )
    assert chosen.tunefleet.probe_micro_batch is True  # the planner chose: probe it
    kept, again = resolve_spec(
        LLAMA2_7B_CONFIG,
        _spec(**gpus, probe_micro_batch=False),
        device_bytes=80 * GiB,
        host_bytes=0,
    )
    assert kept.tunefleet.probe_micro_batch is False
    assert kept.tunefleet.micro_batch_size == chosen.tunefleet.micro_batch_size
    plan["notes"] = "changed by one caller"
    _, third = resolve_spec(LLAMA2_7B_CONFIG, _spec(**gpus), device_bytes=80 * GiB, host_bytes=0)
    assert third != plan and third == again


def test_dpo_plans_both_sequences_of_a_pair_and_says_where_its_reference_comes_from() -> None:
    """A DPO job's pair is two sequences in one forward pass: twice a supervised job's
    activations and logits per example, the same states (no second copy of the model for
    either reference), and the plan's notes say which reference the run uses."""
    gpus = {"resources": {"gpus_per_worker": 1}, "micro_batch_size": 2}
    supervised = _spec(**gpus)
    plans = {}
    for reference in ("adapter_disabled", "precomputed"):
        dpo = JobSpec.model_validate(
            {
                **supervised.model_dump(),
                "objective": "dpo",
                "dpo": {"beta": 0.1, "reference": reference},
            }
        )
        plans[reference] = resolve_spec(LLAMA2_7B_CONFIG, dpo, device_bytes=80 * GiB, host_bytes=0)[
            1
        ]
    base = resolve_spec(LLAMA2_7B_CONFIG, supervised, device_bytes=80 * GiB, host_bytes=0)[1]
    for reference, plan in plans.items():
        got, alone = plan["breakdown"], base["breakdown"]
        assert plan["input"]["sequences_per_example"] == 2
        assert plan["input"]["reference"] == reference
        assert got["states"] == alone["states"]
        assert got["activations"] > 1.9 * alone["activations"]
        assert got["logits"] == 2 * alone["logits"]
        notes = " ".join(got["notes"])
        assert "each pair's 2 sequences in one forward pass" in notes
        said = {"adapter_disabled": "adapter switched off", "precomputed": "precomputed once"}
        assert said[reference] in notes and "copy of the weights" in notes


@pytest.mark.parametrize("method", ["lora", "full"])
def test_auto_precision_is_planned_for_what_the_workers_may_choose(method: str) -> None:
    """GPU workers choose bf16 or fp16 (two bytes either way); CPU workers bf16 or fp32
    by a CPU the API cannot see, so the plan is the larger of the two (for LoRA, a base
    stored in four bytes; for full fine-tuning, fp32 activations against fp32 masters
    plus autocast's 16-bit copies)."""
    gpu = plan_input_from_spec(_spec(method=method, resources={"gpus_per_worker": 1}), LLAMA2_7B)
    assert gpu.precision == "bf16"
    cpu = plan_input_from_spec(_spec(method=method), LLAMA2_7B)
    totals = {
        p: plan_memory(
            LLAMA2_7B, plan_input_from_spec(_spec(method=method, precision=p), LLAMA2_7B)
        ).total
        for p in ("fp32", "bf16")
    }
    assert cpu.precision == max(totals, key=totals.__getitem__)
    named = plan_input_from_spec(_spec(method=method, precision="fp16"), LLAMA2_7B)
    assert named.precision == "fp16"
