"""Tiny random models (Llama and the other supported architectures) and a small
tokenizer, built on the fly for tests (no hub)."""

from __future__ import annotations

import string
from pathlib import Path

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(folder: Path) -> None:
    """A byte-level BPE over a small corpus, with ChatML special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        " ".join(string.ascii_lowercase),
        "user assistant system the a an is of to and in what color name number",
        "red green blue yellow apple banana cherry one two three four five six seven",
    ] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = CHATML
    fast.save_pretrained(folder)


HIDDEN = 64  # the tiny models' width


def multiplier_for(rate: float, method: str = "lora", objective: str = "supervised") -> float:
    """The ``learning_rate_multiplier`` that trains a tiny model at ``rate`` with
    ``method`` for ``objective``: a multiplier scales a base rate that follows the model's
    width (``platform/_defaults.py``), so a test that needs a given rate names the rate."""
    from tunefleet.platform._defaults import base_learning_rate

    return rate / base_learning_rate(method, {"hidden_size": HIDDEN}, objective)[0]


def build_tiny_llama(
    folder: Path, *, seed: int = 0, layers: int = 2, hidden: int = HIDDEN, bias: bool = False
) -> Path:
    """Write a random Llama (safetensors) and the tokenizer into ``folder``; ``bias``:
    biases on every projection, for BitFit."""
    return build_tiny_model(
        folder, "llama", seed=seed, layers=layers, hidden=hidden, attention_bias=bias, mlp_bias=bias
    )


def build_tiny_model(
    folder: Path,
    model_type: str,
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = HIDDEN,
    shard_size: str | None = None,
    **config: object,
) -> Path:
    """Write a random causal LM of transformers' ``model_type`` (``llama``, ``qwen2``,
    ``gemma3_text``, ...) in safetensors, with the tokenizer, into ``folder``: 4 query and
    2 key/value heads of ``hidden / 4``, an MLP twice as wide; ``config`` overrides;
    ``shard_size`` (e.g. "100KB"): saved in shards of that size, as large models are."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    settings = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
        # Larger than the usual 0.02 so a frozen random head can still express a confident
        # next token: LoRA on the body then learns a synthetic task in a few steps.
        "initializer_range": 0.2,
        **config,
    }
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **settings))
    if shard_size is None:
        model.save_pretrained(folder, safe_serialization=True)
    else:
        model.save_pretrained(folder, safe_serialization=True, max_shard_size=shard_size)
    return folder


def save_random_lora(
    base: object,
    folder: Path,
    *,
    r: int = 4,
    alpha: int = 8,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    seed: int = 0,
    std: float = 0.5,
    use_rslora: bool = False,
) -> Path:
    """Save a peft LoRA adapter for ``base`` (a transformers model, left unchanged) whose
    B factors are random, so it changes the outputs (peft starts B at zero)."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora)
    model = get_peft_model(base, config)  # type: ignore[arg-type]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, std)
    model.save_pretrained(folder, safe_serialization=True)
    model.unload()  # restore the base modules
    return folder
