"""Running ORM work from async views without a single-thread bottleneck.

Django's default `sync_to_async` funnels every call through one thread; a
request waiting on a row lock would stall every other stream. `db()` runs the
call on a bounded pool instead, tidies the thread's connection around it, and
sends the channel-layer announcements the call committed from the event loop.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache, partial
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections

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
        return await sync_to_async(partial(_tidy, outbox, fn, *args, **kwargs), thread_sensitive=False, executor=_pool())()
    finally:
        await events.deliver(outbox)
