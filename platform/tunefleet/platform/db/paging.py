"""Cursor pages (OpenAI's ``after``) in a total order: by a key, then the id, so that
pages neither skip nor repeat a row however many rows share a key."""

from __future__ import annotations

from typing import Any, TypeVar

from sqlalchemy import Select, SQLColumnExpression

_Query = TypeVar("_Query", bound=Select[Any])


def ordered_after(
    query: _Query,
    key: SQLColumnExpression[Any],
    ident: SQLColumnExpression[Any],
    anchor: tuple[Any, Any] | None,
    *,
    descending: bool = True,
) -> _Query:
    """``query`` ordered by (``key``, ``ident``), and past the row whose (key, id) is
    ``anchor`` when one is given."""
    if anchor is not None:
        at, at_id = anchor
        if descending:
            query = query.where((key < at) | ((key == at) & (ident < at_id)))
        else:
            query = query.where((key > at) | ((key == at) & (ident > at_id)))
    if descending:
        return query.order_by(key.desc(), ident.desc())
    return query.order_by(key, ident)
