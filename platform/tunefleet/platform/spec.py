"""The fine-tuning job spec: one frozen, versioned, typed object from API to worker.

The API builds it from the create body (resolving ``"auto"`` values), the database stores
it as JSON, the controller hands it to the Ray driver and the training loop reads it. It is
never rebuilt or edited on the way.

Glossary: a *job* is the user's request; a *run* is one Ray job that executes it (a job may
need several runs after a failure or a pause).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SPEC_VERSION: Literal[1] = 1

# What "auto" resolves to. Documented in docs/jobs.md; the memory planner (issue 6)
# replaces the batch-size rule.
AUTO_N_EPOCHS = 3
AUTO_BATCH_SIZE = 4
AUTO_LR_MULTIPLIER = 1.0
# Base learning rates that learning_rate_multiplier scales, per method.
BASE_LEARNING_RATE = {"lora": 2e-4, "full": 2e-5}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class LoraOptions(_Frozen):
    """LoRA adapter shape (peft ``LoraConfig``)."""

    r: int = Field(default=8, ge=1, le=1024, description="Rank of the low-rank update.")
    alpha: int = Field(default=16, gt=0, description="Scaling numerator: update = alpha/r * BA.")
    dropout: float = Field(default=0.05, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="Module names that get an adapter, or ['all-linear'].",
    )


class Resources(_Frozen):
    """What one run asks of the Ray cluster."""

    num_workers: int = Field(default=1, ge=1, le=1024, description="Ray Train workers.")
    gpus_per_worker: float = Field(default=0, ge=0, description="GPUs per worker (0 = CPU).")
    cpus_per_worker: float = Field(default=1, gt=0, description="CPUs per worker.")


class TuneFleetOptions(_Frozen):
    """TuneFleet's own controls, sent under ``tunefleet`` in the create body."""

    method: Literal["lora"] = Field(default="lora", description="Fine-tuning method.")
    lora: LoraOptions = Field(default_factory=LoraOptions, description="LoRA parameters.")
    max_seq_len: int = Field(
        default=512, ge=8, le=1_048_576, description="Tokens per example; longer are truncated."
    )
    max_steps: int | None = Field(
        default=None, ge=1, description="Stop after this many optimizer steps (None: epochs)."
    )
    warmup_ratio: float = Field(default=0.0, ge=0, lt=1, description="Linear warm-up share.")
    checkpoint_every_steps: int = Field(
        default=0, ge=0, description="Checkpoint every N steps (0: only at epoch ends)."
    )
    gradient_checkpointing: bool | Literal["auto"] = Field(
        default="auto",
        description="Recompute activations in backward to save memory (~+30% time); 'auto' "
        "turns it on only when the memory planner says the job does not fit without it.",
    )
    micro_batch_size: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="Examples per worker per forward pass; gradient accumulation makes up "
        "the global batch_size. None: the largest the memory planner fits.",
    )
    resources: Resources = Field(default_factory=Resources, description="Cluster resources.")
    priority: int = Field(default=0, ge=-100, le=100, description="Higher runs first.")


class Hyperparameters(_Frozen):
    """OpenAI's supervised hyperparameters with every ``"auto"`` already resolved."""

    n_epochs: int = Field(ge=1, le=50)
    batch_size: int = Field(ge=1, le=4096)
    learning_rate_multiplier: float = Field(gt=0, le=100)


class JobSpec(_Frozen):
    """Everything a run needs to train, and nothing it must look up elsewhere."""

    version: Literal[1] = Field(default=SPEC_VERSION, description="Spec schema version.")
    job_id: str = Field(description="The job this spec belongs to.")
    tenant_id: str = Field(description="Owning tenant.")
    model: str = Field(description="Base model name in the model registry.")
    training_file: str = Field(description="File id of the training data.")
    validation_file: str | None = Field(default=None, description="File id for evaluation.")
    hyperparameters: Hyperparameters
    seed: int = Field(ge=0, le=2**31 - 1, description="Seed for shuffling and initialisation.")
    suffix: str | None = Field(default=None, description="User suffix in fine_tuned_model.")
    tunefleet: TuneFleetOptions = Field(default_factory=TuneFleetOptions)

    @property
    def learning_rate(self) -> float:
        base = BASE_LEARNING_RATE[self.tunefleet.method]
        return base * self.hyperparameters.learning_rate_multiplier


def fine_tuned_model_name(base: str, tenant_name: str, suffix: str | None, job_id: str) -> str:
    """OpenAI's naming: ``ft:{base}:{tenant}:{suffix}:{id}`` (empty suffix kept as '')."""
    return f"ft:{base}:{tenant_name}:{suffix or ''}:{job_id}"
