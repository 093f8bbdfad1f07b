"""Request dependencies: settings, a database session, the calling principal."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import HTTPBearer
from sqlalchemy.orm import Session
from starlette.requests import HTTPConnection

from tunefleet.platform.artifacts import Store, artifact_store
from tunefleet.platform.db import session_factory, single_statement_sessions
from tunefleet.platform.models import ModelRegistry
from tunefleet.platform.settings import Settings
from tunefleet.platform.tenants import Principal, authenticate

# Where BodyLimitMiddleware leaves the principal it authenticated, in the ASGI scope.
PRINCIPAL_SCOPE_KEY = "tunefleet.principal"

# The dependencies are ``async def`` although they do no I/O of their own (or, for the
# key check, only on a cache miss): FastAPI runs sync dependencies in its thread pool, and
# five pool hops per request cost more than the work itself. They read the settings from
# the request rather than from a settings dependency: FastAPI solves a nested dependency
# again everywhere it appears, and the flat graph measured cheaper on the hot routes.


def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_settings_dep(request: Request) -> Settings:
    return _settings(request)


@contextmanager
def _request_session(factory: Callable[[], Session]) -> Iterator[Session]:
    """Open a session for one request; whatever it did not commit is rolled back."""
    session = factory()
    try:
        yield session
    finally:
        session.rollback()
        session.close()


async def get_session(request: Request) -> AsyncIterator[Session]:
    """A session per request. Routes commit what they write before they answer, so a
    client that reads right after a write sees it."""
    with _request_session(session_factory(_settings(request).resolved_database_url)) as session:
        yield session


async def get_statement_session(request: Request) -> AsyncIterator[Session]:
    """A session for routes that only read or write with one statement (see
    ``single_statement_sessions``): the hottest job routes."""
    url = _settings(request).resolved_database_url
    with _request_session(single_statement_sessions(url)) as session:
        yield session


def principal_for(settings: Settings, authorization: str | None) -> Principal:
    """The caller of a request with this ``Authorization`` header, or 401. Its own
    session, used only when the key is not in the cache (so a request does not hold two
    connections for long): key lookups are reads."""
    with single_statement_sessions(settings.resolved_database_url)() as session:
        return authenticate(session, authorization)


class _BearerScheme(HTTPBearer):
    """Puts the bearer scheme in the OpenAPI document (clients and the fuzz test read it
    there); the header itself is checked by ``get_principal``, with its own messages."""

    async def __call__(self, request: HTTPConnection) -> None:
        return None


_bearer = _BearerScheme(
    scheme_name="apiKey", description="A TuneFleet API key: `Authorization: Bearer tf-...`"
)


async def get_principal(request: Request, _: Annotated[None, Security(_bearer)]) -> Principal:
    # A request with a body was authenticated by BodyLimitMiddleware before its body was
    # read (FastAPI reads a body before it solves dependencies).
    known: Principal | None = request.scope.get(PRINCIPAL_SCOPE_KEY)
    if known is not None:
        return known
    return principal_for(_settings(request), request.headers.get("authorization"))


async def get_store(request: Request) -> Store:
    """The app's artifact store, made once (an object-storage client is worth keeping)."""
    store: Store | None = getattr(request.app.state, "artifact_store", None)
    if store is None:
        store = request.app.state.artifact_store = artifact_store(_settings(request))
    return store


async def get_registry(request: Request) -> ModelRegistry:
    return ModelRegistry(_settings(request).resolved_model_registry)


SessionDep = Annotated[Session, Depends(get_session)]
StatementSessionDep = Annotated[Session, Depends(get_statement_session)]
PrincipalDep = Annotated[Principal, Depends(get_principal)]
SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
StoreDep = Annotated[Store, Depends(get_store)]
RegistryDep = Annotated[ModelRegistry, Depends(get_registry)]
