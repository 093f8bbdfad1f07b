"""The fine-tuning job spec: one frozen, versioned, typed object from API to worker.

The API builds it from the create body (resolving ``"auto"`` values), the database stores
it as JSON, the controller hands it to the Ray driver and the training loop reads it. It is
never rebuilt or edited on the way.

Glossary: a *job* is the user's request; a *run* is one Ray job that executes it (a job may
need several runs after a failure or a pause).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

SPEC_VERSION: Literal[1] = 1

# Base learning rates that learning_rate_multiplier scales, per method (the values the
# methods' papers and peft's examples use). LoRA, QLoRA and full fine-tuning of a
# Llama-family model use ``base_learning_rate`` instead: these by the model's width.
BASE_LEARNING_RATE = {
    "lora": 2e-4,
    "qlora": 2e-4,
    "full": 2e-5,
    "ia3": 3e-3,
    "prefix_tuning": 1e-2,
    "prompt_tuning": 3e-2,
    "bitfit": 1e-3,
    "adapter": 5e-4,
}
Method = Literal[
    "lora", "qlora", "full", "ia3", "prefix_tuning", "prompt_tuning", "bitfit", "adapter"
]
PEFT_METHODS = ("lora", "qlora", "ia3", "prefix_tuning", "prompt_tuning")
# How the workers divide the work: DDP (everything replicated, gradients all-reduced) or
# FSDP2 sharding each decoder layer's parameters, gradients and optimizer states across
# the workers: ZeRO-3 frees a layer's gathered parameters after its forward, ZeRO-2 keeps
# them until the backward; zero3_offload also keeps the shards in host memory (GPUs).
Strategy = Literal["ddp", "zero2", "zero3", "zero3_offload"]
# The linear modules of a Llama-family decoder layer: what LoRA and (IA)^3 may target
# (the memory planner counts their parameters by these names).
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Phi-3's fused projections, and the Llama ones each computes. On a Phi-3 model a Llama
# name targets the fused module that holds it (q_proj: qkv_proj); on the others a fused
# name is refused when the job is planned, naming the model's own modules.
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
TARGET_MODULES = (*LINEAR_MODULES, *FUSED_MODULES)


def layer_modules(fused: bool) -> tuple[str, ...]:
    """The linear modules of a decoder layer, fused (Phi-3) or not."""
    return ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") if fused else LINEAR_MODULES


def model_targets(targets: list[str], fused: bool) -> list[str]:
    """peft's target names for a model's own modules: on a fused one (``fused``: Phi-3)
    each Llama name becomes the fused module holding it, once; elsewhere they stay."""
    if not fused:
        return list(targets)
    named = [next((f for f, parts in FUSED_MODULES.items() if t in parts), t) for t in targets]
    return list(dict.fromkeys(named))


def _check_targets(field: str, targets: list[str], *, all_linear: bool) -> list[str]:
    if all_linear and targets == ["all-linear"]:
        return targets
    unknown = [t for t in targets if t not in TARGET_MODULES]
    if unknown:
        also = " or ['all-linear']" if all_linear else ""
        raise ValueError(
            f"{field} {unknown!r} are not linear modules of a Llama-family layer; use some "
            f"of {', '.join(LINEAR_MODULES)}{also} (on Phi-3 these name its fused "
            f"{', '.join(FUSED_MODULES)}, which may also be named)"
        )
    return targets


class _Frozen(BaseModel):
    # NaN and infinities are refused: JSON cannot store them, so a spec holding one would
    # read back as another value (or fail) once stored
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class LoraOptions(_Frozen):
    """LoRA adapter shape (peft ``LoraConfig``). The defaults follow the seeds and "LoRA
    Without Regret" (alpha 2r, every linear layer of the decoder, the MLP included) at the
    rank ``bench/efficacy.py`` chose over several seeds (docs/training.md, "Defaults"):
    32, where 16 learned less on the memorisation-like tasks."""

    r: int = Field(default=32, ge=1, le=1024, description="Rank of the low-rank update.")
    alpha: int = Field(default=64, gt=0, description="Scaling numerator: update = alpha/r * BA.")
    dropout: float = Field(default=0.05, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: list[str] = Field(
        default_factory=lambda: list(LINEAR_MODULES),
        min_length=1,
        description="Module names that get an adapter, or ['all-linear'].",
    )
    use_rslora: bool = Field(
        default=False, description="rsLoRA: scale by alpha/sqrt(r) instead of alpha/r."
    )
    use_dora: bool = Field(
        default=False,
        description="DoRA: learn a magnitude per output and a LoRA direction (served merged).",
    )

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: list[str]) -> list[str]:
        return _check_targets("lora.target_modules", v, all_linear=True)


class QLoraOptions(_Frozen):
    """How QLoRA quantizes the frozen base (bitsandbytes)."""

    quant_type: Literal["nf4", "fp4"] = Field(default="nf4", description="4-bit data type.")
    double_quant: bool = Field(default=True, description="Quantize the quantization constants.")
    compute_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="bfloat16", description="dtype the 4-bit weights are de-quantized to."
    )


class IA3Options(_Frozen):
    """(IA)^3: learned vectors that rescale keys, values and feed-forward activations."""

    target_modules: list[str] = Field(
        default_factory=lambda: ["k_proj", "v_proj", "down_proj"], min_length=1
    )
    feedforward_modules: list[str] = Field(
        default_factory=lambda: ["down_proj"],
        description="Targets whose input (not output) is rescaled; a subset of targets.",
    )

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: list[str]) -> list[str]:
        return _check_targets("ia3.target_modules", v, all_linear=False)

    @model_validator(mode="after")
    def _feedforward_among_targets(self) -> IA3Options:
        extra = [m for m in self.feedforward_modules if m not in self.target_modules]
        if extra:
            raise ValueError(
                f"ia3.feedforward_modules {extra!r} are not among ia3.target_modules "
                f"{self.target_modules!r}; add them there or leave them out"
            )
        return self


class VirtualTokenOptions(_Frozen):
    """Prompt and prefix tuning: learned virtual tokens in front of every example."""

    num_virtual_tokens: int = Field(default=16, ge=1, le=512)


class BottleneckOptions(_Frozen):
    """A bottleneck adapter (Houlsby-style): after every decoder block,
    ``h + up(gelu(down(h)))`` with ``up`` starting at zero."""

    bottleneck: int = Field(default=64, ge=1, le=8192, description="Hidden size of the MLP.")


class Resources(_Frozen):
    """What one run asks of the Ray cluster."""

    num_workers: int = Field(default=1, ge=1, le=1024, description="Ray Train workers.")
    gpus_per_worker: float = Field(default=0, ge=0, le=64, description="GPUs per worker (0 = CPU).")
    cpus_per_worker: float = Field(default=1, gt=0, le=1024, description="CPUs per worker.")
    custom_resources_per_worker: dict[str, float] = Field(
        default_factory=dict,
        max_length=8,
        description="Other Ray resources each worker needs, by the names nodes advertise: "
        "an accelerator type (accelerator_type:A100) or a resource the operator gives a "
        "node group. Workers go only to nodes that have them.",
    )

    @field_validator("custom_resources_per_worker")
    @classmethod
    def _named_resources(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory") or name.startswith("node:"):
                raise ValueError(
                    f"{name!r} is not a custom resource: set cpus_per_worker or "
                    "gpus_per_worker, and name only resources a node group advertises"
                )
            if not 0 < len(name) <= 128 or not name.isprintable():
                raise ValueError(f"resource name {name[:40]!r} must be 1-128 printable characters")
            if not 0 < amount <= 1_000_000:
                raise ValueError(f"{name!r}: {amount} must be more than 0 and at most 1000000")
        return value


class RopeScaling(_Frozen):
    """Longer context than the base was trained on, by rescaling its rotary embeddings."""

    type: Literal["linear", "dynamic", "yarn"] = Field(
        description="linear: position interpolation (positions divided by factor); dynamic: "
        "NTK-aware scaling of the base frequency, growing with the sequence; yarn: YaRN "
        "(frequency-dependent interpolation with an attention temperature)."
    )
    factor: float = Field(gt=1, le=64, description="New context / the base's context.")
    original_max_position_embeddings: int | None = Field(
        default=None,
        ge=1,
        description="The base's trained context (default: its max_position_embeddings).",
    )


# What precision "auto" becomes (the workers settle it at start: only they see their
# device); said in a job's first event and in docs/training.md.
AUTO_PRECISION = (
    "the workers choose at start: bf16 where their device computes it natively (GPUs of "
    "compute capability 8.0+, CPUs with AMX or AVX512-BF16), fp16 on older GPUs, fp32 "
    "elsewhere"
)


class TuneFleetOptions(_Frozen):
    """TuneFleet's own controls, sent under ``tunefleet`` in the create body."""

    method: Method = Field(
        default="lora",
        description="Fine-tuning method: lora, qlora (LoRA on a 4-bit base), full, ia3, "
        "prefix_tuning, prompt_tuning, bitfit (biases only), adapter (bottleneck MLPs).",
    )
    lora: LoraOptions = Field(
        default_factory=LoraOptions, description="LoRA parameters (lora and qlora)."
    )
    qlora: QLoraOptions = Field(default_factory=QLoraOptions, description="QLoRA quantization.")
    ia3: IA3Options = Field(default_factory=IA3Options, description="(IA)^3 targets.")
    virtual_tokens: VirtualTokenOptions = Field(
        default_factory=VirtualTokenOptions, description="Prompt and prefix tuning."
    )
    adapter: BottleneckOptions = Field(
        default_factory=BottleneckOptions, description="Bottleneck adapter size."
    )
    precision: Literal["auto", "fp32", "bf16", "fp16", "fp8"] = Field(
        default="auto",
        description="'auto': the workers choose at start what their device computes "
        "natively: bf16 on GPUs of compute capability 8.0+ and on CPUs with AMX or "
        "AVX512-BF16, fp16 on older GPUs, fp32 elsewhere (the first training event says "
        "which, and why). fp32; bf16 autocast (fp32 master weights and optimizer states; "
        "a frozen base is stored in bf16); fp16 autocast with dynamic loss scaling; fp8 "
        "(GPUs of compute capability 8.9+ only).",
    )
    optimizer: Literal["adamw", "adamw_8bit", "paged_adamw_8bit"] = Field(
        default="adamw",
        description="AdamW (fused or foreach), bitsandbytes' 8-bit AdamW, or its paged "
        "variant (GPUs only).",
    )
    max_seq_len: int = Field(
        default=512, ge=8, le=1_048_576, description="Tokens per example; longer are truncated."
    )
    compile: bool = Field(
        default=False,
        description="torch.compile the model (inductor, dynamic shapes): faster steps once "
        "compiled, the first ones slower while it compiles.",
    )
    merged_model: bool = Field(
        default=False,
        description="Also store the base with the training merged in, as a transformers "
        "model in safetensors with its tokenizer (artifacts merged/{job}): LoRA and IA3 "
        "through merge_and_unload, QLoRA into the de-quantized 4-bit base it trained on, "
        "full fine-tuning and BitFit as the base with the trained tensors.",
    )
    rope_scaling: RopeScaling | None = Field(
        default=None,
        description="RoPE scaling set on the model's config before training (long context); "
        "attention is SDPA.",
    )
    packing: bool = Field(
        default=False,
        description="Pack several examples into each row of max_seq_len tokens; documents "
        "never attend to each other and positions restart in each.",
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
        "the global batch_size. None: the largest the memory planner fits, which the "
        "workers then probe on their device (see probe_micro_batch).",
    )
    probe_micro_batch: bool = Field(
        default=False,
        description="Set when the planner chose micro_batch_size: before training, the "
        "workers run one step at it, halve it while it runs out of memory (on CPU "
        "workers: while the step's peak exceeds the device memory the plan was made for), "
        "double it while it fits up to their share of batch_size, and train at the "
        "largest that ran.",
    )
    strategy: Strategy | Literal["auto"] = Field(
        default="auto",
        description="ddp, zero2 or zero3 (FSDP2 sharding per decoder layer), "
        "zero3_offload (shards in host memory; GPU workers); 'auto' follows the memory "
        "planner's chart (DDP, DDP + gradient checkpointing, ZeRO-3, ZeRO-3 + offload).",
    )
    resources: Resources = Field(default_factory=Resources, description="Cluster resources.")
    init_from_job: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        validation_alias=AliasChoices("init_from_job", "init_from_adapter"),
        description="Start from the trained weights of this succeeded job of the tenant "
        "(same model and method), e.g. preference tuning (DPO) a supervised job's adapter; "
        "its job id or fine_tuned_model name, or an imported adapter's model name "
        "(``init_from_adapter`` is the same field). Shape options not given are the "
        "source's.",
    )
    priority: int = Field(default=0, ge=-100, le=100, description="Higher runs first.")

    @property
    def run_strategy(self) -> Strategy:
        """The strategy a run applies: an ``auto`` the planner did not settle (a job made
        without a plan) runs DDP."""
        return "ddp" if self.strategy == "auto" else self.strategy

    @property
    def run_checkpointing(self) -> bool:
        """Whether a run recomputes activations: an ``auto`` the planner did not settle
        runs without."""
        return self.gradient_checkpointing is True

    @model_validator(mode="after")
    def _hardware(self) -> TuneFleetOptions:
        """Options that need a GPU are refused for CPU workers, as are strategies the method
        cannot use, naming the option."""
        opts = self
        if opts.resources.gpus_per_worker == 0:
            if opts.precision == "fp8":
                raise ValueError(
                    "tunefleet.precision 'fp8' needs GPUs of compute capability 8.9 or "
                    "newer (Hopper, Ada); this job asks for CPU workers "
                    "(resources.gpus_per_worker = 0): use 'bf16'"
                )
            if opts.strategy == "zero3_offload":
                raise ValueError(
                    "tunefleet.strategy 'zero3_offload' moves parameter shards from GPU to "
                    "host memory and needs GPU workers (resources.gpus_per_worker > 0); CPU "
                    "workers already hold them in host memory: use 'zero3'"
                )
            if opts.optimizer == "paged_adamw_8bit":
                raise ValueError(
                    "tunefleet.optimizer 'paged_adamw_8bit' pages optimizer states through "
                    "CUDA unified memory and needs GPU workers; use 'adamw_8bit' on CPU"
                )
        if opts.merged_model and opts.method in ("prefix_tuning", "prompt_tuning", "adapter"):
            raise ValueError(
                f"tunefleet.merged_model: {opts.method} cannot be merged into the base's "
                "weights (it adds tokens or modules the base lacks); leave merged_model off"
            )
        if opts.packing and opts.method in ("prefix_tuning", "prompt_tuning"):
            raise ValueError(
                f"tunefleet.packing: {opts.method} puts its virtual tokens before each "
                "sequence, and documents packed into one row would share them: leave "
                "packing off"
            )
        if opts.strategy in ("zero2", "zero3", "zero3_offload") and opts.method in (
            "prefix_tuning",
            "prompt_tuning",
        ):
            raise ValueError(
                f"tunefleet.strategy {opts.strategy!r} shards decoder layers, and "
                f"{opts.method} trains only its virtual tokens (a few thousand parameters "
                "outside them): use 'ddp'"
            )
        return self


