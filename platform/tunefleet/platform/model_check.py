"""Checking a base model's folder before it joins the registry, without loading it.

``check_model_folder`` reads the config, the safetensors headers (8 bytes of length, then
JSON naming every tensor's dtype, shape and byte range) and the tokenizer's files, and
refuses, naming the file and the fix, a folder that:

- has no parseable ``config.json``, or one of an architecture the planner and the training
  and serving code are not held to (``SUPPORTED_ARCHITECTURES``);
- holds pickle weights (``*.bin``, ``*.pt``...: loading them runs code), a pre-quantized
  checkpoint (``quantization_config``: QLoRA quantizes full-precision weights at load),
  or incomplete safetensors (a shard the index names that is absent, a file shorter than
  its header says, a tensor the index places in a shard that lacks it);
- has weights that disagree with its config: the embedding's shape, the number of layers,
  or the parameter count (the planner's, which the tests hold to the real models);
- has no tokenizer (``tokenizer.json`` or ``tokenizer.model``, and
  ``tokenizer_config.json``) or no chat template (in ``tokenizer_config.json``,
  ``chat_template.jinja`` or ``chat_template.json``), unless one is given.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunefleet.platform.errors import InvalidRequest
from tunefleet.platform.planner import ModelShape

# config.json's architectures[0] -> its model_type: the architectures the planner counts
# exactly (tests/platform/test_planner.py holds it to each real model)
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
TEMPLATE_FILE = "chat_template.jinja"
MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class ModelCheck:
    """What a checked folder holds."""

    architecture: str
    model_type: str
    parameters: int
    weight_bytes: int
    shards: int
    dtypes: tuple[str, ...]
    context_length: int | None


def _bad(message: str, param: str = "source") -> InvalidRequest:
    return InvalidRequest(message, param=param, code="invalid_model")


def read_json(path: Path, *, param: str = "source") -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise _bad(f"{path.name} is not readable JSON ({exc}); copy it again", param) from exc


def tensor_header(path: Path, *, param: str = "source") -> dict[str, Any]:
    """The tensors of one safetensors file (name -> dtype, shape, data_offsets), refused
    (a 400 on ``param``) if the file is shorter than it says."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < length <= min(MAX_HEADER, size - 8):
            raise _bad(f"{path.name} is not a safetensors file (its header length is wrong)", param)
        try:
            tensors = json.loads(f.read(length))
        except ValueError as exc:
            raise _bad(f"{path.name} has an unreadable safetensors header ({exc})", param) from exc
    if not isinstance(tensors, dict):
        raise _bad(f"{path.name} has an unreadable safetensors header (not an object)", param)
    tensors.pop("__metadata__", None)
    end = max((int(t["data_offsets"][1]) for t in tensors.values()), default=0)
    if size < 8 + length + end:
        raise _bad(
            f"{path.name} is truncated: its header names {8 + length + end} bytes, the file "
            f"has {size}; copy it again",
            param,
        )
    return tensors


def model_tensors(folder: Path) -> dict[str, dict[str, Any]]:
    """Every tensor's header entry, with the file it is in under ``"file"``."""
    from tunefleet.platform.models import SHARD_INDEX, SINGLE_WEIGHTS, missing_weights

    if why := missing_weights(folder):
        raise _bad(f"{why}; give the folder transformers' save_pretrained writes")
    if (folder / SINGLE_WEIGHTS).is_file():
        return {
            n: {**t, "file": SINGLE_WEIGHTS}
            for n, t in tensor_header(folder / SINGLE_WEIGHTS).items()
        }
    weight_map: dict[str, str] = read_json(folder / SHARD_INDEX)["weight_map"]
    found: dict[str, dict[str, Any]] = {}
    for shard in sorted(set(weight_map.values())):
        found.update({n: {**t, "file": shard} for n, t in tensor_header(folder / shard).items()})
    for name, shard in weight_map.items():
        if found.get(name, {}).get("file") != shard:
            raise _bad(f"{SHARD_INDEX} places {name} in {shard}, which does not hold it")
    return found


