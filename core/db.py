"""Running ORM work from async views without a single-thread bottleneck.

Django's default `sync_to_async` funnels every call through one thread; a
request waiting on a row lock would stall every other stream. `db()` runs the
call on a bounded pool instead, tidies the thread's connection around it, and
sends the channel-layer announcements the call committed from the event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections, connection, models

from core import events

T = TypeVar("T")


@lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=settings.DB_THREADS, thread_name_prefix="db")


def _tidy(outbox: events.Outbox, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    close_old_connections()
    token = events.collecting(outbox)
    try:
        return fn(*args, **kwargs)
    finally:
        events.stop_collecting(token)
        close_old_connections()


async def db(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    outbox: events.Outbox = []
    try:
        return await sync_to_async(
            partial(_tidy, outbox, fn, *args, **kwargs), thread_sensitive=False, executor=_pool()
        )()
    finally:
        await events.deliver(outbox)


# --- statement chains -----------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One statement of a chain, ending `RETURNING id`. It may read the ids of earlier
    steps named in `reads` as `<name>.id`, through a `{sources}` FROM list the chain fills."""

    name: str
    sql: str
    params: list
    reads: tuple[str, ...] = ()


class ChainMissed(Exception):
    """A step of a chain returned no row (a compare-and-set refused): roll back."""


def chain_run(steps: list[Step]) -> dict[str, int]:
    """Run `steps` and return each one's id. On PostgreSQL the chain is one statement (a
    WITH of data-modifying CTEs: one round trip); elsewhere its steps run in order, each
    reading the earlier ids as literals. Raises ChainMissed when any step returned no row;
    the caller's transaction must then roll back (on PostgreSQL the other steps ran)."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            ctes = ", ".join(
                f"{step.name} AS ({step.sql.replace('{sources}', ', '.join(step.reads))})" for step in steps
            )
            names = [step.name for step in steps]
            cursor.execute(
                f"WITH {ctes} SELECT {', '.join(f'{name}.id' for name in names)} FROM {', '.join(names)}",
                [param for step in steps for param in step.params],
            )
            row = cursor.fetchone()
            if row is None:
                raise ChainMissed(names)
            return dict(zip(names, row, strict=True))
        ids: dict[str, int] = {}
        for step in steps:
            sources = ", ".join(f"(SELECT %s AS id) AS {name}" for name in step.reads)
            cursor.execute(step.sql.replace("{sources}", sources), [*step.params, *(ids[name] for name in step.reads)])
            row = cursor.fetchone()
            if row is None:
                raise ChainMissed(step.name)
            ids[step.name] = row[0]
        return ids


def insert_step(name: str, instance: models.Model, *, refs: dict[str, str] | None = None) -> Step:
    """An INSERT of an unsaved model instance as a chain step: every concrete column but
    the primary key, prepared by its own field (defaults, `auto_now_add`, JSON), except
    the `refs` columns, which take an earlier step's id (`{"request_id": "request"}`)."""
    refs = refs or {}
    meta = instance._meta
    quote = connection.ops.quote_name
    columns, values, params = [], [], []
    for field in meta.concrete_fields:
        if field.primary_key:
            continue
        assert field.column is not None  # a concrete field has its column
        columns.append(quote(field.column))
        if field.attname in refs:
            values.append(f"{refs[field.attname]}.id")
            continue
        values.append("%s")
        params.append(field.get_db_prep_save(field.pre_save(instance, True), connection))
    reads = tuple(dict.fromkeys(refs.values()))
    tail = " FROM {sources}" if reads else ""
    sql = f"INSERT INTO {quote(meta.db_table)} ({', '.join(columns)}) SELECT {', '.join(values)}{tail} RETURNING id"
    return Step(name=name, sql=sql, params=params, reads=reads)