class Hyperparameters(_Frozen):
    """OpenAI's supervised hyperparameters with every ``"auto"`` already resolved."""

    n_epochs: int = Field(ge=1, le=50)
    batch_size: int = Field(ge=1, le=4096)
    learning_rate_multiplier: float = Field(gt=0, le=100)


# What a job trains for: OpenAI's ``method.type``. ``supervised``: the next tokens of its
# examples; ``dpo``: Direct Preference Optimization (Rafailov et al., 2023) on pairs of a
# preferred and a non-preferred answer.
Objective = Literal["supervised", "dpo"]
# Methods DPO trains: their reference model is the model the run starts from. Prefix and
# prompt tuning start from random virtual tokens, not from the base.
DPO_METHODS = ("lora", "qlora", "full", "ia3", "bitfit", "adapter")


def dpo_problem(opts: TuneFleetOptions) -> tuple[str, str] | None:
    """The option of ``opts`` a DPO job cannot have, and why (None: none)."""
    if opts.method not in DPO_METHODS:
        return "tunefleet.method", (
            f"tunefleet.method {opts.method!r} cannot be preference tuned: its virtual "
            "tokens start random, so the model it starts from is not the base DPO compares "
            f"against; use one of {', '.join(DPO_METHODS)}"
        )
    if opts.packing:
        return "tunefleet.packing", (
            "tunefleet.packing: a DPO job compares each pair's answers as whole sequences "
            "and is not packed; leave packing off"
        )
    return None


