"""The contract between the API's inference proxy and the Serve applications (no database
here: replicas import it)."""

from __future__ import annotations

import re

from tunefleet.platform.artifacts import Keys
from tunefleet.platform.local_secrets import persisted_secret
from tunefleet.platform.settings import Settings

# The contract between the API's inference proxy and the Serve applications: each base
# model's application is named ``app_name(base)`` and answers under ``route_prefix(base)``;
# a request names its adapter (the job that made it) in ``ADAPTER_HEADER``, which Serve's
# multiplexing routes on; no header means the bare base model.
ADAPTER_HEADER = "serve_multiplexed_model_id"
# Serve answers only the API: every request carries the shared secret in this header
# (compared in constant time); without it 401, with another 403.
SECRET_HEADER = "x-tunefleet-serve-secret"
# An adapter id is the job id that made it (``ids.new_id("job")``), or that id and one of
# its checkpoints (``{job id}:ckpt-step-{N}``: the weights the job had at step N).
ADAPTER_ID = re.compile(r"(ftjob-[A-Za-z0-9]{1,64})(?::ckpt-step-([0-9]{1,9}))?")


def checkpoint_adapter_id(job_id: str, step: int) -> str:
    return f"{job_id}:ckpt-step-{step}"


def adapter_weights_key(adapter_id: str) -> str:
    """Where in the artifact store the weights of ``adapter_id`` are: a job's adapter, or
    the weights folder of one of its checkpoints."""
    matched = ADAPTER_ID.fullmatch(adapter_id)
    if matched is None:
        raise ValueError(f"{adapter_id[:80]!r} is not an adapter id")
    job_id, step = matched.groups()
    if step is None:
        return Keys.adapter_key(job_id)
    return f"{Keys.checkpoint_key(job_id, int(step))}/{Keys.CHECKPOINT_WEIGHTS}"


SECRET_FILE = "serve-secret"


def serve_secret(settings: Settings) -> str:
    """The secret Serve answers to: ``TUNEFLEET_SERVE_SECRET`` where it is set, as every
    process of a cluster must have it; otherwise one made once for this data folder
    (``data_dir/serve-secret``, readable by its owner alone), which the embedded default's
    API and controller share."""
    if settings.serve_secret:
        return settings.serve_secret
    return persisted_secret(settings.data_dir.resolve(), SECRET_FILE)


def route_prefix(base_model: str) -> str:
    return f"/models/{base_model}"


def app_name(base_model: str) -> str:
    return "tunefleet-" + "".join(c if c.isalnum() else "-" for c in base_model.lower())


# Ray nodes of a cluster carry this label when they are not for serving (the Helm chart
# sets it): the head, and the controllers' own nodes, which have no CPUs and no models,
# and the GPU groups' nodes when a CPU group serves (a replica keeps its node from being
# removed as idle: a GPU group that only trains scales back to zero). Serve replicas ask
# for nodes without these roles.
NODE_ROLE_LABEL = "tunefleet.io/role"
NOT_FOR_REPLICAS = ("controller", "head", "training")


def replica_label_selector() -> dict[str, str]:
    """The Ray label selector of a Serve replica: any node but those above (nodes without
    the label, as every node of a single-machine Ray, qualify)."""
    return {NODE_ROLE_LABEL: f"!in({','.join(NOT_FOR_REPLICAS)})"}
