"""Adding base models to the registry, on real transformers checkpoints: every supported
architecture is checked and copied (single or sharded weights) and loads as it was saved;
each way a folder can be wrong is refused naming the file and the fix, leaving nothing in
the registry; removal is refused while a job or an adapter uses the model; both are on the
audit log."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tinyllm import CHATML, build_tokenizer
from tunefleet.platform import audit
from tunefleet.platform.artifacts import ArtifactStore
from tunefleet.platform.base_models import add_base_model, base_model_view, remove_base_model
from tunefleet.platform.db import Adapter, AuditEntry, Job, session_scope
from tunefleet.platform.errors import Conflict, InvalidRequest
from tunefleet.platform.model_check import SUPPORTED_ARCHITECTURES, check_model_folder
from tunefleet.platform.models import SHARD_INDEX, ModelRegistry
from tunefleet.platform.status import JobStatus
from tunefleet.platform.tenants import create_tenant

TINY = "tiny-llama"


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(folder)
    return folder


def _save(folder: Path, model_type: str, tokenizer: Path, **sizes: object) -> Path:
    """A tiny random model of ``model_type`` saved as transformers saves it, sharded in
    100 kB pieces, with the tokenizer beside it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        **{"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "pad_token_id": 0, "eos_token_id": 2, "bos_token_id": None,
           **sizes},
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="100KB")
    for f in tokenizer.iterdir():
        shutil.copyfile(f, folder / f.name)
    return folder


