"""Tenants and API keys. A key is shown once; only its SHA-256 is stored, and the
``tf-XXXXXXXX`` prefix identifies it in listings and logs."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from tunefleet.platform import audit
from tunefleet.platform.audit import Actor
from tunefleet.platform.db import ApiKey, InferenceBucket, Job, Tenant, now_s
from tunefleet.platform.errors import Conflict, InvalidRequest, NotFound, Unauthenticated
from tunefleet.platform.ids import new_id
from tunefleet.platform.status import ACTIVE

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
PREFIX_LEN = 11  # "tf-" + 8
# What create_key makes ("tf-" and URL-safe characters); anything else is refused before
# it reaches the database (which cannot even compare some strings, e.g. with NUL).
_KEY_RE = re.compile(r"tf-[A-Za-z0-9_-]{8,128}")


@dataclass(frozen=True)
class Principal:
    """Who is calling: the tenant every query is scoped to, and whether admin routes open."""

    tenant_id: str
    tenant_name: str
    key_id: str
    is_admin: bool
    max_gpus: int = 0
    max_waiting_jobs: int = 100
    # the tenant's own inference limits; None: the operator's defaults
    inference_requests_per_s: float | None = None
    inference_concurrent_requests: int | None = None


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def create_tenant(
    session: Session,
    name: str,
    *,
    max_concurrent_jobs: int = 4,
    max_gpus: int = 8,
    max_waiting_jobs: int = 100,
    inference_requests_per_s: float | None = None,
    inference_concurrent_requests: int | None = None,
    actor: Actor | None = None,
) -> Tenant:
    """A new tenant; recorded in the audit log as ``actor``'s act when given."""
    check_tenant_name(name, param="name")
    if session.scalar(select(Tenant).where(Tenant.name == name)) is not None:
        raise Conflict(f"tenant {name!r} already exists", param="name")
    tenant = Tenant(
        id=new_id("tenant"),
        name=name,
        created_at=now_s(),
        max_concurrent_jobs=max_concurrent_jobs,
        max_gpus=max_gpus,
        max_waiting_jobs=max_waiting_jobs,
        inference_requests_per_s=inference_requests_per_s,
        inference_concurrent_requests=inference_concurrent_requests,
    )
    session.add(tenant)
    session.flush()
    if actor is not None:
        audit.record(
            session,
            actor,
            "tenant.create",
            target_type="tenant",
            target_id=tenant.id,
            tenant_id=tenant.id,
            after={"name": name, **_quotas(tenant)},
        )
    return tenant


def check_tenant_name(name: str, *, param: str) -> None:
    """Raise 400 unless ``name`` is a well-formed tenant name (request parameter ``param``)."""
    if not _NAME_RE.match(name):
        raise InvalidRequest(
            f"tenant name {name!r} is invalid; use 1-63 lowercase letters, digits and '-'",
            param=param,
        )


def _quotas(tenant: Tenant) -> dict[str, float | None]:
    return {name: getattr(tenant, name) for name in (*QUOTAS, *INFERENCE_LIMITS)}


def create_key(
    session: Session,
    tenant_id: str,
    *,
    name: str = "",
    is_admin: bool = False,
    actor: Actor | None = None,
) -> tuple[ApiKey, str]:
    """A new key row and the plaintext key, which is not stored and cannot be shown again;
    recorded in the audit log as ``actor``'s act when given (never the key itself)."""
    plaintext = "tf-" + secrets.token_urlsafe(32).replace("-", "x").replace("_", "y")
    key = ApiKey(
        id=new_id("key"),
        tenant_id=tenant_id,
        name=name,
        prefix=plaintext[:PREFIX_LEN],
        secret_hash=_hash(plaintext),
        is_admin=is_admin,
        created_at=now_s(),
    )
    session.add(key)
    session.flush()
    if actor is not None:
        audit.record(
            session,
            actor,
            "key.create",
            target_type="api_key",
            target_id=key.id,
            tenant_id=tenant_id,
            after={"name": name, "admin": is_admin, "prefix": key.prefix},
        )
    return key, plaintext


# Verified keys, briefly remembered so a busy client costs no database round trip per
# request. A revoked key stops working in this process at once (``forget_keys``) and in
# other API processes within AUTH_CACHE_TTL_S.
AUTH_CACHE_TTL_S = 5.0
_AUTH_CACHE: dict[str, tuple[float, Principal]] = {}
_AUTH_CACHE_MAX = 10_000


def forget_keys() -> None:
    _AUTH_CACHE.clear()


def authenticate(session: Session, authorization: str | None) -> Principal:
    """Resolve an ``Authorization: Bearer tf-...`` header to a principal, or raise 401."""
    if not authorization or not authorization.lower().startswith("bearer "):
        raise Unauthenticated(
            "missing API key; send 'Authorization: Bearer tf-...' (create one with "
            "`tunefleet admin create-key`)"
        )
    token = authorization[7:].strip()
    if not _KEY_RE.fullmatch(token):
        shown = repr(token[:PREFIX_LEN]) + ("..." if len(token) > PREFIX_LEN else "")
        raise Unauthenticated(
            f"API key {shown} is not a TuneFleet key; keys look like 'tf-' followed by "
            "43 letters and digits (create one with `tunefleet admin create-key`)"
        )
    digest = _hash(token)
    cached = _AUTH_CACHE.get(digest)
    if cached is not None and cached[0] > time.monotonic():
        return cached[1]
    key = session.scalar(select(ApiKey).where(ApiKey.prefix == token[:PREFIX_LEN]))
    if (
        key is None
        or key.revoked_at is not None
        or not hmac.compare_digest(key.secret_hash, digest)
    ):
        shown = token[:PREFIX_LEN] + "..." if len(token) > PREFIX_LEN else "(short key)"
        raise Unauthenticated(f"API key {shown} is not valid or was revoked")
    principal = _principal(session, key)
    if len(_AUTH_CACHE) >= _AUTH_CACHE_MAX:
        _AUTH_CACHE.clear()
    _AUTH_CACHE[digest] = (time.monotonic() + AUTH_CACHE_TTL_S, principal)
    return principal


