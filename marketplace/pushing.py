"""Token batches from many hosts share trips to the database (group commit).

Each push alone would cost a hand-off to a database thread, a statement and a commit. Here
one writer per event loop takes every batch that arrived while its previous trip was under
way and applies them together (`services.job_push_many`: one statement on PostgreSQL, one
transaction on SQLite), with at most MAX_TRIPS trips under way. A lone batch goes at once, so a quiet gateway adds no delay; a busy
one sends bigger trips instead of queueing more of them. Each caller still gets its own
batch's answer or refusal, exactly as if it had been applied alone; both host doors (the
WebSocket and `POST /hosts/api/jobs/<id>/tokens`) go through here.
"""
from __future__ import annotations

import asyncio
import weakref

from django.db import connection

from core.db import db
from core.errors import DomainError
from hosts.models import Host
from marketplace import services

MAX_PUSHES_PER_TRIP = 200  # bounds one statement's size (each push is at most MAX_BATCH_CHARS)
# Trips under way at once. On PostgreSQL several, so one waiting on a row lock does not hold
# up every host; SQLite lets one writer in at a time anyway, so one trip, as big as it gets.
MAX_TRIPS = {"postgresql": 4}


class PushWriter:
    def __init__(self) -> None:
        self._waiting: list[tuple[services.Push, asyncio.Future]] = []
        self._trips = 0

    async def push(self, push: services.Push) -> services.PushResult:
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((push, future))
        if self._trips < MAX_TRIPS.get(connection.vendor, 1):
            self._trips += 1
            asyncio.ensure_future(self._drain())
        result = await future
        if isinstance(result, DomainError):
            raise result
        return result

    async def _drain(self) -> None:
        try:
            while self._waiting:
                taken = self._waiting[:MAX_PUSHES_PER_TRIP]
                del self._waiting[:MAX_PUSHES_PER_TRIP]
                try:
                    results: list = await db(services.job_push_many, [push for push, _ in taken])
                except Exception as error:  # noqa: BLE001 - every caller of the trip hears of it
                    results = [error] * len(taken)
                for (_, future), result in zip(taken, results, strict=True):
                    if future.done():  # its caller went away (a closed connection)
                        continue
                    if isinstance(result, Exception) and not isinstance(result, DomainError):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        finally:
            self._trips -= 1


_writers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, PushWriter] = weakref.WeakKeyDictionary()


async def push_tokens(
    *, host: Host, job_id: int, seq: int, text: str, logprobs: list[dict] | None = None, finish_reason: str = "",
) -> services.PushResult:
    """Apply one batch through this event loop's writer; raises the batch's refusal."""
    loop = asyncio.get_running_loop()
    writer = _writers.get(loop)
    if writer is None:
        writer = _writers[loop] = PushWriter()
    return await writer.push(services.Push(host=host, job_id=job_id, seq=seq, text=text, logprobs=logprobs,
                                           finish_reason=finish_reason))