@pytest.mark.parametrize("model_type", sorted(SUPPORTED_ARCHITECTURES.values()))
def test_every_supported_architecture_is_checked_and_loads_as_saved(
    model_type: str, tokenizer_folder: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    folder = _save(tmp_path / model_type, model_type, tokenizer_folder)
    assert (folder / SHARD_INDEX).is_file()
    check = check_model_folder(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert check.model_type == model_type
    assert check.architecture == type(model).__name__
    assert check.parameters == sum(p.numel() for p in model.parameters())
    assert check.shards == len(list(folder.glob("model-*-of-*.safetensors"))) > 1
    assert check.dtypes == ("F32",)


def _refused(folder: Path, *needles: str, chat_template: str | None = None) -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_model_folder(folder, chat_template=chat_template)
    for needle in needles:
        assert needle in refused.value.message, refused.value.message


def test_each_way_a_folder_is_wrong_is_named_with_its_fix(
    tokenizer_folder: Path, tmp_path: Path
) -> None:
    def fresh(name: str, model_type: str = "llama", **sizes: object) -> Path:
        return _save(tmp_path / name, model_type, tokenizer_folder, **sizes)

    phi = fresh("phi", "phi")  # Phi-1 and Phi-2: not Phi-3's layers
    _refused(phi, "'PhiForCausalLM'", "supported: LlamaForCausalLM", "Phi3ForCausalLM")

    pickled = fresh("pickled")
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04")
    _refused(pickled, "pytorch_model.bin", "pickle", "safetensors only")

    quantized = fresh("quantized")
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (quantized / "config.json").write_text(json.dumps(config))
    _refused(quantized, "quantization_config", "full-precision")

    truncated = fresh("truncated")
    shard = sorted(truncated.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-10])
    _refused(truncated, shard.name, "truncated", "copy it again")

    missing = fresh("missing")
    sorted(missing.glob("model-*.safetensors"))[0].unlink()
    _refused(missing, SHARD_INDEX, "names shards that are not there")

    # a shard that is a safetensors file but not the one the index means
    swapped = fresh("swapped")
    first, last = (
        sorted(swapped.glob("model-*.safetensors"))[0],
        sorted(swapped.glob("model-*.safetensors"))[-1],
    )
    shutil.copyfile(last, first)
    _refused(swapped, SHARD_INDEX, "which does not hold it")

    # a config of another model: another vocabulary, then another depth
    other = fresh("other")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 321}))
    _refused(other, "embed_tokens.weight", "[320, 64]", "vocab_size 321", "not this model's")
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    _refused(other, "2 decoder layers", "num_hidden_layers 3")
    (other / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    _refused(other, "parameters", "config.json's sizes make")

    untokenized = fresh("untokenized")
    (untokenized / "tokenizer.json").unlink()
    _refused(untokenized, "no tokenizer", "tokenizer.json", "save_pretrained")

    untemplated = fresh("untemplated")
    tokenizer_config = json.loads((untemplated / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (untemplated / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (untemplated / "chat_template.jinja").unlink(missing_ok=True)
    _refused(untemplated, "no chat template", "give one (chat_template)")
    assert check_model_folder(untemplated, chat_template=CHATML).architecture == "LlamaForCausalLM"
    with pytest.raises(InvalidRequest, match=r"does not parse: .* \(line 1\)") as bad:
        check_model_folder(untemplated, chat_template="{% for m in messages %}")
    assert bad.value.param == "chat_template"

    with pytest.raises(InvalidRequest, match=r"no config\.json"):
        check_model_folder(tokenizer_folder)


@pytest.fixture
def registry(tmp_path: Path) -> ModelRegistry:
    return ModelRegistry(tmp_path / "registry")


def test_a_model_is_added_removed_and_both_are_on_the_audit_log(
    registry: ModelRegistry, tokenizer_folder: Path, tmp_path: Path, migrated_url: str
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    store = ArtifactStore(tmp_path / "artifacts")
    source = _save(tmp_path / "qwen", "qwen3", tokenizer_folder)
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (source / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (source / "chat_template.jinja").unlink(missing_ok=True)
    (source / "original").mkdir()  # a repo's originals: not copied
    (source / "original" / "consolidated.00.pth").write_bytes(b"\x80")
    with session_scope(migrated_url) as s:
        with pytest.raises(InvalidRequest, match="no chat template"):
            add_base_model(
                s, registry, store, "qwen-tiny", str(source), actor=audit.CLI, any_path=True
            )
        view = add_base_model(
            s, registry, store, "qwen-tiny", str(source), actor=audit.CLI, any_path=True,
            chat_template=CHATML,
        )  # fmt: skip
    assert view["architecture"] == "Qwen3ForCausalLM" and view["problem"] is None
    assert registry.names() == ["qwen-tiny"]
    assert sorted(p.name for p in registry.root.iterdir()) == ["qwen-tiny"]  # no leftovers
    assert not (registry.path("qwen-tiny") / "original").exists()
    assert AutoTokenizer.from_pretrained(registry.require("qwen-tiny")).chat_template == CHATML
    loaded = AutoModelForCausalLM.from_pretrained(registry.require("qwen-tiny"))
    saved = AutoModelForCausalLM.from_pretrained(source)
    for (name, got), (_, want) in zip(
        loaded.state_dict().items(), saved.state_dict().items(), strict=True
    ):
        assert torch.equal(got, want), name
    assert base_model_view(registry, "qwen-tiny") == {**view, "created": view["created"]}

    with session_scope(migrated_url) as s, pytest.raises(Conflict, match="already in the registry"):
        add_base_model(s, registry, store, "qwen-tiny", str(source), actor=audit.CLI, any_path=True)
    with session_scope(migrated_url) as s, pytest.raises(InvalidRequest, match=r"name '\.\./up'"):
        add_base_model(s, registry, store, "../up", str(source), actor=audit.CLI, any_path=True)

    # in use: a job not finished, then an adapter (the job's, once it succeeded)
    with session_scope(migrated_url) as s:
        tenant = create_tenant(s, "t")
        s.add(Job(id="ftjob-1", tenant_id=tenant.id, status=JobStatus.RUNNING.value,
                  model="qwen-tiny", training_file="file-1", spec={}))  # fmt: skip
    with session_scope(migrated_url) as s, pytest.raises(Conflict) as in_use:
        remove_base_model(s, registry, "qwen-tiny", actor=audit.CLI)
    assert "in use by job ftjob-1;" in in_use.value.message
    with session_scope(migrated_url) as s:
        s.get_one(Job, "ftjob-1").status = JobStatus.SUCCEEDED.value
        s.add(Adapter(id="adapter-1", tenant_id=tenant.id, job_id="ftjob-1",
                      name="ft:qwen-tiny:t::1", base_model="qwen-tiny",
                      path="adapters/1"))  # fmt: skip
    with session_scope(migrated_url) as s, pytest.raises(Conflict) as in_use:
        remove_base_model(s, registry, "qwen-tiny", actor=audit.CLI)
    assert "in use by adapter ft:qwen-tiny:t::1;" in in_use.value.message
    with session_scope(migrated_url) as s:
        s.delete(s.get(Adapter, "adapter-1"))
    with session_scope(migrated_url) as s:
        assert remove_base_model(s, registry, "qwen-tiny", actor=audit.CLI)["deleted"]
    assert registry.names() == [] and list(registry.root.iterdir()) == []

    with session_scope(migrated_url) as s:
        acts = [
            (e.action, e.target_id, e.via)
            for e in s.query(AuditEntry).order_by(AuditEntry.created_ns)
        ]
        added = s.query(AuditEntry).filter_by(action="base_model.add").one()
        assert added.after is not None and added.after["source"] == str(source)
        assert added.after["parameters"] == view["parameters"]
    assert acts == [
        ("base_model.add", "qwen-tiny", "cli"),
        ("base_model.remove", "qwen-tiny", "cli"),
    ]


def test_a_model_in_object_storage_is_added_through_the_nodes_cache(
    s3_endpoint: str, sqlite_template: Path, tiny_registry: Path, registry: ModelRegistry,
    tmp_path: Path,
) -> None:  # fmt: skip
    from s3 import new_bucket
    from tunefleet.platform.artifacts import open_store

    url = new_bucket(s3_endpoint)
    store = open_store(url, endpoint_url=s3_endpoint, cache_dir=tmp_path / "cache")
    store.put_dir("imports/tiny", tiny_registry / TINY)
    db = tmp_path / "db.sqlite"
    shutil.copyfile(sqlite_template, db)
    with session_scope(f"sqlite:///{db}") as s:
        view = add_base_model(s, registry, store, "tiny", f"{url}/imports/tiny", actor=audit.CLI)
        for source, refusal in (
            (f"{url}/imports/nothing", "holds nothing"),
            ("s3://elsewhere/tiny", "is not in the artifact store"),
            ("https://example.com/tiny", "give a folder path or an s3:// URI"),
            (str(tiny_registry / TINY), "TUNEFLEET_MODEL_IMPORT_DIR, which is not set"),
        ):
            with pytest.raises(InvalidRequest, match=refusal):
                add_base_model(s, registry, store, "other", source, actor=audit.CLI)
    assert view["parameters"] == check_model_folder(tiny_registry / TINY).parameters
    for f in (tiny_registry / TINY).iterdir():
        assert (registry.path("tiny") / f.name).read_bytes() == f.read_bytes(), f.name