def _chat_template(folder: Path, tokenizer_config: dict[str, Any]) -> str | None:
    if (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text()
    if (folder / "chat_template.json").is_file():
        found = read_json(folder / "chat_template.json").get("chat_template")
        return found if isinstance(found, str) else None
    found = tokenizer_config.get("chat_template")
    if isinstance(found, list):  # named templates: the default one
        found = next((t.get("template") for t in found if t.get("name") == "default"), None)
    return found if isinstance(found, str) else None


def check_template(template: str) -> None:
    """Refuse a chat template that Jinja cannot parse, with the line it stops at."""
    import jinja2  # the API's and the CLI's dependency, where models are added

    if not template.strip():
        raise _bad("the chat template is empty; give a Jinja template", param="chat_template")
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise _bad(
            f"the chat template does not parse: {exc.message} (line {exc.lineno})",
            param="chat_template",
        ) from exc


def check_model_folder(folder: Path, *, chat_template: str | None = None) -> ModelCheck:
    """What ``folder`` holds, or a 400 naming the file at fault and the fix (see the
    module's docstring); ``chat_template`` stands in for a folder without one."""
    if not folder.is_dir():
        raise _bad(f"{str(folder)!r} is not a folder; give a model's folder")
    config = read_json(folder / "config.json") if (folder / "config.json").is_file() else None
    if not isinstance(config, dict):
        raise _bad(f"{folder.name} has no config.json object; give a transformers model folder")
    archs = config.get("architectures") or ["(none)"]
    arch = str(archs[0])
    if (
        arch not in SUPPORTED_ARCHITECTURES
        or config.get("model_type") != SUPPORTED_ARCHITECTURES[arch]
    ):
        raise _bad(
            f"config.json names architecture {arch!r} (model_type "
            f"{config.get('model_type')!r}), which TuneFleet does not train or serve; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if "quantization_config" in config:
        raise _bad(
            "config.json has a quantization_config: a pre-quantized checkpoint; give the "
            "full-precision weights (QLoRA quantizes them as a job loads them)"
        )
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise _bad(
            f"{', '.join(pickles)}: pickle files, whose loading runs code; TuneFleet takes "
            "safetensors only (remove them, or convert with save_pretrained(..., "
            "safe_serialization=True))"
        )
    tensors = model_tensors(folder)
    _agree(config, tensors)
    tokenizer = folder / "tokenizer_config.json"
    if not tokenizer.is_file() or not any(
        (folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model")
    ):
        raise _bad(
            f"{folder.name} has no tokenizer: it needs tokenizer.json (or tokenizer.model) "
            "and tokenizer_config.json, as tokenizer.save_pretrained(folder) writes them"
        )
    if (folder / "tokenizer.json").is_file():
        read_json(folder / "tokenizer.json")
    template = chat_template or _chat_template(folder, read_json(tokenizer))
    if template is None:
        raise _bad(
            f"{folder.name} has no chat template (none in tokenizer_config.json, no "
            f"{TEMPLATE_FILE}): give one (chat_template), or add the model's own"
        )
    check_template(template)
    return ModelCheck(
        architecture=arch,
        model_type=SUPPORTED_ARCHITECTURES[arch],
        parameters=sum(_numel(t) for t in tensors.values()),
        weight_bytes=sum(p.stat().st_size for p in folder.glob("*.safetensors")),
        shards=len({t["file"] for t in tensors.values()}),
        dtypes=tuple(sorted({str(t["dtype"]) for t in tensors.values()})),
        context_length=config.get("max_position_embeddings"),
    )


def _numel(tensor: dict[str, Any]) -> int:
    n = 1
    for d in tensor["shape"]:
        n *= int(d)
    return n


def _agree(config: dict[str, Any], tensors: dict[str, dict[str, Any]]) -> None:
    """Refuse weights of another shape than config.json's, naming the tensor and file."""
    try:
        shape = ModelShape.from_config(config)
    except (KeyError, TypeError, ValueError) as exc:
        raise _bad(f"config.json lacks a size the model needs ({exc}); copy it again") from exc
    embed = next((n for n in tensors if n.endswith("embed_tokens.weight")), None)
    if embed is None:
        raise _bad("the weights hold no embed_tokens.weight: not a decoder of this architecture")
    want = [shape.vocab_size, shape.hidden_size]
    if list(tensors[embed]["shape"]) != want:
        raise _bad(
            f"{embed} in {tensors[embed]['file']} is {tensors[embed]['shape']}, but config.json "
            f"says vocab_size {shape.vocab_size} and hidden_size {shape.hidden_size}: the "
            "config is not this model's"
        )
    layers = {int(m.group(1)) for n in tensors if (m := _LAYER.search(n))}
    if layers != set(range(shape.num_layers)):
        raise _bad(
            f"the weights hold {len(layers)} decoder layers, config.json says "
            f"num_hidden_layers {shape.num_layers}: the config is not this model's, or "
            "shards are missing"
        )
    total = sum(_numel(t) for t in tensors.values())
    if total != shape.total_params:
        raise _bad(
            f"the weights hold {total:,} parameters, config.json's sizes make "
            f"{shape.total_params:,}: a config of another model, or extra or missing tensors"
        )
