"""The channel-layer inbox that long-polls and streams wait on."""

from __future__ import annotations

import asyncio

from channels.layers import InMemoryChannelLayer

from core.events import Inbox


class FailingLayer:
    async def receive(self, channel: str) -> dict:
        raise ConnectionError("redis is down")


class InboxTests:
    def test_it_returns_none_on_a_quiet_timeout_and_keeps_the_receive_for_the_next_wait(self) -> None:
        async def scenario() -> list[dict | None]:
            layer = InMemoryChannelLayer()
            channel = await layer.new_channel()
            inbox = Inbox(layer, channel)
            quiet = await inbox.next(0.05)
            pending = inbox._pending
            await layer.send(channel, {"type": "job.claimed"})
            woken = await inbox.next(1.0)
            assert pending is not None and pending.done(), "the same receive should have carried the message"
            inbox.close()
            return [quiet, woken]

        assert asyncio.run(scenario()) == [None, {"type": "job.claimed"}]

    def test_it_reads_a_failed_receive_as_no_message(self) -> None:
        async def scenario() -> dict | None:
            inbox = Inbox(FailingLayer(), "specific.x!y")
            return await inbox.next(1.0)

        assert asyncio.run(scenario()) is None

    def test_it_cancels_the_pending_receive_on_close_without_waiting_for_it(self) -> None:
        async def scenario() -> bool:
            layer = InMemoryChannelLayer()
            inbox = Inbox(layer, await layer.new_channel())
            await inbox.next(0.01)
            pending = inbox._pending
            inbox.close()
            await asyncio.sleep(0)
            return pending is not None and pending.cancelled() and inbox._pending is None

        assert asyncio.run(scenario())
