"""The node's copies of base models (``platform/model_cache.py``), on real folders: off,
a model is read from the registry in place; on, it is copied once per node and read from
the copy, pinned while in use, copied anew when the registry's model changes, and read in
place when it is larger than the cache."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from tunefleet.platform import model_cache
from tunefleet.platform.model_cache import cache_key, local_model
from tunefleet.platform.node_cache import NodeCache
from tunefleet.platform.settings import Settings

WEIGHTS = 200_000


def _model(registry: Path, name: str = "m") -> Path:
    folder = registry / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(os.urandom(WEIGHTS))
    (folder / "tokenizer.json").write_text("{}")
    (folder / "original").mkdir()  # a sub-folder (another format's weights): not copied
    (folder / "original" / "consolidated.pth").write_bytes(b"x" * 10)
    return folder


def _settings(tmp_path: Path, size: int | str) -> Settings:
    return Settings(
        data_dir=tmp_path / "data", model_cache=tmp_path / "model-cache", model_cache_size=size
    )


def test_off_a_model_is_read_from_the_registry_in_place(tmp_path: Path) -> None:
    folder = _model(tmp_path / "registry")
    with local_model(folder, _settings(tmp_path, 0)) as path:
        assert path == folder
    assert not (tmp_path / "model-cache").exists()


def test_on_a_model_is_copied_once_and_read_from_its_pinned_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _model(tmp_path / "registry")
    settings = _settings(tmp_path, "1Mi")
    copied: list[str] = []
    real_copy = shutil.copyfile

    def counting(src: Path, dst: Path) -> object:
        copied.append(Path(src).name)
        return real_copy(src, dst)

    monkeypatch.setattr(model_cache.shutil, "copyfile", counting)
    with local_model(folder, settings) as path:
        cache = NodeCache(settings.resolved_model_cache, int(0.9 * (1 << 20)))
        assert path.is_relative_to(settings.resolved_model_cache)
        assert sorted(p.name for p in path.iterdir()) == [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
        ]
        assert (path / "model.safetensors").read_bytes() == (
            folder / "model.safetensors"
        ).read_bytes()
        assert cache.usage().pinned_bytes >= WEIGHTS  # not evicted while in use
        with local_model(folder, settings) as again:  # another process of the node
            assert again == path
    assert sorted(copied) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert cache.usage().pinned_bytes == 0 and cache.usage().copies == 1
    assert oct(settings.resolved_model_cache.stat().st_mode & 0o777) == oct(0o700)


def test_a_model_added_again_under_its_name_is_copied_anew(tmp_path: Path) -> None:
    """The copy is keyed by the files' names, sizes and times: the registry's model
    replaced (removed and added again) is a new copy; the old one is evicted for it."""
    registry = tmp_path / "registry"
    folder = _model(registry)
    settings = _settings(tmp_path, 3 * WEIGHTS // 2 * 10 // 9)  # room for one copy
    with local_model(folder, settings) as first:
        old_key = cache_key(folder)
    shutil.rmtree(folder)
    folder = _model(registry)
    assert cache_key(folder) != old_key
    with local_model(folder, settings) as second:
        assert second != first
        assert (second / "model.safetensors").read_bytes() == (
            folder / "model.safetensors"
        ).read_bytes()
    assert not first.exists()  # evicted: least recently used, not pinned
    assert NodeCache(settings.resolved_model_cache, 0).usage().copies == 1


def test_a_model_larger_than_the_cache_is_read_in_place_and_the_log_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = _model(tmp_path / "registry")
    with caplog.at_level(logging.WARNING), local_model(folder, _settings(tmp_path, "100k")) as p:
        assert p == folder
    assert "base model m" in caplog.text and "TUNEFLEET_MODEL_CACHE_SIZE" in caplog.text


def test_a_model_cache_others_can_write_is_refused(tmp_path: Path) -> None:
    """Another user could plant weights in a shared folder: the cache must be this
    user's alone."""
    folder = _model(tmp_path / "registry")
    (tmp_path / "model-cache").mkdir(mode=0o777)
    os.chmod(tmp_path / "model-cache", 0o777)
    with pytest.raises(PermissionError, match="TUNEFLEET_MODEL_CACHE"):
        local_model(folder, _settings(tmp_path, "1Mi"))
