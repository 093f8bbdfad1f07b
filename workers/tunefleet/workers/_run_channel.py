"""A run's line to the platform, through Ray: no process on Ray holds the database's
credentials.

One ``RunChannel`` actor per run (named ``run-{run id}`` in the ``tunefleet`` namespace,
detached, on the head node), opened by the controller before it submits the run:

- it hands the run what it needs from the database (``inputs``: the spec, the plan's
  device), so the run's driver never reads it;
- the run's rank 0 ``post``\\ s what it has to say (events, metrics, checkpoints), numbered
  in order; the controller ``take``\\ s them, writes them (``progress.apply``, once each:
  the job keeps the number of the last one applied) and ``ack``\\ s them;
- the controller says when the run must stop (``ask_stop``: paused, cancelled,
  superseded), and rank 0 learns it from the answer to its next ``post``.

The channel outlives the run (its last words wait for the controller) and a controller
fail-over (the next leader finds it by name); the controller closes it once the run ended
and everything it said is in the database.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

log = logging.getLogger(__name__)

NAMESPACE = "tunefleet"
HUB = "run-channels"
# The GCS address of the cluster the controller submitted a run to (and opened its channel
# on), in the run's environment for its driver's ray.init. Ray's Jobs API gives the driver
# RAY_ADDRESS as "auto" resolves it on the head, and with two Ray clusters on one machine
# (an embedded one beside a `ray start`) that is either of them.
CLUSTER_ENV = "TUNEFLEET_RUN_RAY_ADDRESS"
# A channel answers in milliseconds; this long means the head is in trouble.
TIMEOUT_S = 30.0


class RunChannel:
    """The channel's state (plain Python: the controller's tests hold it in-process; Ray
    runs it as an actor, ``open_channel``, one call at a time). Records are numbered from
    1 and stamped with the channel's own id, so a channel opened again under the same run
    id (after a Ray restart) numbers afresh without its records being taken for old ones
    (``progress.apply``)."""

    def __init__(self, inputs: dict[str, Any]) -> None:
        self._inputs = inputs
        self._id = uuid.uuid4().hex
        self._records: list[dict[str, Any]] = []
        self._seq = 0
        self._acked = 0
        self._stop: dict[str, Any] | None = None

    def inputs(self) -> dict[str, Any]:
        return self._inputs

    def post(self, records: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, int]:
        """Queue the run's records; answer the stop the controller asked for (None: go on)
        and the number of the last record queued."""
        for record in records:
            self._seq += 1
            self._records.append(
                {**record, "seq": self._seq, "channel": self._id, "at": time.time()}
            )
        return self._stop, self._seq

    def acked(self) -> int:
        """The number of the last record the controller has written."""
        return self._acked

    def take(self) -> list[dict[str, Any]]:
        """The records not yet acknowledged, oldest first."""
        return list(self._records)

    def ack(self, upto: int) -> None:
        self._records = [r for r in self._records if r["seq"] > upto]
        self._acked = max(self._acked, upto)

    def ask_stop(self, stop: dict[str, Any] | None) -> None:
        self._stop = stop


class Channels:
    """Every open run's channel, in one actor (``hub``): one process on the head however
    many runs there are. Each call names the run; a run without a channel gets None."""

    def __init__(self) -> None:
        self._runs: dict[str, RunChannel] = {}

    def open(self, run_id: str, inputs: dict[str, Any]) -> None:
        self._runs.setdefault(run_id, RunChannel(inputs))

    def runs(self) -> list[str]:
        return list(self._runs)

    def close(self, run_id: str) -> None:
        self._runs.pop(run_id, None)

    def call(self, run_id: str, method: str, *args: Any) -> Any:
        channel = self._runs.get(run_id)
        if channel is None:
            if method == "post":  # a run whose channel is gone cannot report: it must know
                raise LookupError(f"run {run_id} has no channel (closed by the controller)")
            return None
        return getattr(channel, method)(*args)


# -- Ray's side (the controller through RayBackend, the driver, the loop's rank 0) ------

# The hub's handle, and the connection it was got on (a process that shuts Ray down and
# connects again, to this cluster or another, gets it again: a handle is per connection)
_hub: Any = None
_hub_connection: tuple[str, str] | None = None


def hub() -> Any:
    """The channels' actor (named ``run-channels`` in the ``tunefleet`` namespace,
    detached, on the head: a worker node that goes away must not take the runs' words
    with it), created by the first process that asks."""
    global _hub, _hub_connection
    import ray

    context = ray.get_runtime_context()
    connection = (context.gcs_address, context.get_job_id())
    if _hub is None or _hub_connection != connection:
        actor: Any = ray.remote(Channels)
        _hub = actor.options(
            name=HUB,
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            resources={"node:__internal_head__": 0.001},
        ).remote()
        _hub_connection = connection
        log.info("run channels: actor %s on the Ray cluster at %s", _hub._actor_id.hex(),
                 context.gcs_address)  # fmt: skip
    return _hub


def _call(method: str, *args: Any) -> Any:
    global _hub
    import ray
    from ray.exceptions import RayActorError

    try:
        return ray.get(getattr(hub(), method).remote(*args), timeout=TIMEOUT_S)
    except RayActorError:  # a new head (Ray restarted): a new hub, once
        _hub = None
        return ray.get(getattr(hub(), method).remote(*args), timeout=TIMEOUT_S)


def open_channel(run_id: str, inputs: dict[str, Any]) -> None:
    """Open the run's channel with ``inputs`` (kept if it is open already)."""
    _call("open", run_id, inputs)


def open_runs() -> list[str]:
    """The run ids of every open channel."""
    runs: list[str] = _call("runs")
    return runs


def call(run_id: str, method: str, *args: Any) -> Any:
    """``RunChannel.method(*args)`` on the run's channel; None without one."""
    return _call("call", run_id, method, *args)


def run_inputs(run_id: str) -> dict[str, Any]:
    """What the controller put in the run's channel for it (the driver's first call)."""
    inputs: dict[str, Any] | None = call(run_id, "inputs")
    if inputs is None:
        import ray

        raise RuntimeError(
            f"run {run_id} has no channel in the channels actor "
            f"{hub()._actor_id.hex()} of the Ray cluster at "
            f"{ray.get_runtime_context().gcs_address} (open runs: {open_runs()[:5]}); "
            "the controller opens it before it submits the run"
        )
    return inputs


def close_channel(run_id: str) -> None:
    _call("close", run_id)


class ChannelReporter:
    """The run's end (rank 0): ``post`` records, learn whether to stop, ``flush`` (wait
    until what it said is in the database)."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.stop: dict[str, Any] | None = None
        self.last = 0

    def post(self, kind: str, **fields: Any) -> None:
        self._send([{"kind": kind, **fields}])

    def sync(self) -> dict[str, Any] | None:
        """The stop the controller asked for, if any."""
        self._send([])
        return self.stop

    def flush(self, wait_s: float) -> bool:
        """Wait until the controller has written every record posted so far (at most
        ``wait_s``: the database may be away); whether it has. Before a checkpoint, so that
        no checkpoint a later run resumes from is newer than the metrics on record."""
        deadline = time.monotonic() + wait_s
        while (call(self.run_id, "acked") or 0) < self.last:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        return True

    def _send(self, records: list[dict[str, Any]]) -> None:
        self.stop, self.last = call(self.run_id, "post", records)
