"""Messages on the channel layer. They carry news, never truth: a listener that
misses one re-reads the database (see streaming.RequestListener).

Services announce with `announce_on_commit`, so nothing is said about rows that
were rolled back. Inside `aio.db()` the announcements are collected in an
outbox and sent by the event loop after the call returns (no thread hop back
into the loop); elsewhere (Celery, management commands) they are sent at once.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging

from asgiref.sync import async_to_sync
from channels.layers import BaseChannelLayer, get_channel_layer
from django.db import transaction

logger = logging.getLogger(__name__)

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
    """Send an outbox: each group's messages in order, the groups side by side (a trip that
    applied many hosts' batches announces to many requests without waiting on each in turn)."""
    layer = get_channel_layer()
    if len(outbox) == 1:
        await layer.group_send(*outbox[0])
        return
    by_group: dict[str, list[dict]] = {}
    for group, message in outbox:
        by_group.setdefault(group, []).append(message)

    async def send(group: str, messages: list[dict]) -> None:
        for message in messages:
            await layer.group_send(group, message)

    await asyncio.gather(*(send(group, messages) for group, messages in by_group.items()))


class Inbox:
    """A channel's messages, awaited with a timeout without cancelling the layer's receive.

    `asyncio.wait_for(layer.receive(...))` cancels the receive on every timeout, and on a
    busy machine channels-redis could take many seconds to unwind a cancelled receive,
    leaving a host's long-poll stuck well past its deadline. Here one receive stays
    pending across waits; `close()` cancels it once, without waiting for it.
    A failed receive (Redis unreachable, say) reads as "no message": messages are news,
    and every waiter re-reads the database on a quiet timeout anyway.
    """

    def __init__(self, layer: BaseChannelLayer, channel: str) -> None:
        self._layer = layer
        self._channel = channel
        self._pending: asyncio.Future | None = None

    async def next(self, timeout: float) -> dict | None:
        """The next message, or None when `timeout` seconds pass first."""
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._layer.receive(self._channel))
        done, _ = await asyncio.wait({self._pending}, timeout=timeout)
        if not done:
            return None
        task, self._pending = self._pending, None
        if task.exception() is not None:
            logger.warning("channel layer receive failed: %r", task.exception())
            return None
        return task.result()

    def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending.add_done_callback(lambda task: task.cancelled() or task.exception())
            self._pending = None
