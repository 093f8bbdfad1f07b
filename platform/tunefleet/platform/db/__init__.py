"""Database models and sessions."""

from tunefleet.platform.db.models import (
    Adapter,
    AdapterShare,
    ApiKey,
    Base,
    Checkpoint,
    ControllerLease,
    EndedUiSession,
    File,
    Job,
    JobEvent,
    Tenant,
    now_s,
)
from tunefleet.platform.db.session import (
    get_engine,
    session_factory,
    session_scope,
    single_statement_sessions,
)

__all__ = [
    "Adapter",
    "AdapterShare",
    "ApiKey",
    "Base",
    "Checkpoint",
    "ControllerLease",
    "EndedUiSession",
    "File",
    "Job",
    "JobEvent",
    "Tenant",
    "get_engine",
    "now_s",
    "session_factory",
    "session_scope",
    "single_statement_sessions",
]
