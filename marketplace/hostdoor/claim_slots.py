"""A host's long-polls that wait for a job, counted where every gateway process sees them.

A host may hold at most its claim cap of long-polls at once (`Host.claim_cap`); more are
refused (429 `too_many_claims`). With several gateway processes (`WORKERS=N`, Redis configured),
one process's count would let a host hold N × cap: so each waiting long-poll is an entry in a
Redis sorted set per host, scored by when it lapses (its `wait` and a margin). A process that
dies with long-polls open leaves entries that lapse on their own. Without Redis there is one
gateway process, and a dictionary is the count."""

from __future__ import annotations

import logging
import time
import uuid

from django.conf import settings

log = logging.getLogger(__name__)

MARGIN_S = 30.0  # an entry outlives its long-poll's `wait` by this much, then lapses


class WaitingClaims:
    def __init__(self) -> None:
        self._local: dict[int, int] = {}

    @staticmethod
    def _key(host_id: int) -> str:
        return f"elephant:claims-waiting:{host_id}"

    async def enter(self, host_id: int, *, cap: int, wait: float) -> str | None:
        """A ticket for one more waiting long-poll, or None when the host already holds `cap`."""
        if settings.REDIS_URL:
            from redis.exceptions import RedisError

            try:
                return await self._enter_shared(host_id, cap=cap, wait=wait)
            except (RedisError, OSError) as exc:  # counted in this process alone, then
                log.warning("Redis unreachable; counting host %s's long-polls in this process: %s", host_id, exc)
        if self._local.get(host_id, 0) >= cap:
            return None
        self._local[host_id] = self._local.get(host_id, 0) + 1
        return ""

    async def leave(self, host_id: int, ticket: str) -> None:
        if ticket:
            from redis.exceptions import RedisError

            try:
                await self._leave_shared(host_id, ticket)
            except (RedisError, OSError):  # the entry lapses on its own
                log.warning("Redis unreachable; host %s's long-poll entry will lapse by itself", host_id)
            return
        self._local[host_id] -= 1
        if not self._local[host_id]:
            del self._local[host_id]

    async def held(self, host_id: int) -> int:
        """How many long-polls of this host are waiting now, in every process."""
        if settings.REDIS_URL:
            async with self._redis() as redis:
                await redis.zremrangebyscore(self._key(host_id), "-inf", time.time())
                return int(await redis.zcard(self._key(host_id)))
        return self._local.get(host_id, 0)

    @staticmethod
    def _redis():  # noqa: ANN205 (redis.asyncio.Redis): one connection per call; event loops come and go
        from redis import asyncio as aioredis

        return aioredis.from_url(settings.REDIS_URL)

    async def _enter_shared(self, host_id: int, *, cap: int, wait: float) -> str | None:
        ticket, key, now = uuid.uuid4().hex, self._key(host_id), time.time()
        async with self._redis() as redis:
            async with redis.pipeline(transaction=True) as pipe:
                pipe.zremrangebyscore(key, "-inf", now)
                pipe.zadd(key, {ticket: now + wait + MARGIN_S})
                pipe.zcard(key)
                pipe.expire(key, int(wait + MARGIN_S) + 1)
                held = (await pipe.execute())[2]
            if held > cap:  # over: give the place back (two racing polls may both be refused; one retries)
                await redis.zrem(key, ticket)
                return None
        return ticket

    async def _leave_shared(self, host_id: int, ticket: str) -> None:
        async with self._redis() as redis:
            await redis.zrem(self._key(host_id), ticket)


WAITING = WaitingClaims()
