"""Relaying a request's text from the hosts to the customer as it arrives.

A `RequestListener` joins the request's channel-layer group *before* the
request is queued, then yields events. Channel messages say "text at offset
N"; the listener emits exactly the characters it has not sent yet, and when a
message is missing (a gap, a lost message, a silent second) it re-reads the
request row, which is the truth. So the customer gets every character once,
in order, whichever process the host talked to.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from channels.layers import get_channel_layer

from catalog.models import CatalogModel
from catalog.tokenizer import Tokenizer
from core.db import db
from core.events import Inbox, request_group
from marketplace import selectors, services
from marketplace.lifecycle.errors import RequestEnded, request_ended
from marketplace.logprobs import entries_starting, located
from marketplace.models import Request

POLL_SECONDS = 1.0


@dataclass(frozen=True)
class Text:
    text: str
    logprobs: list[dict] | None = None  # the entries of the tokens that start in it, when asked for


@dataclass(frozen=True)
class Ended:
    request: Request


class RequestListener:
    def __init__(self, public_id: str, *, resume_at: int | None = None) -> None:
        """`resume_at`: a customer re-attaching from that character (it has the rest).

        `stops` (set once the request is admitted): the customer's stop sequences, which the
        gateway enforces whatever the host does — text is held back while it could still
        become a stop sequence, and nothing from the first one on is relayed."""
        self.public_id = public_id
        self.received = self.sent = resume_at or 0  # characters read from the request; relayed to the customer
        self.stops: list[str] = []
        self._resumed = resume_at is not None
        self.model: CatalogModel | None = None  # the request's model as last read: a fallback may change it
        self.token_limit: int | None = None  # at most this many tokens are relayed (max_tokens and the count's slack)
        self.tokenizer: Tokenizer | None = None
        self.logprobs = False  # the request asked for log-probabilities: Text carries its tokens' entries
        self._entries: list[tuple[int, dict]] = []  # received entries not handed out yet, with their offsets
        self._relayed, self._piece_tokens = "", 0
        self._layer = get_channel_layer()
        self._channel = ""
        self._inbox: Inbox | None = None

    async def open(self) -> RequestListener:
        self._channel = await self._layer.new_channel()
        await self._layer.group_add(request_group(self.public_id), self._channel)
        self._inbox = Inbox(self._layer, self._channel)
        return self

    async def close(self) -> None:
        if self._inbox is not None:
            self._inbox.close()
            self._inbox = None
        if self._channel:
            await self._layer.group_discard(request_group(self.public_id), self._channel)
            self._channel = ""

    def _unsent(self, offset: int, text: str) -> str:
        """The part of `text` (which starts at `offset`) not yet read, if contiguous."""
        if offset > self.received:
            return ""
        return text[self.received - offset :]

    async def _catch_up(self) -> tuple[Request, str]:
        request, text, entries = await db(
            selectors.request_catch_up_entries, public_id=self.public_id, sent=self.received, logprobs=self.logprobs
        )
        self._entries += entries
        return request, text

    def _text(self, out: str) -> Text:
        """`out`, the next characters relayed (from `sent`), with its tokens' entries when asked for."""
        if not self.logprobs:
            return Text(out)
        start, end = self.sent, self.sent + len(out)
        entries = entries_starting(self._entries, start, end)
        self._entries = [(at, entry) for at, entry in self._entries if at >= end]
        return Text(out, entries)

    async def events(self) -> AsyncIterator[Text | Ended]:
        """Text as it arrives, cut at the first stop sequence, then one Ended."""
        held, stopped = "", False
        keep = max((len(stop) for stop in self.stops), default=1) - 1
        async for event in self._arrivals():
            if isinstance(event, Ended):
                if held and not stopped:
                    text = self._text(held)
                    self.sent += len(held)
                    yield text
                yield event
                return
            if stopped:
                continue  # the host went on past a stop sequence: nothing of it is relayed
            held += event.text
            cut = services.stop_at(held, self.stops)
            if cut is not None:
                out, held, stopped = held[:cut], "", True
            else:
                out, held = (held[: len(held) - keep], held[len(held) - keep :]) if keep else (held, "")
            if out and self.token_limit is not None:
                out, over = self._within_token_limit(out)
                stopped = stopped or over
            if out:
                text = self._text(out)
                self.sent += len(out)
                yield text

    def _within_token_limit(self, out: str) -> tuple[str, bool]:
        """`out`, cut where the text relayed so far would pass `token_limit` tokens (a host
        past `max_tokens`, or an honest one whose tokens spell more when counted again: the answer
        then settles cut there, `length`), and whether it was
        cut. Nothing is counted while the text has fewer characters than the limit (a token
        is at least one); then the text so far once and each new piece alone (about as many
        tokens as together, so cheaply), and once that estimate passes three quarters of
        the limit the whole text is counted each time, and the cut found by bisection."""
        assert self.token_limit is not None and self.tokenizer is not None
        limit, before = self.token_limit, self._relayed
        self._relayed += out
        if len(self._relayed) <= limit:
            return out, False
        counted = self._piece_tokens  # the pieces' tokens counted apart (0: not counting yet)
        self._piece_tokens = (
            counted + self.tokenizer.count(out, special=False)
            if counted
            else self.tokenizer.count(self._relayed, special=False)
        )
        if self._piece_tokens <= limit * 3 // 4 or self.tokenizer.count(self._relayed, special=False) <= limit:
            return out, False
        low, high = 0, len(out)  # the longest prefix of `out` that keeps the text within the limit
        while low < high:
            middle = (low + high + 1) // 2
            if self.tokenizer.count(before + out[:middle], special=False) <= limit:
                low = middle
            else:
                high = middle - 1
        self._relayed = before + out[:low]
        return out[:low], True

    async def _arrivals(self) -> AsyncIterator[Text | Ended]:
        """Text as it arrives, then one Ended carrying the final request row.

        A quiet second (no message) triggers a re-read and this request's own
        watchdog check (queue timeout, stalled host → continuation), so a stream
        is never left waiting on a dead host, even with no Celery beat running.
        """
        catch_up_now = self._resumed  # a resumed stream reads what it missed at once
        message: dict | None
        while True:
            assert self._inbox is not None, "open() the listener first"
            if catch_up_now:
                catch_up_now, message = False, {"type": "resume"}
            else:
                message = await self._inbox.next(POLL_SECONDS)
            kind = message["type"] if message else None
            if kind == "job.tokens" and message is not None and message["offset"] <= self.received:
                fresh = self._unsent(message["offset"], message["text"])
                if fresh and self.logprobs and message.get("logprobs"):
                    self._entries += [
                        (at, entry)
                        for at, entry in located(message["offset"], message["logprobs"])
                        if at >= self.received
                    ]
                if fresh:
                    self.received += len(fresh)
                    yield Text(fresh)
                continue
            if kind in ("job.claimed", "job.resumed"):
                continue
            request, missing = await self._catch_up()
            self.model = request.model
            if missing:
                self.received += len(missing)
                yield Text(missing)
            if request.status in (Request.Status.COMPLETED, Request.Status.FAILED):
                yield Ended(request)
                return
            if request.left_at is not None:  # another of its connections went away: this one is still here
                await db(services.request_listener_here, request_id=request.pk)
            if message is None:
                await db(services.request_watch, request_id=request.pk)


def ended_error(request: Request) -> RequestEnded:
    """The honest error for a request that ended without a whole answer (its code's status
    and type: `marketplace.lifecycle.errors`)."""
    return request_ended(request.error_code, request.error_message)