class DpoOptions(_Frozen):
    """DPO's knobs, settled. ``reference`` is how the run gets the reference model's
    log-probabilities: ``adapter_disabled`` runs the base with the adapter switched off
    (LoRA, QLoRA, (IA)^3: no second copy in memory); ``precomputed`` scores every pair
    once before the first step, with the model the run starts from (full fine-tuning,
    BitFit, bottleneck adapters, and any job that starts from another job's weights)."""

    beta: float = Field(
        default=0.1,
        gt=0,
        le=10,
        description="How far the policy may move from the reference (DPO's beta): lower "
        "follows the preferences more strongly.",
    )
    reference: Literal["adapter_disabled", "precomputed"] = Field(
        description="Where the reference log-probabilities come from."
    )


class WandbOptions(_Frozen):
    """OpenAI's ``wandb`` integration: the Weights & Biases run that gets the job's config
    and metrics. Credentials (``WANDB_API_KEY``) come from the environment of the nodes
    runs train on; ``WANDB_MODE``, ``WANDB_DIR`` and ``WANDB_BASE_URL`` from the
    controller's (see docs/api.md)."""

    project: str = Field(min_length=1, max_length=128, description="The W&B project.")
    name: str | None = Field(
        default=None, max_length=128, description="The run's display name (default the job id)."
    )
    entity: str | None = Field(
        default=None, max_length=128, description="Team or user (default the key's own)."
    )
    tags: tuple[str, ...] = Field(
        default=(), max_length=20, description="Up to 20 tags of at most 64 characters."
    )

    @field_validator("tags")
    @classmethod
    def _tags(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for tag in v:
            if not 1 <= len(tag) <= 64:
                raise ValueError(f"wandb tag {tag[:70]!r} must be 1-64 characters")
        return v


class MlflowOptions(_Frozen):
    """TuneFleet's MLflow integration (not OpenAI's): the MLflow run that gets the job's
    config and metrics, found again by its ``tunefleet.job_id`` tag when the job resumes."""

    tracking_uri: str | None = Field(
        default=None,
        max_length=1024,
        description="An http(s):// tracking server, at a public address or one the operator "
        "allows (TUNEFLEET_OUTBOUND_ALLOW). Default the operator's MLFLOW_TRACKING_URI, "
        "which may be any MLflow store.",
    )
    experiment_name: str = Field(
        default="tunefleet", min_length=1, max_length=256, description="Created if missing."
    )
    run_name: str | None = Field(
        default=None, max_length=256, description="The run's name (default the job id)."
    )

    @field_validator("tracking_uri")
    @classmethod
    def _tracking_uri(cls, v: str | None) -> str | None:
        # a tenant's: a server over http(s) only, never a local store (sqlite:///, file://
        # open or create files wherever the worker may write) nor a scheme whose
        # credentials are the operator's (databricks); where it points is checked against
        # the outbound policy when the job is created and at each connection
        if v is not None:
            parts = urlsplit(v)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(
                    f"mlflow tracking_uri {v[:200]!r} is not an http(s) tracking server; give "
                    "one such as https://mlflow.example.com, or leave it out for the "
                    "operator's"
                )
        return v


@dataclass(frozen=True)
class TrackingSpaces:
    """Where each tenant's integrations write in the operator's tracking accounts, as
    templates (``Settings.mlflow_experiment_template``, ``wandb_entity_template``,
    ``wandb_project_template``) of ``{tenant}`` (the tenant's name) and the name the job
    gave. A tenant picks names inside its own space only: the job's spec holds the placed
    names, its ``integrations`` what the tenant sent."""

    mlflow_experiment: str = "{tenant}/{experiment}"
    wandb_entity: str = ""  # empty: the W&B key's default entity
    wandb_project: str = "{tenant}-{project}"

    def place(self, integration: Integration, tenant: str) -> Integration:
        """``integration`` with its names inside ``tenant``'s space; a W&B ``entity``
        other than the operator's is refused (``ValueError``, naming it)."""
        if integration.mlflow is not None and integration.mlflow.tracking_uri is None:
            # the operator's server: its experiments are shared by every tenant (a
            # tenant's own server is its own space)
            experiment = self.mlflow_experiment.format(
                tenant=tenant, experiment=integration.mlflow.experiment_name
            )
            mlflow = integration.mlflow.model_copy(update={"experiment_name": experiment})
            return integration.model_copy(update={"mlflow": mlflow})
        if integration.wandb is not None:
            entity = self.wandb_entity.format(tenant=tenant) or None
            given = integration.wandb.entity
            if given is not None and given != entity:
                raise ValueError(
                    f"wandb entity {given!r} is not this tenant's: the operator sets it "
                    f"({entity!r} here, TUNEFLEET_WANDB_ENTITY_TEMPLATE); leave entity out"
                    if entity
                    else f"wandb entity {given!r} is not this tenant's: runs go to the "
                    "operator's W&B account; leave entity out"
                )
            project = self.wandb_project.format(tenant=tenant, project=integration.wandb.project)
            wandb = integration.wandb.model_copy(update={"entity": entity, "project": project})
            return integration.model_copy(update={"wandb": wandb})
        return integration


# What the controller's environment tells runs about the integrations' destinations (never
# their credentials: Ray shows a run's environment; WANDB_API_KEY and the like belong in
# the environment of the nodes runs train on).
INTEGRATION_ENV = (
    "WANDB_MODE",
    "WANDB_DIR",
    "WANDB_BASE_URL",
    "MLFLOW_TRACKING_URI",
    "MLFLOW_ALLOW_FILE_STORE",
)


class Integration(_Frozen):
    """Where else a job reports: ``{"type": "wandb", "wandb": {...}}`` (OpenAI's) or
    ``{"type": "mlflow", "mlflow": {...}}``. A failing integration never fails its job: it
    is dropped for the rest of the run with a warning event."""

    type: Literal["wandb", "mlflow"]
    wandb: WandbOptions | None = None
    mlflow: MlflowOptions | None = None

    @model_validator(mode="after")
    def _one_object(self) -> Integration:
        given = [k for k in ("wandb", "mlflow") if getattr(self, k) is not None]
        if given != [self.type]:
            raise ValueError(
                f"an integration of type {self.type!r} takes a {self.type!r} object and no "
                f"other (got {given or 'none'}), e.g. "
                + (
                    '{"type": "wandb", "wandb": {"project": "my-project"}}'
                    if self.type == "wandb"
                    else '{"type": "mlflow", "mlflow": {"experiment_name": "tunefleet"}}'
                )
            )
        return self


class JobSpec(_Frozen):
    """Everything a run needs to train, and nothing it must look up elsewhere."""

    version: Literal[1] = Field(default=SPEC_VERSION, description="Spec schema version.")
    job_id: str = Field(description="The job this spec belongs to.")
    tenant_id: str = Field(description="Owning tenant.")
    model: str = Field(description="Base model name in the model registry.")
    training_file: str = Field(description="File id of the training data.")
    validation_file: str | None = Field(default=None, description="File id for evaluation.")
    hyperparameters: Hyperparameters
    base_learning_rate: float | None = Field(
        default=None,
        gt=0,
        description="The learning rate a multiplier of 1.0 means (``defaults.base_learning_"
        "rate``); None in specs stored before it: the method's ``BASE_LEARNING_RATE``.",
    )
    seed: int = Field(ge=0, le=2**31 - 1, description="Seed for shuffling and initialisation.")
    suffix: str | None = Field(default=None, description="User suffix in fine_tuned_model.")
    tunefleet: TuneFleetOptions = Field(default_factory=TuneFleetOptions)
    integrations: tuple[Integration, ...] = Field(
        default=(), max_length=5, description="Where else the job reports its metrics."
    )
    objective: Objective = Field(
        default="supervised", description="OpenAI's method.type: supervised or dpo."
    )
    dpo: DpoOptions | None = Field(default=None, description="DPO's settings (dpo jobs).")

    @model_validator(mode="after")
    def _objective(self) -> JobSpec:
        """A DPO job has its settings, trains a method DPO can, and is not packed."""
        opts = self.tunefleet
        if (self.objective == "dpo") != (self.dpo is not None):
            raise ValueError("dpo settings go with objective 'dpo', and only with it")
        if self.objective == "dpo" and (problem := dpo_problem(opts)):
            raise ValueError(problem[1])
        return self

    @property
    def is_dpo(self) -> bool:
        return self.objective == "dpo"

    @property
    def learning_rate(self) -> float:
        base = self.base_learning_rate or BASE_LEARNING_RATE[self.tunefleet.method]
        return base * self.hyperparameters.learning_rate_multiplier


def fine_tuned_model_name(base: str, tenant_name: str, suffix: str | None, job_id: str) -> str:
    """OpenAI's naming: ``ft:{base}:{tenant}:{suffix}:{id}`` (empty suffix kept as '')."""
    return f"ft:{base}:{tenant_name}:{suffix or ''}:{job_id}"
