"""TuneFleet's core: settings, ids, errors, the job spec and its state machine, the
database, dataset validation, the artifact store and the model registry.

Imports neither ``tunefleet.api`` nor ``tunefleet.workers``, nor FastAPI, Ray or torch.
"""

from tunefleet.platform.settings import Settings, get_settings
from tunefleet.platform.spec import JobSpec
from tunefleet.platform.status import JobStatus

__all__ = ["JobSpec", "JobStatus", "Settings", "get_settings"]
