"""Reading back what a job's integrations wrote, for the tests: W&B's offline run files
(its records, as `wandb sync` reads them) and an MLflow store."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tunefleet.workers.train._trackers import JOB_TAG

# W&B's run file (``run-<id>.wandb``): LevelDB's log format, records in 32 KiB blocks
# after a 7-byte file header, each record a 7-byte header (checksum, length, type) and a
# piece of a serialized ``Record`` protobuf (whole, or first/middle/last pieces).
_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> Iterator[Any]:
    """The ``Record`` messages of one W&B run file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:_HEADER])
    assert ident == b":W&B" and magic == 0xBEE1, f"{path} is not a W&B run file"
    index, pieces = _HEADER, b""
    while index + _HEADER <= len(data):
        left = _BLOCK - index % _BLOCK
        if left < _HEADER:  # the block's tail is padding
            index += left
            continue
        _, length, kind = struct.unpack("<IHB", data[index : index + _HEADER])
        piece = data[index + _HEADER : index + _HEADER + length]
        index += _HEADER + length
        if kind == 0 and length == 0:  # zeros: the end of what was written
            break
        pieces = piece if kind in (_FULL, _FIRST) else pieces + piece
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            yield record
            pieces = b""


def wandb_history(root: Path) -> dict[int, dict[str, Any]]:
    """Every step logged in the offline W&B runs under ``root`` (W&B keeps a step's first
    values: a step logged again after a resume is dropped)."""
    steps: dict[int, dict[str, Any]] = {}
    for path in sorted(root.rglob("run-*.wandb")):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") != "history":
                continue
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            steps.setdefault(int(row["_step"]), row)
    return steps


def wandb_config(root: Path) -> dict[str, Any]:
    """The run config the offline W&B runs under ``root`` recorded."""
    config: dict[str, Any] = {}
    for path in sorted(root.rglob("run-*.wandb")):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            update = (
                record.run.config if kind == "run" else record.config if kind == "config" else None
            )
            for item in update.update if update is not None else ():
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return config


def mlflow_run(uri: str, experiment: str, job_id: str) -> Any:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None
    [run] = client.search_runs([found.experiment_id], f"tags.`{JOB_TAG}` = '{job_id}'")
    return client, run
