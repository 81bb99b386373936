"""Relaying a request's text from the hosts to the customer as it arrives.

A `RequestListener` joins the request's channel-layer group *before* the
request is queued, then yields events. Channel messages say "text at offset
N"; the listener emits exactly the characters it has not sent yet, and when a
message is missing (a gap, a lost message, a silent second) it re-reads the
request row, which is the truth. So the customer gets every character once,
in order, whichever process the host talked to.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from channels.layers import get_channel_layer
from django.conf import settings

from marketplace import selectors, services
from marketplace.aio import db
from marketplace.errors import ApiError
from marketplace.events import request_group
from marketplace.models import Request

POLL_SECONDS = 1.0


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Ended:
    request: Request


class RequestListener:
    def __init__(self, public_id: str) -> None:
        self.public_id = public_id
        self.sent = 0
        self._layer = get_channel_layer()
        self._channel = ""

    async def open(self) -> RequestListener:
        self._channel = await self._layer.new_channel()
        await self._layer.group_add(request_group(self.public_id), self._channel)
        return self

    async def close(self) -> None:
        if self._channel:
            await self._layer.group_discard(request_group(self.public_id), self._channel)
            self._channel = ""

    async def _next_message(self, timeout: float) -> dict | None:
        try:
            return await asyncio.wait_for(self._layer.receive(self._channel), timeout=timeout)
        except asyncio.TimeoutError:
            return None

    def _unsent(self, offset: int, text: str) -> str:
        """The part of `text` (which starts at `offset`) not yet sent, if contiguous."""
        if offset > self.sent:
            return ""
        return text[self.sent - offset :]

    async def _catch_up(self) -> tuple[Request, str]:
        request = await db(selectors.request_state, public_id=self.public_id)
        missing = request.delivered_text[self.sent :] if request.delivered_chars > self.sent else ""
        return request, missing

    async def events(self, *, queued_at: float) -> AsyncIterator[Text | Ended]:
        """Text as it arrives, then one Ended carrying the final request row."""
        deadline = queued_at + settings.QUEUE_TIMEOUT_SECONDS
        claimed = False
        while True:
            wait = POLL_SECONDS if claimed else max(0.0, min(POLL_SECONDS, deadline - time.monotonic()))
            message = await self._next_message(wait)
            kind = message["type"] if message else None
            if kind == "job.tokens":
                claimed = True
                fresh = self._unsent(message["offset"], message["text"])
                if message["offset"] <= self.sent:
                    if fresh:
                        self.sent += len(fresh)
                        yield Text(fresh)
                    continue
            elif kind == "job.claimed":
                claimed = True
                continue
            request, missing = await self._catch_up()
            if missing:
                self.sent += len(missing)
                yield Text(missing)
            if request.status in (Request.Status.COMPLETED, Request.Status.FAILED):
                yield Ended(request)
                return
            if request.status == Request.Status.RUNNING:
                claimed = True
            elif time.monotonic() >= deadline and await db(services.request_expire_unclaimed, request_id=request.pk):
                claimed = True  # loop once more to read the failed row


def ended_error(request: Request) -> ApiError:
    """The honest error for a request that ended without a whole answer."""
    status = 504 if request.error_code == "queue_timeout" else 502
    return ApiError(status, request.error_message or "The request failed.", code=request.error_code or "failed", type="server_error")
