"""Messages on the channel layer. They carry news, never truth: a listener that
misses one re-reads PostgreSQL (see streaming.RequestListener)."""
from __future__ import annotations

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction


def request_group(public_id: str) -> str:
    return f"req.{public_id}"


def queue_group(model_id: int) -> str:
    return f"queue.{model_id}"


def _send(group: str, message: dict) -> None:
    layer = get_channel_layer()
    if layer is not None:
        async_to_sync(layer.group_send)(group, message)


def announce_on_commit(group: str, message: dict) -> None:
    """Send after the surrounding transaction commits, so readers find the rows."""
    transaction.on_commit(lambda: _send(group, message))
