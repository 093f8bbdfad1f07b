"""Adapters users bring (``POST /v1/models``, files of purpose ``adapter``): a peft LoRA
adapter saved by peft, uploaded as a tar or a zip, becomes a model of the tenant whose
stored weights serving decodes as peft computes, listed, hidden from other tenants,
shareable, trainable further (``tunefleet.init_from_adapter``) and deletable; every way an
adapter or its archive can be wrong is a 400 naming it, and nothing is kept."""

from __future__ import annotations

import io
import json
import re
import shutil
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from conftest import auth as H
from conftest import upload_chat
from tinyllm import build_tiny_llama, save_random_lora
from tunefleet.platform.adapter_import import check_adapter_folder, unpack_archive
from tunefleet.platform.artifacts import ArtifactStore
from tunefleet.platform.errors import InvalidRequest
from tunefleet.platform.serving_contract import adapter_weights_key
from tunefleet.platform.settings import Settings

TINY = "tiny-llama"
SHAPE = {"r": 8, "alpha": 16, "targets": ("q_proj", "v_proj", "down_proj")}


@pytest.fixture(scope="module")
def adapter(tiny_registry: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random rank-8 LoRA on the tiny Llama, as peft saves it."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_registry / TINY, dtype=torch.float32)
    return save_random_lora(base, tmp_path_factory.mktemp("adapter") / "mine", seed=5, **SHAPE)


def _tar(folder: Path, *, top: str | None = "mine") -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for f in sorted(folder.iterdir()):
            tar.add(f, arcname=f"{top}/{f.name}" if top else f.name)
    return out.getvalue()


def _zip(folder: Path) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for f in sorted(folder.iterdir()):
            z.write(f, f.name)
    return out.getvalue()


def _bomb(folder: Path) -> bytes:
    """The adapter and 2 MB of zeros, gzipped into a few kB: more unpacked than uploads
    may be (1 MB in these tests' settings)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for f in sorted(folder.iterdir()):
            tar.add(f, arcname=f.name)
        zeros = tarfile.TarInfo("zeros.txt")
        zeros.size = 2_000_000
        tar.addfile(zeros, io.BytesIO(bytes(zeros.size)))
    return out.getvalue()


def _upload(client: TestClient, key: str, name: str, data: bytes) -> Any:
    return client.post(
        "/v1/files", headers=H(key), data={"purpose": "adapter"}, files={"file": (name, data)}
    )


def test_an_uploaded_adapter_is_a_model_served_shared_trained_further_and_deleted(
    app_client: TestClient, settings: Settings, key_a: str, key_b: str, adapter: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from float64 import assert_greedy, double
    from tunefleet.workers.serve._adapter_cache import AdapterCache
    from tunefleet.workers.serve._engine import BatchEngine, generate_all
    from tunefleet.workers.serve._generate import Sampling, eos_ids
    from tunefleet.workers.serve._multilora import MultiLoraModel

    store = ArtifactStore(settings.resolved_artifact_root)
    models = {}
    for name, data in (("mine.tar", _tar(adapter)), ("mine.zip", _zip(adapter))):
        up = _upload(app_client, key_a, name, data)
        assert up.status_code == 200, up.text
        f = up.json()
        assert f["purpose"] == "adapter" and f["tunefleet"]["format"] == "peft_lora"
        assert f["tunefleet"]["stats"]["r"] == 8
        suffix = name.replace(".", "-")
        made = app_client.post(
            "/v1/models",
            headers=H(key_a),
            json={"base_model": TINY, "name": suffix, "file_id": f["id"]},
        )
        assert made.status_code == 200, made.text
        model = made.json()
        assert re.fullmatch(rf"ft:{TINY}:tenant-a:{suffix}:adapter-[A-Za-z0-9]+", model["id"])
        assert model["owned_by"] == "tenant-a" and model["parent"] == TINY
        assert model["tunefleet"]["r"] == 8 and model["tunefleet"]["file_id"] == f["id"]
        assert model["tunefleet"]["target_modules"] == list(SHAPE["targets"])
        models[name] = model
    model = models["mine.tar"]
    job_id = model["tunefleet"]["job_id"]

    # listed for its tenant, a 404 to another; its job is the record of the import
    listed = [m["id"] for m in app_client.get("/v1/models", headers=H(key_a)).json()["data"]]
    assert model["id"] in listed and models["mine.zip"]["id"] in listed
    assert app_client.get(f"/v1/models/{model['id']}", headers=H(key_b)).status_code == 404
    job = app_client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=H(key_a)).json()
    assert job["status"] == "succeeded" and job["fine_tuned_model"] == model["id"]
    assert job["tunefleet"]["lora"]["r"] == 8
    events = app_client.get(f"/v1/fine_tuning/jobs/{job_id}/events", headers=H(key_a)).json()
    assert (
        "Imported a rank-8 LoRA adapter on q_proj, v_proj, down_proj"
        in (events["data"][0]["message"])
    )

    # the weights serving reads for it (by its job's id) decode as peft computes with the
    # adapter as uploaded, in float64 (tests/float64.py)
    stored = store.path(adapter_weights_key(job_id))
    assert sorted(p.name for p in stored.iterdir()) == sorted(p.name for p in adapter.iterdir())
    assert load_file(str(stored / "adapter_model.safetensors")).keys() == (
        load_file(str(adapter / "adapter_model.safetensors")).keys()
    )
    path = settings.resolved_model_registry / TINY
    tok = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    lora = MultiLoraModel(base, max_adapters=2)
    slot = AdapterCache(lora, locate=lambda _: stored).acquire(job_id, hold=False)
    eos = eos_ids(base, tok)
    reference = double(
        PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), str(adapter)
        ).eval()
    )
    greedy = Sampling(max_tokens=8, temperature=0.0)
    prompts = [tok(t)["input_ids"] for t in ("what color is the sky", "name a fruit")]
    served = generate_all(BatchEngine(lora, eos), tok, [(p, greedy, slot) for p in prompts])
    for prompt, answer in zip(prompts, served, strict=True):
        assert_greedy(reference, prompt, answer.token_ids, greedy.max_tokens, eos, msg=prompt)

    # shared with tenant B, who sees it
    shared = app_client.post(
        f"/v1/models/{model['id']}/shares", headers=H(key_a), json={"tenant": "tenant-b"}
    )
    assert shared.status_code == 200, shared.text
    assert app_client.get(f"/v1/models/{model['id']}", headers=H(key_b)).status_code == 200

    # trained further: the new job starts from its weights, with its LoRA shape
    f = upload_chat(app_client, key_a)
    further = app_client.post(
        "/v1/fine_tuning/jobs",
        headers=H(key_a),
        json={"model": TINY, "training_file": f["id"],
              "tunefleet": {"init_from_adapter": model["id"]}},
    )  # fmt: skip
    assert further.status_code == 200, further.text
    opts = further.json()["tunefleet"]
    assert opts["init_from_job"] == job_id
    assert opts["lora"] == {**job["tunefleet"]["lora"]}
    other_shape = app_client.post(
        "/v1/fine_tuning/jobs",
        headers=H(key_a),
        json={"model": TINY, "training_file": f["id"],
              "tunefleet": {"init_from_adapter": model["id"], "lora": {"r": 4}}},
    )  # fmt: skip
    assert other_shape.status_code == 400
    assert "send the same tunefleet.lora" in other_shape.json()["error"]["message"]

    # deleted: gone from the listing and the store
    assert app_client.delete(f"/v1/models/{model['id']}", headers=H(key_a)).status_code == 200
    listed = [m["id"] for m in app_client.get("/v1/models", headers=H(key_a)).json()["data"]]
    assert model["id"] not in listed and not store.exists(adapter_weights_key(job_id))


def _refused(folder: Path, base: Path, *needles: str, max_rank: int = 64) -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_adapter_folder(folder, base, max_rank=max_rank)
    assert refused.value.code == "invalid_adapter"
    for needle in needles:
        assert needle in refused.value.message, refused.value.message


def test_each_way_an_adapter_is_wrong_is_named_with_its_fix(
    adapter: Path, tiny_registry: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    base = tiny_registry / TINY
    checked = check_adapter_folder(adapter, base, max_rank=64)
    assert (checked.r, checked.alpha, checked.target_modules) == (8, 16.0, SHAPE["targets"])
    # rank 8 on q, v (64 -> 64, 64 -> 32: two kv heads of 16) and down (128 -> 64), 2 layers
    assert checked.parameters == 2 * 8 * ((64 + 64) + (64 + 32) + (128 + 64))

    def copy(name: str, edit: dict[str, Any] | None = None) -> Path:
        folder = shutil.copytree(adapter, tmp_path / name)
        if edit is not None:
            config = json.loads((folder / "adapter_config.json").read_text())
            (folder / "adapter_config.json").write_text(json.dumps({**config, **edit}))
        return folder

    _refused(adapter, base, "r=8", "ranks from 1 to 4", "TUNEFLEET_ADAPTER_MAX_RANK", max_rank=4)
    _refused(copy("ia3", {"peft_type": "IA3"}), base, "peft_type 'IA3'", "LoRA adapters")
    _refused(copy("saved", {"modules_to_save": ["lm_head"]}), base, "modules_to_save")
    _refused(copy("pattern", {"target_modules": ".*proj"}), base, "as the pattern", "q_proj")
    _refused(copy("unknown", {"target_modules": ["q_proj", "gate"]}), base, "['gate']")
    _refused(copy("fewer", {"target_modules": ["q_proj", "v_proj"]}), base,
             "adapts model.layers.0.mlp.down_proj", "do not name 'down_proj'")  # fmt: skip
    pickled = copy("pickled")
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04")
    _refused(pickled, base, "adapter_model.bin", "pickle", "safetensors only")

    # factors missing, or for another model: the module and both shapes are named
    halved = copy("halved")
    weights = load_file(str(halved / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    save_file({k: v for k, v in weights.items() if k != key}, halved / "adapter_model.safetensors")
    _refused(halved, base, "model.layers.1.self_attn.v_proj.lora_B.weight is missing")
    wider = build_tiny_llama(tmp_path / "wider", hidden=96)
    other = save_random_lora(
        AutoModelForCausalLM.from_pretrained(wider, dtype=torch.float32), tmp_path / "other",
        **SHAPE,
    )  # fmt: skip
    _refused(other, base, "model.layers.0.mlp.down_proj.lora_A.weight has shape [8, 192]",
             "is [64, 128] (out, in)", "needs [8, 128]")  # fmt: skip
    deeper = save_random_lora(
        AutoModelForCausalLM.from_pretrained(build_tiny_llama(tmp_path / "deep", layers=3)),
        tmp_path / "deeper", **SHAPE,
    )  # fmt: skip
    _refused(deeper, base, "adapts model.layers.2.", "no linear layer named")


def test_unsafe_or_wrong_archives_are_refused_by_name_and_nothing_is_kept(
    app_client: TestClient, settings: Settings, key_a: str, key_b: str, adapter: Path
) -> None:
    def tar_of(*members: tarfile.TarInfo, data: bytes = b"{}") -> bytes:
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w") as tar:
            for m in members:
                tar.addfile(m, io.BytesIO(data) if m.isfile() else None)
        return out.getvalue()

    def member(name: str, kind: bytes = tarfile.REGTYPE) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.type, info.size = kind, 2 if kind == tarfile.REGTYPE else 0
        if kind == tarfile.SYMTYPE:
            info.linkname = "/etc/passwd"
        return info

    cases = {  # name -> (what is uploaded, what the refusal says)
        "escape.tar": (tar_of(member("../adapter_config.json")), "would be written outside"),
        "absolute.tar": (tar_of(member("/tmp/adapter_config.json")), "would be written outside"),
        "link.tar": (tar_of(member("adapter_config.json", tarfile.SYMTYPE)), "is a link"),
        "empty.tar": (tar_of(member("notes.txt")), "holds no adapter_config.json"),
        "noweights.tar": (tar_of(member("adapter_config.json")), "no adapter_model.safetensors"),
        "text.tar": (b"not an archive at all", "neither a tar nor a zip"),
        "mine.jsonl": (_tar(adapter), "uploaded as a .tar, .tar.gz or .zip"),
        "bomb.tar.gz": (_bomb(adapter), "unpacks to"),
        "twice.tar": (tar_of(member("a/x"), member("a/x")), "holds 'a/x' twice"),
    }
    for name, (data, needle) in cases.items():
        up = _upload(app_client, key_a, name, data)
        assert up.status_code == 400, (name, up.text)
        assert needle in up.json()["error"]["message"], (name, up.json())
    assert app_client.get("/v1/files", headers=H(key_a)).json()["data"] == []
    files = ArtifactStore(settings.resolved_artifact_root).path("files")
    assert not files.exists() or not list(files.iterdir())

    # a training file is not an adapter, an adapter is not a training file
    chat = upload_chat(app_client, key_a)
    wrong = app_client.post(
        "/v1/models",
        headers=H(key_a),
        json={"base_model": TINY, "name": "x", "file_id": chat["id"]},
    )
    assert wrong.status_code == 400 and "with purpose 'adapter'" in wrong.text
    f = _upload(app_client, key_a, "mine.tar", _tar(adapter)).json()
    as_data = app_client.post(
        "/v1/fine_tuning/jobs", headers=H(key_a), json={"model": TINY, "training_file": f["id"]}
    )
    assert as_data.status_code == 400 and "purpose 'fine-tune'" in as_data.text
    theirs = app_client.post(  # another tenant's upload is no file of B's
        "/v1/models", headers=H(key_b), json={"base_model": TINY, "name": "x", "file_id": f["id"]}
    )
    assert theirs.status_code == 404 and f"no file with id {f['id']!r}" in theirs.text
    for body, needle in (
        ({"base_model": "nope", "name": "x", "file_id": f["id"]}, "no base model 'nope'"),
        ({"base_model": TINY, "name": "a b", "file_id": f["id"]}, "letters, digits"),
        ({"base_model": TINY, "name": "x"}, "exactly one of file_id"),
        ({"base_model": TINY, "name": "x", "source": "s3://other-bucket/adapters/ftjob-x"},
         "imports/tenant-a/"),
    ):  # fmt: skip
        refused = app_client.post("/v1/models", headers=H(key_a), json=body)
        assert refused.status_code in (400, 404), (body, refused.text)
        assert needle in refused.json()["error"]["message"], (body, refused.json())


def test_an_archive_unpacks_to_the_adapters_folder_alone(adapter: Path, tmp_path: Path) -> None:
    for name, data in (("top.tar", _tar(adapter, top=None)), ("nested.tar", _tar(adapter)),
                       ("zipped.zip", _zip(adapter))):  # fmt: skip
        archive = tmp_path / name
        archive.write_bytes(data)
        folder = unpack_archive(archive, tmp_path / f"{name}-out", max_bytes=10**7)
        for f in adapter.iterdir():
            assert (folder / f.name).read_bytes() == f.read_bytes(), (name, f.name)


def test_an_adapter_in_the_tenants_import_folder_of_object_storage_is_imported(
    s3_endpoint: str, settings: Settings, key_a: str, adapter: Path, tmp_path: Path
) -> None:
    """``source: s3://...`` under the store's ``imports/{tenant}/``, read through the node's
    cache; anywhere else in the store (other tenants' artifacts live there) is refused
    before anything is read."""
    from s3 import new_bucket
    from tunefleet.platform.adapter_import import import_adapter
    from tunefleet.platform.artifacts import open_store
    from tunefleet.platform.db import session_scope
    from tunefleet.platform.models import ModelRegistry
    from tunefleet.platform.tenants import authenticate

    url = new_bucket(s3_endpoint)
    store = open_store(url, endpoint_url=s3_endpoint, cache_dir=tmp_path / "cache")
    store.put_dir("imports/tenant-a/mine", adapter)
    store.put_dir("adapters/ftjob-someoneelse", adapter)
    registry = ModelRegistry(settings.resolved_model_registry)
    limits = {"max_rank": 64, "max_bytes": 10**7}
    with session_scope(settings.resolved_database_url) as s:
        principal = authenticate(s, f"Bearer {key_a}")
        job, made = import_adapter(s, principal, registry, store, base_model=TINY, name="s3",
                                   source=f"{url}/imports/tenant-a/mine", **limits)  # fmt: skip
        for source in (f"{url}/adapters/ftjob-someoneelse", f"{url}/imports/tenant-b/mine",
                       f"{url}/imports/tenant-a/../../adapters/ftjob-someoneelse"):  # fmt: skip
            with pytest.raises(InvalidRequest, match="imports/tenant-a/"):
                import_adapter(s, principal, registry, store, base_model=TINY, name="no",
                               source=source, **limits)  # fmt: skip
    assert made.name.startswith(f"ft:{TINY}:tenant-a:s3:adapter-")
    copied = store.local_copy(store.adapter_key(job.id))
    for f in adapter.iterdir():
        assert (copied / f.name).read_bytes() == f.read_bytes(), f.name
