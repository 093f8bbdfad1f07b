"""The memory planner: how many bytes a fine-tune needs per device, before a GPU is spent.

The arithmetic of the seeds (shared/seeds): weights, gradients and optimizer states per
parameter by precision and method; what ZeRO stage 1/2/3 (FSDP) divides by the number of
workers; what CPU offload moves off the device; activations per decoder layer with and
without gradient checkpointing; the logits. Then the seeds' tuning path: fits -> DDP; fits
with checkpointing -> DDP + checkpointing; else FSDP ZeRO-3; else + CPU offload; else say
what would be needed.

Model shapes come from a Hugging Face config of a Llama-family decoder, whose layers have
the same seven projections: Llama, SmolLM2, Mistral, Qwen2 (biased q, k and v), Qwen3 and
Gemma 3 (a norm on each head's queries and keys), Gemma 2 and 3 (norms before and after
attention and the MLP: ``FAMILY_TRAITS``), Phi-3 (q, k and v in one ``qkv_proj``, gate and
up in one ``gate_up_proj``: ``FUSED_TYPES``; the same parameters, fewer modules). No
torch here: parameter counts are exact arithmetic over the shapes
(``tests/workers/test_model_registry.py`` holds them to real models of each).

Glossary: *trainable* parameters get gradients and optimizer states; *frozen* ones only
weights. *Mixed precision* (bf16/fp16) keeps working weights and gradients in 16 bits and
an fp32 master copy plus two fp32 moments in the optimizer: 2 + 2 + 4 + 4 + 4 = 16 bytes
per trained parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

import orjson
from pydantic import ValidationError

from tunefleet.platform.errors import InvalidRequest
from tunefleet.platform.spec import (
    JobSpec,
    Method,
    TuneFleetOptions,
    model_targets,
)
from tunefleet.platform.spec import Strategy as SpecStrategy

GiB = 1024**3

# The spec's vocabulary (methods, strategies), and where the planner says more: it plans
# fp8 as bf16, and it also counts ZeRO-1 (optimizer states sharded), a stage of the seeds'
# arithmetic that no run applies (the spec refuses it).
Precision = Literal["fp32", "bf16", "fp16"]
Strategy = SpecStrategy | Literal["zero1"]
Optimizer = Literal["adamw", "adamw_8bit"]

NF4_BLOCK = 64  # bitsandbytes 4-bit block size: one absmax constant per 64 weights
DQ_BLOCK = 256  # double quantization: absmaxes in 8 bits, one fp32 constant per 256 of them


# What sets an architecture's layers apart from Llama's, by the config's model_type:
# (q, k and v always biased, a norm on each head's queries and keys, norms per layer).
FAMILY_TRAITS: dict[str, tuple[bool, bool, int]] = {
    "qwen2": (True, False, 2),
    "qwen3": (False, True, 2),
    "gemma2": (False, False, 4),
    "gemma3_text": (False, True, 4),  # Gemma3ForCausalLM
}
# Model types whose layers fuse q, k and v into qkv_proj and gate and up into gate_up_proj.
FUSED_TYPES = {"phi3"}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-family decoder that memory depends on."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    qkv_bias: bool = False  # Qwen2: q, k and v have biases whatever attention_bias says
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm of head_dim on queries and keys
    norms_per_layer: int = 2  # Gemma 2 and 3: four
    fused: bool = False  # Phi-3: qkv_proj and gate_up_proj

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ModelShape:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        qkv_bias, qk_norm, norms = FAMILY_TRAITS.get(cfg.get("model_type", ""), (False, False, 2))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            norms_per_layer=norms,
            fused=cfg.get("model_type") in FUSED_TYPES,
        )

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear module of one decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.fused:
            return {"qkv_proj": (h, q + 2 * kv), "o_proj": (q, h),
                    "gate_up_proj": (h, 2 * i), "down_proj": (i, h)}  # fmt: skip
        return {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }  # fmt: skip

    @property
    def layer_linear_params(self) -> int:
        return sum(a * b for a, b in self.linear_shapes().values())

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def norm_params(self) -> int:
        qk = 2 * self.head_dim if self.qk_norm else 0
        return (self.norms_per_layer * self.num_layers + 1) * self.hidden_size + (
            self.num_layers * qk
        )

    @property
    def bias_params(self) -> int:
        """Bias terms of the projections (attention_bias, mlp_bias): what BitFit trains."""
        shapes = self.linear_shapes()
        attention = [n for n in shapes if n in ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")]
        biased = [n for n in attention if self.attention_bias or (self.qkv_bias and n != "o_proj")]
        biased += [n for n in shapes if n not in attention and self.mlp_bias]
        return self.num_layers * sum(shapes[n][1] for n in biased)

    @property
    def total_params(self) -> int:
        return (
            self.num_layers * self.layer_linear_params
            + self.bias_params
            + self.embedding_params
            + self.head_params
            + self.norm_params
        )


def resolve_targets(shape: ModelShape, targets: list[str]) -> list[str]:
    """peft's target names to the model's module names (``spec.model_targets``: on Phi-3
    q_proj is its qkv_proj); ``all-linear`` is every projection (not the output head, as
    peft does for causal LMs)."""
    modules = list(shape.linear_shapes())
    if targets == ["all-linear"]:
        return modules
    resolved = model_targets(targets, shape.fused)
    if unknown := [t for t in resolved if t not in modules]:  # build_spec refuses them
        raise ValueError(f"target_modules {unknown} are not among {modules}")
    return resolved


def lora_params(shape: ModelShape, r: int, targets: list[str]) -> int:
    """Parameters LoRA adds: r * (in + out) per targeted module per layer."""
    shapes = shape.linear_shapes()
    per_layer = sum(r * (shapes[t][0] + shapes[t][1]) for t in resolve_targets(shape, targets))
    return shape.num_layers * per_layer


@dataclass(frozen=True)
class PlanInput:
    """What memory depends on; built from a job spec by ``plan_input_from_spec``."""

    method: Method = "lora"
    lora_r: int = 8
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    precision: Precision = "bf16"
    optimizer: Optimizer = "adamw"
    gradient_checkpointing: bool = False
    strategy: Strategy = "ddp"
    num_workers: int = 1
    per_device_batch: int = 1
    seq_len: int = 512
    double_quant: bool = True
    ia3_targets: tuple[str, ...] = ("k_proj", "v_proj", "down_proj")
    ia3_feedforward: tuple[str, ...] = ("down_proj",)
    virtual_tokens: int = 16
    bottleneck: int = 64
    # DPO: a pair's two sequences go through the model together (2 per example; their
    # shared prompt once, which the plan does not count: an upper bound), and its
    # reference is the model with the adapter off or scores taken before the first step
    sequences_per_example: int = 1
    reference: Literal["none", "adapter_disabled", "precomputed"] = "none"


@dataclass
class Breakdown:
    """Bytes per device, by what holds them."""

    weights: float = 0
    gradients: float = 0
    optimizer: float = 0
    activations: float = 0
    logits: float = 0
    cpu_offloaded: float = 0
    notes: list[str] = field(default_factory=list)

    @property
    def states(self) -> float:
        """Weights + gradients + optimizer states: what does not scale with the batch."""
        return self.weights + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        return self.states + self.activations + self.logits

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "notes"}
        return {**out, "states": self.states, "total": self.total, "notes": list(self.notes)}


def _bytes(precision: Precision) -> int:
    return 4 if precision == "fp32" else 2


def parameter_counts(shape: ModelShape, inp: PlanInput) -> tuple[int, int]:
    """(trainable, total) as peft counts them: what a method adds is added to the total;
    full fine-tuning and BitFit train parameters the base already has."""
    if inp.method == "full":
        return shape.total_params, shape.total_params
    if inp.method == "bitfit":
        return shape.bias_params, shape.total_params
    shapes = shape.linear_shapes()
    if inp.method in ("lora", "qlora"):
        added = lora_params(shape, inp.lora_r, list(inp.lora_targets))
    elif inp.method == "ia3":  # a vector per target: its input width for feed-forward ones
        feedforward = model_targets(list(inp.ia3_feedforward), shape.fused)
        added = shape.num_layers * sum(
            shapes[t][0 if t in feedforward else 1]
            for t in resolve_targets(shape, list(inp.ia3_targets))
        )
    elif inp.method == "prefix_tuning":  # a key and a value per virtual token per layer
        kv = shape.num_kv_heads * shape.head_dim
        added = inp.virtual_tokens * shape.num_layers * 2 * kv
    elif inp.method == "prompt_tuning":  # one input embedding per virtual token
        added = inp.virtual_tokens * shape.hidden_size
    else:  # adapter: down (h x b + b) and up (b x h + h) after every block
        h, b = shape.hidden_size, inp.bottleneck
        added = shape.num_layers * (2 * h * b + b + h)
    return added, shape.total_params + added


def activation_bytes_per_layer(shape: ModelShape, inp: PlanInput) -> float:
    """Bytes one decoder layer saves for backward, per token, as autograd saves them
    (read op by op from the saved tensors of bench/planner_accuracy.py's cases).

    With SDPA (memory-efficient attention) no s x s score matrix is kept. Every method
    keeps, per layer: both RMSNorms' inputs and 1/rms in fp32 (the norm upcasts), q, k, v,
    the attention output and its log-sum-exp, the MLP's gate and up projections and
    SiLU(gate), in the compute precision. The rest depends on what trains:
    - a projection whose weight trains keeps its input: in fp32 the projections reading
      one tensor share it (q/k/v the first norm's output, gate/up the second's, o_proj the
      attention output, down_proj the MLP product); under autocast each keeps its own
      16-bit copy, except o_proj, whose input is 16-bit already;
    - norms whose weight trains keep their normalized input (fp32);
    - a LoRA adapter keeps its input the same way (peft casts it to the adapter's fp32,
      so under autocast every adapter holds its own copy, o_proj's too) and its low-rank
      intermediate (r);
    - IA3 keeps what it scales (k and v outputs, down_proj's input);
    - a bottleneck adapter keeps its input, down projection and GELU output.
    """
    h, i = shape.hidden_size, shape.intermediate_size
    kv = shape.num_kv_heads * shape.head_dim
    c = _bytes(inp.precision)
    mixed = c < 4
    modules = shape.linear_shapes()
    width = {n: (h if n != "down_proj" else i) for n in modules}  # each module's input
    saved = 2 * (h + 1) * 4 + (2 * h + 2 * kv + 3 * i) * c + shape.num_heads * 4
    if inp.method == "full":
        saved += 2 * h * 4  # the norms' normalized inputs
        inputs = [n for n in modules if n != "o_proj"] if mixed else []
        saved += sum(width[n] for n in inputs) * c if mixed else (2 * h + i) * 4
    elif inp.method in ("lora", "qlora"):
        targets = resolve_targets(shape, list(inp.lora_targets))
        if mixed:
            saved += sum(width[n] for n in targets) * c
        else:  # one tensor per group of projections reading the same input
            groups = {("q_proj", "k_proj", "v_proj", "qkv_proj"): h,
                      ("gate_proj", "up_proj", "gate_up_proj"): h, ("down_proj",): i}  # fmt: skip
            saved += sum(w * 4 for g, w in groups.items() if set(g) & set(targets))
        saved += inp.lora_r * len(targets) * c
    elif inp.method == "ia3":
        feedforward = model_targets(list(inp.ia3_feedforward), shape.fused)
        outputs = {"k_proj": kv, "v_proj": kv, "qkv_proj": modules.get("qkv_proj", (0, 0))[1]}
        for n in resolve_targets(shape, list(inp.ia3_targets)):
            out = {**outputs, "down_proj": h}.get(n, width[n])
            saved += (width[n] if n in feedforward else out) * c
    elif inp.method == "adapter":
        saved += (h + 2 * inp.bottleneck) * 4
    return saved


def autocast_weight_copies(shape: ModelShape, inp: PlanInput) -> float:
    """Bytes of the 16-bit copies autocast makes of fp32 weights that train (full
    fine-tuning in bf16/fp16), kept for backward: every decoder layer's projections (one
    layer's when checkpointed, as each is recomputed) and the output head."""
    if inp.method != "full" or _bytes(inp.precision) == 4:
        return 0
    layers = 1 if inp.gradient_checkpointing else shape.num_layers
    return (layers * shape.layer_linear_params + shape.head_params) * _bytes(inp.precision)


def plan_memory(shape: ModelShape, inp: PlanInput) -> Breakdown:
    """Per-device bytes for ``inp`` on a model of ``shape``."""
    b = Breakdown()
    n = max(1, inp.num_workers)
    wbytes = _bytes(inp.precision)
    mixed = inp.precision != "fp32"
    trainable, _ = parameter_counts(shape, inp)

    # Weights: frozen base (maybe 4-bit) plus trainable parameters.
    if inp.method in ("full", "bitfit"):
        b.weights = shape.total_params * wbytes
    elif inp.method != "qlora":  # a frozen base and what the method adds
        b.weights = shape.total_params * wbytes + trainable * wbytes
    else:  # qlora: decoder linears in NF4 with their constants; the rest in fp32
        quantized = shape.num_layers * shape.layer_linear_params
        per_param = 0.5 + (
            (1 / NF4_BLOCK + 4 / (NF4_BLOCK * DQ_BLOCK)) if inp.double_quant else 4 / NF4_BLOCK
        )
        # peft's prepare_model_for_kbit_training casts every weight it did not quantize
        # (embeddings, norms, head) to fp32 for stable training (measured by
        # bench/planner_accuracy.py)
        b.weights = quantized * per_param + (shape.total_params - quantized) * 4
        b.weights += trainable * wbytes
        b.notes.append(
            f"NF4 base: {per_param:.4f} bytes per quantized weight "
            f"({'with' if inp.double_quant else 'without'} double quantization); "
            "embeddings, norms and head in fp32"
        )

    # Gradients and optimizer states exist for trainable parameters only.
    b.gradients = trainable * wbytes
    moments = 2 * (1 if inp.optimizer == "adamw_8bit" else 4)
    master = 4 if mixed else 0
    b.optimizer = trainable * (moments + master)

    # ZeRO / FSDP: shard what the stage shards; offload moves optimizer and weights out.
    if inp.strategy in ("zero1", "zero2", "zero3", "zero3_offload"):
        b.optimizer /= n
    if inp.strategy in ("zero2", "zero3", "zero3_offload"):
        b.gradients /= n
    if inp.strategy in ("zero3", "zero3_offload"):
        b.weights /= n
    if inp.strategy == "zero3_offload":
        b.cpu_offloaded = b.optimizer + b.weights + b.gradients
        b.optimizer = 0
        # one decoder layer's weights and gradients are on the device at a time
        b.weights = shape.layer_linear_params * wbytes
        b.gradients = shape.layer_linear_params * wbytes if inp.method == "full" else 0
        b.notes.append(
            "CPU offload: sharded weights, gradients and optimizer states live in host memory"
        )

    # Activations: every layer keeps its saved tensors, or only its input when
    # checkpointed (plus one layer recomputed during backward).
    tokens = inp.per_device_batch * inp.seq_len * inp.sequences_per_example
    per_layer = activation_bytes_per_layer(shape, inp) * tokens
    # the residual stream is in the weights' dtype: fp32 master weights or a 16-bit base
    layer_input = shape.hidden_size * (4 if inp.method == "full" else wbytes) * tokens
    if inp.gradient_checkpointing:
        b.activations = shape.num_layers * layer_input + per_layer
    else:
        b.activations = shape.num_layers * per_layer + layer_input
    b.activations += autocast_weight_copies(shape, inp)
    # Logits in the compute dtype, their fp32 copy for the loss, and its gradient.
    b.logits = tokens * shape.vocab_size * (wbytes + 4 + 4)
    if inp.sequences_per_example > 1:
        b.notes.append(
            f"DPO: each pair's {inp.sequences_per_example} sequences in one forward pass, "
            f"planned at {tokens:,} tokens for {inp.per_device_batch} pairs (a pair's row "
            "holds its prompt once, so fewer)"
        )
    if inp.reference == "adapter_disabled":
        b.notes.append(
            "DPO reference: the base with the adapter switched off, no second copy of the "
            "weights (its forward keeps no activations)"
        )
    elif inp.reference == "precomputed":
        b.notes.append(
            "DPO reference: log-probabilities precomputed once before the first step (one "
            "forward pass over the data; 16 bytes per pair, kept in checkpoints), no frozen "
            "copy of the weights"
        )
    return b


@dataclass
class Advice:
    strategy: Strategy
    gradient_checkpointing: bool
    fits: bool
    per_device_batch: int
    gradient_accumulation_steps: int
    breakdown: Breakdown
    reasons: list[str]

    def as_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "gradient_checkpointing": self.gradient_checkpointing,
            "fits": self.fits,
            "per_device_batch": self.per_device_batch,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "breakdown": self.breakdown.as_dict(),
            "reasons": self.reasons,
        }


# The share of a device a plan may fill: the rest is for allocator fragmentation and
# communication buffers.
HEADROOM = 0.9
# The seeds' step-by-step chart: each step trades speed for memory.
CHART: tuple[tuple[Strategy, bool], ...] = (
    ("ddp", False),
    ("ddp", True),
    ("zero3", True),
    ("zero3_offload", True),
)


def chart(
    shape: ModelShape,
    inp: PlanInput,
    device_bytes: float,
    *,
    host_bytes: float = 256 * GiB,
    headroom: float = HEADROOM,
) -> list[dict[str, Any]]:
    """Every step of the seeds' chart for ``inp`` at its own per-device batch: what each
    would need per device, and whether it fits ``headroom`` of the device (and, offloading,
    of the host)."""
    steps = []
    for strategy, ckpt in CHART:
        b = plan_memory(shape, replace(inp, strategy=strategy, gradient_checkpointing=ckpt))
        fits = b.total <= device_bytes * headroom and b.cpu_offloaded <= host_bytes * headroom
        steps.append(
            {
                "strategy": strategy,
                "gradient_checkpointing": ckpt,
                "breakdown": b.as_dict(),
                "fits": fits,
            }
        )
    return steps


def fmt_bytes(nbytes: float) -> str:
    if nbytes >= GiB:
        return f"{nbytes / GiB:.2f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"


def advise(
    shape: ModelShape,
    inp: PlanInput,
    device_bytes: float,
    *,
    global_batch: int,
    host_bytes: float = 256 * GiB,
    headroom: float = HEADROOM,
    strategy: Strategy | None = None,
) -> Advice:
    """Walk the seeds' chart for a device of ``device_bytes`` (using ``headroom`` of it
    for the plan, the rest for allocator fragmentation and communication buffers); CPU
    offload must also fit in ``host_bytes`` of host memory per worker. A given
    ``strategy`` is kept: only gradient checkpointing and the batch are chosen."""
    budget = device_bytes * headroom
    reasons = [f"budget {fmt_bytes(budget)} of {fmt_bytes(device_bytes)} per device"]
    path = list(CHART) if strategy is None else [(strategy, False), (strategy, True)]
    for step, ckpt in path:
        if step == "zero3" and inp.num_workers == 1 and strategy is None:
            continue  # shards nothing on one worker
        trial = replace(inp, strategy=step, gradient_checkpointing=ckpt, per_device_batch=1)
        one = plan_memory(shape, trial)
        label = step + (" + gradient checkpointing" if ckpt else "")
        if one.total > budget:
            reasons.append(f"{label}: {fmt_bytes(one.total)} at batch 1 does not fit")
            continue
        if one.cpu_offloaded > host_bytes * headroom:
            reasons.append(
                f"{label}: fits the device but offloads {fmt_bytes(one.cpu_offloaded)} to host "
                f"memory, more than {fmt_bytes(host_bytes * headroom)} available"
            )
            continue
        # Largest per-device batch that fits: the plan grows linearly with the batch.
        per_sample = plan_memory(shape, replace(trial, per_device_batch=2)).total - one.total
        fixed = one.total - per_sample
        batch = max(1, int((budget - fixed) // per_sample)) if per_sample else global_batch
        batch = min(batch, max(1, math.ceil(global_batch / trial.num_workers)))
        accum = max(1, math.ceil(global_batch / (batch * trial.num_workers)))
        final = plan_memory(shape, replace(trial, per_device_batch=batch))
        reasons.append(
            f"{label}: {fmt_bytes(final.total)} at per-device batch {batch} fits; "
            f"{accum} accumulation step(s) reach the global batch {global_batch}"
        )
        return Advice(step, ckpt, True, batch, accum, final, reasons)
    # Nothing fits: say what would.
    base = replace(inp, gradient_checkpointing=True, per_device_batch=1)
    floor = plan_memory(shape, replace(base, strategy="zero3_offload"))
    whole = plan_memory(shape, replace(base, strategy="zero3", num_workers=1))
    need_workers = math.ceil(whole.states / max(budget - floor.activations - floor.logits, 1))
    reasons.append(
        f"nothing fits: weights, gradients and optimizer states take {fmt_bytes(whole.states)} in "
        f"all; with CPU offload a device needs {fmt_bytes(floor.total)} plus "
        f"{fmt_bytes(floor.cpu_offloaded)} of host memory, at batch 1"
    )
    suggestions = [
        f"host memory of at least {fmt_bytes(floor.cpu_offloaded / headroom)} for CPU offload"
    ]
    if inp.method == "full":
        suggestions.append("LoRA or QLoRA instead of full fine-tuning")
    elif inp.method == "lora":
        suggestions.append("QLoRA (a 4-bit base)")
    suggestions.append(f"ZeRO-3 over at least {need_workers} such devices")
    suggestions.append(f"a shorter max_seq_len than {inp.seq_len}")
    reasons.append("would fit with: " + "; or ".join(suggestions))
    return Advice("zero3_offload", True, False, 1, global_batch, floor, reasons)


@dataclass(frozen=True)
class PlanDevice:
    """The hardware a plan is for: accelerator and host memory per worker."""

    memory_bytes: float
    host_bytes: float

    @classmethod
    def from_gb(cls, memory_gb: float, host_memory_gb: float) -> PlanDevice:
        return cls(memory_gb * GiB, host_memory_gb * GiB)


def plan_input_from_spec(spec: JobSpec, shape: ModelShape) -> PlanInput:
    """What the training loop will really run for ``spec`` on a model of ``shape``: its
    method and strategy (DDP while it is still ``auto``) across workers, examples up to
    max_seq_len long, the micro-batch the spec sets (or the global batch split evenly).
    fp8 is planned as bf16. Precision ``auto`` is the workers' choice at start (``auto
    precision`` in docs/training.md): GPU workers choose bf16 or fp16 (the same bytes);
    CPU workers bf16 or fp32, by their CPU, which the API cannot see, so it is planned as
    whichever of the two needs more memory."""
    opts = spec.tunefleet
    workers = opts.resources.num_workers
    micro = opts.micro_batch_size or max(1, math.ceil(spec.hyperparameters.batch_size / workers))
    inp = PlanInput(
        method=opts.method,
        lora_r=opts.lora.r,
        lora_targets=tuple(opts.lora.target_modules),
        optimizer="adamw" if opts.optimizer == "adamw" else "adamw_8bit",
        strategy=opts.run_strategy,
        gradient_checkpointing=opts.run_checkpointing,
        num_workers=workers,
        per_device_batch=micro,
        seq_len=opts.max_seq_len,
        double_quant=opts.qlora.double_quant,
        ia3_targets=tuple(opts.ia3.target_modules),
        ia3_feedforward=tuple(opts.ia3.feedforward_modules),
        virtual_tokens=opts.virtual_tokens.num_virtual_tokens,
        bottleneck=opts.adapter.bottleneck,
        sequences_per_example=2 if spec.dpo else 1,
        reference=spec.dpo.reference if spec.dpo else "none",
    )
    if opts.precision in ("bf16", "fp16", "fp32"):
        return replace(inp, precision=opts.precision)
    if opts.precision == "fp8" or opts.resources.gpus_per_worker > 0:
        return replace(inp, precision="bf16")
    fp32, bf16 = replace(inp, precision="fp32"), replace(inp, precision="bf16")
    return fp32 if plan_memory(shape, fp32).total >= plan_memory(shape, bf16).total else bf16


# Methods that train only virtual tokens outside the decoder layers FSDP shards: DDP only
# (the spec refuses ZeRO strategies for them).
UNSHARDABLE_METHODS = ("prefix_tuning", "prompt_tuning")

# Resolved options and plans by everything they depend on: most jobs repeat a few
# configurations, and job creation (the API's hottest write) plans every job.
_RESOLVED: dict[tuple[Any, ...], tuple[TuneFleetOptions, bytes]] = {}
_RESOLVED_MAX = 1024


def resolve_spec(
    config: dict[str, Any], spec: JobSpec, *, device_bytes: float, host_bytes: float
) -> tuple[JobSpec, dict[str, Any]]:
    """Settle the spec's ``auto`` memory settings with the planner (the seeds' chart) and
    return the concrete spec with its plan. Raises ``InvalidRequest`` naming what would be
    needed when the job cannot fit the device, or needs a strategy the loop lacks.
    Each call gets a plan of its own (the cache keeps it encoded)."""
    key = (
        orjson.dumps(config, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS),
        spec.model,
        spec.tunefleet.model_dump_json(),
        spec.hyperparameters.batch_size,
        device_bytes,
        host_bytes,
        "probe_micro_batch" in spec.tunefleet.model_fields_set,
        spec.dpo.reference if spec.dpo else None,
    )
    hit = _RESOLVED.get(key)
    if hit is None:
        resolved = _resolve_spec(config, spec, device_bytes=device_bytes, host_bytes=host_bytes)
        hit = (resolved[0].tunefleet, orjson.dumps(resolved[1]))
        if len(_RESOLVED) >= _RESOLVED_MAX:
            _RESOLVED.clear()
        _RESOLVED[key] = hit
    # hit[0] (frozen) was validated by _resolve_spec: copying it in keeps the spec valid
    return spec.model_copy(update={"tunefleet": hit[0]}), orjson.loads(hit[1])


def _resolve_spec(
    config: dict[str, Any], spec: JobSpec, *, device_bytes: float, host_bytes: float
) -> tuple[JobSpec, dict[str, Any]]:
    opts = spec.tunefleet
    strategy: Strategy | None = None if opts.strategy == "auto" else opts.strategy
    if strategy is None and opts.method in UNSHARDABLE_METHODS:
        strategy = "ddp"  # the chart may not step up to ZeRO for these
    shape = ModelShape.from_config(config)
    advice = advise(
        shape, plan_input_from_spec(spec, shape), device_bytes,
        global_batch=spec.hyperparameters.batch_size, host_bytes=host_bytes,
        strategy=strategy,
    )  # fmt: skip
    cpu_workers = opts.resources.gpus_per_worker == 0
    if not advice.fits or (advice.strategy == "zero3_offload" and cpu_workers):
        why = "does not fit" if not advice.fits else "needs zero3_offload (GPU workers)"
        raise InvalidRequest(
            f"job {why} on workers with {fmt_bytes(device_bytes)} each: "
            + "; ".join(advice.reasons[1:]),
            param="tunefleet",
            code="does_not_fit",
        )
    ckpt = (
        advice.gradient_checkpointing
        if opts.gradient_checkpointing == "auto"
        else (opts.gradient_checkpointing)
    )
    micro = opts.micro_batch_size or advice.per_device_batch
    settled = {
        "gradient_checkpointing": ckpt,
        "micro_batch_size": micro,
        # probe what the planner chose, unless the job said whether to probe
        "probe_micro_batch": opts.probe_micro_batch
        if "probe_micro_batch" in opts.model_fields_set
        else opts.micro_batch_size is None,
        "strategy": advice.strategy,
    }
    try:  # validated, not model_copy'd: what is stored is what the spec accepts
        resolved = JobSpec.model_validate(
            {**spec.model_dump(), "tunefleet": {**opts.model_dump(), **settled}}
        )
    except ValidationError as exc:
        raise RuntimeError(
            f"the planner settled {settled}, which the job spec refuses: {exc}"
        ) from exc
    return resolved, plan_for_spec(
        config, resolved, device_bytes=device_bytes, host_bytes=host_bytes
    )


def plan_for_spec(
    config: dict[str, Any], spec: JobSpec, *, device_bytes: float, host_bytes: float
) -> dict[str, Any]:
    """The plan stored on a job and returned by POST /v1/plans: the breakdown of what
    the spec runs, and the chart's advice for the device."""
    shape = ModelShape.from_config(config)
    inp = plan_input_from_spec(spec, shape)
    trainable, total = parameter_counts(shape, inp)
    advice = advise(
        shape,
        inp,
        device_bytes,
        global_batch=spec.hyperparameters.batch_size,
        host_bytes=host_bytes,
    )
    return {
        "object": "fine_tuning.plan",
        "model": spec.model,
        "parameters": {
            "trainable": trainable,
            "total": total,
            "trainable_percent": round(100 * trainable / total, 4),
        },
        "input": {f.name: getattr(inp, f.name) for f in fields(inp)},
        "breakdown": plan_memory(shape, inp).as_dict(),
        "device": {"memory_bytes": device_bytes, "host_memory_bytes": host_bytes},
        "advice": advice.as_dict(),
    }


def chart_of_plan(config: dict[str, Any], plan: dict[str, Any]) -> list[dict[str, Any]]:
    """``chart`` for a plan ``plan_for_spec`` made (a job's stored plan, say) on the model
    of ``config``, for the same device."""
    stored: dict[str, Any] = {
        k: tuple(v) if isinstance(v, list) else v for k, v in plan["input"].items()
    }
    inp = PlanInput(**stored)
    device = plan["device"]
    return chart(
        ModelShape.from_config(config),
        inp,
        device["memory_bytes"],
        host_bytes=device["host_memory_bytes"],
    )
