"""Messages on the channel layer. They carry news, never truth: a listener that
misses one re-reads the database (see streaming.RequestListener).

Services announce with `announce_on_commit`, so nothing is said about rows that
were rolled back. Inside `aio.db()` the announcements are collected in an
outbox and sent by the event loop after the call returns (no thread hop back
into the loop); elsewhere (Celery, management commands) they are sent at once.
"""
from __future__ import annotations

import contextvars

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

Outbox = list[tuple[str, dict]]
_outbox: contextvars.ContextVar[Outbox | None] = contextvars.ContextVar("elephant_outbox", default=None)


def request_group(public_id: str) -> str:
    return f"req.{public_id}"


def queue_group(model_id: int) -> str:
    return f"queue.{model_id}"


def host_group(host_id: int) -> str:
    """A host's own long-polls: woken when routing offers it a job."""
    return f"host.{host_id}"


def _send_now(group: str, message: dict) -> None:
    layer = get_channel_layer()
    if layer is not None:
        async_to_sync(layer.group_send)(group, message)


def announce_on_commit(group: str, message: dict) -> None:
    """Send after the surrounding transaction commits, so readers find the rows."""
    outbox = _outbox.get()
    if outbox is not None:
        transaction.on_commit(lambda: outbox.append((group, message)))
    else:
        transaction.on_commit(lambda: _send_now(group, message))


def collecting(outbox: Outbox) -> contextvars.Token:
    return _outbox.set(outbox)


def stop_collecting(token: contextvars.Token) -> None:
    _outbox.reset(token)


async def deliver(outbox: Outbox) -> None:
    layer = get_channel_layer()
    for group, message in outbox:
        await layer.group_send(group, message)