def principal_for_key(session: Session, key_id: str) -> Principal:
    """The principal of the key with id ``key_id``, read afresh (no cache: a revoked key
    fails at once), or 401. For callers that hold a key's id rather than its secret, such
    as a dashboard session (``tunefleet.api.ui``)."""
    key = session.get(ApiKey, key_id)
    if key is None or key.revoked_at is not None:
        raise Unauthenticated(f"API key {key_id!r} is not valid or was revoked; sign in again")
    return _principal(session, key)


def _principal(session: Session, key: ApiKey) -> Principal:
    tenant = session.get(Tenant, key.tenant_id)
    assert tenant is not None  # FK
    return Principal(
        tenant_id=tenant.id,
        tenant_name=tenant.name,
        key_id=key.id,
        is_admin=key.is_admin,
        max_gpus=tenant.max_gpus,
        max_waiting_jobs=tenant.max_waiting_jobs,
        inference_requests_per_s=tenant.inference_requests_per_s,
        inference_concurrent_requests=tenant.inference_concurrent_requests,
    )


def ensure_bootstrap_tenant(session: Session, name: str = "default") -> str | None:
    """First start: create tenant ``name`` with an admin key and return the plaintext key.
    Returns None when tenants already exist."""
    if session.scalar(select(Tenant.id).limit(1)) is not None:
        return None
    tenant = create_tenant(session, name)
    _, plaintext = create_key(session, tenant.id, name="bootstrap", is_admin=True)
    return plaintext


# -- administration (the admin REST routes and the dashboard's admin page) ------------------

QUOTAS = ("max_concurrent_jobs", "max_gpus", "max_waiting_jobs")
# Quotas that may be None: the operator's default (settings) applies.
INFERENCE_LIMITS = ("inference_requests_per_s", "inference_concurrent_requests")


def get_tenant(session: Session, tenant_id: str) -> Tenant:
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        raise NotFound(f"no tenant with id {tenant_id!r}", param="tenant_id")
    return tenant


def active_jobs_by_tenant(session: Session) -> dict[str, int]:
    """How many jobs each tenant has that are not finished."""
    rows = session.execute(
        select(Job.tenant_id, func.count()).where(Job.status.in_(ACTIVE)).group_by(Job.tenant_id)
    )
    return {tenant_id: count for tenant_id, count in rows.tuples()}


def set_quotas(
    session: Session, tenant_id: str, *, actor: Actor | None = None, **quotas: float | None
) -> Tenant:
    """Change a tenant's ``QUOTAS`` and ``INFERENCE_LIMITS`` (those given; None for an
    inference limit: the operator's default again); its keys' cached principals, which
    carry the old ones, are forgotten. A changed inference rate starts the tenant's bucket
    afresh: the arrival time it holds was paced at the old rate (after a change from 1 to
    20 requests/s it would refuse the first second of the new rate's burst). Recorded, with
    the quotas before and after, as ``actor``'s act when given."""
    known = (*QUOTAS, *INFERENCE_LIMITS)
    unknown = set(quotas) - set(known)
    if unknown:
        raise InvalidRequest(f"{sorted(unknown)} are not quotas; use {', '.join(known)}")
    for name in QUOTAS:
        if name in quotas and quotas[name] is None:
            raise InvalidRequest(f"{name} must be a number, not null", param=name)
    tenant = get_tenant(session, tenant_id)
    before = _quotas(tenant)
    for name, value in quotas.items():
        setattr(tenant, name, value)
    if "inference_requests_per_s" in quotas and tenant.inference_requests_per_s != before.get(
        "inference_requests_per_s"
    ):
        session.execute(delete(InferenceBucket).where(InferenceBucket.tenant_id == tenant.id))
    session.flush()
    forget_keys()
    if actor is not None:
        audit.record(
            session,
            actor,
            "tenant.quotas",
            target_type="tenant",
            target_id=tenant.id,
            tenant_id=tenant.id,
            before=before,
            after=_quotas(tenant),
        )
    return tenant


def revoke_key(session: Session, key_id: str, *, actor: Actor | None = None) -> ApiKey:
    """Revoke a key (again: no change); it stops working in this process at once, in
    other API processes within ``AUTH_CACHE_TTL_S``, and dashboard sessions that name it
    end at their next request. Recorded as ``actor``'s act when given."""
    key = session.get(ApiKey, key_id)
    if key is None:
        raise NotFound(f"no API key with id {key_id!r}", param="key_id")
    before = {"revoked_at": key.revoked_at}
    key.revoked_at = key.revoked_at or now_s()
    session.flush()
    forget_keys()
    if actor is not None:
        audit.record(
            session,
            actor,
            "key.revoke",
            target_type="api_key",
            target_id=key.id,
            tenant_id=key.tenant_id,
            before=before,
            after={"revoked_at": key.revoked_at},
        )
    return key
