"""The database: its tables (``_models``) and its engines and sessions (``_session``),
re-exported here. ``migrate`` (Alembic upgrades) and ``paging`` (cursor paging) are its
public modules."""

from tunefleet.platform.db._models import (
    Adapter,
    AdapterShare,
    ApiKey,
    AuditEntry,
    Base,
    Checkpoint,
    ControllerLease,
    EndedUiSession,
    File,
    InferenceBucket,
    InferenceLease,
    Job,
    JobEvent,
    Tenant,
    WebhookDelivery,
    WebhookEndpoint,
    now_s,
)
from tunefleet.platform.db._session import (
    get_engine,
    session_factory,
    session_scope,
    single_statement_sessions,
)

__all__ = [
    "Adapter",
    "AdapterShare",
    "ApiKey",
    "AuditEntry",
    "Base",
    "Checkpoint",
    "ControllerLease",
    "EndedUiSession",
    "File",
    "InferenceBucket",
    "InferenceLease",
    "Job",
    "JobEvent",
    "Tenant",
    "WebhookDelivery",
    "WebhookEndpoint",
    "get_engine",
    "now_s",
    "session_factory",
    "session_scope",
    "single_statement_sessions",
]
