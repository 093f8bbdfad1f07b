"""TuneFleet's core: settings, ids, errors, the job spec and its state machine, the
database, dataset validation, the artifact store and the model registry.

Imports neither ``tunefleet.api`` nor ``tunefleet.workers``, nor FastAPI, Ray or torch.

Its surface is its public modules (no leading ``_``), imported by name
(``from tunefleet.platform.jobs import create_job``); ``_new_job`` and ``_defaults`` are its
own. The modules are not all re-exported here: importing this package stays cheap and
free of the database for training runs and serving replicas, which use ``spec``,
``settings``, ``artifacts``, ``models`` and ``datasets`` only (and may not reach the
database: an import contract in pyproject.toml).
"""

from tunefleet.platform.settings import Settings, get_settings
from tunefleet.platform.spec import JobSpec
from tunefleet.platform.status import JobStatus

__all__ = ["JobSpec", "JobStatus", "Settings", "get_settings"]
