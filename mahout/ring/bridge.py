"""The bridge: the ring's one client. It sends requests to the head and reads from the tail.

Nothing the bridge does sits in the data path between stages: hidden states pass from
agent to agent. The bridge only submits prompts (to the head) and receives sampled tokens,
request ends and stats (from the tail). If either link breaks, every open request fails
with `RingBroken`: a stage dying ends its requests honestly.
"""

from __future__ import annotations

import itertools
import queue
import threading
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from mahout.link import HEADERS_ONLY, Link, LinkClosed, LinkRefused, connect
from mahout.ring.keys import BRIDGE, BridgeKeys

__all__ = ["RingBridge", "RingBroken", "RingError", "RingRequest"]


HELLO = {"role": BRIDGE}
CAPS = HEADERS_ONLY  # what the bridge reads: tokens, ends, errors and stats, never a tensor


class RingError(RuntimeError):
    """The ring refused or failed a request."""


class RingBroken(RingError):
    """A link to the ring broke: a stage died or went away."""


class RingRequest:
    """One request's tokens as they arrive; iterate it to stream token ids. Asked for
    log-probabilities, `logprobs` holds each token's (``{"logprob", "top": [[id, logprob], ...]}``)."""

    def __init__(self, request_id: str) -> None:
        self.id = request_id
        self.tokens: list[int] = []
        self.logprobs: list[dict | None] = []
        self.finish_reason: str | None = None
        self._events: queue.Queue[tuple[str, Any]] = queue.Queue()

    def __iter__(self) -> Iterator[int]:
        while True:
            kind, value = self._events.get()
            if kind == "token":
                token, logprobs = value
                self.tokens.append(token)
                self.logprobs.append(logprobs)
                yield token
            elif kind == "done":
                self.finish_reason = value
                return
            else:
                raise (RingBroken if kind == "broken" else RingError)(value)

    def result(self) -> list[int]:
        """Wait for the end; return every token id (a stop token included, as engine.generate does)."""
        for _ in self:
            pass
        return self.tokens


class RingBridge:
    """Connects to the head and the tail of a running ring, each link with its own secret (`keys`)."""

    def __init__(
        self, head: tuple[str, int], tail: tuple[str, int], *, keys: BridgeKeys, timeout: float = 120.0
    ) -> None:
        tail_link = connect(tail, secret=keys.tail, hello=HELLO, caps=CAPS, timeout=timeout, name="tail")
        try:
            head_link = connect(head, secret=keys.head, hello=HELLO, caps=CAPS, timeout=timeout, name="head")
        except BaseException:
            tail_link.close()
            raise
        self._start(head_link, tail_link)

    @classmethod
    def over(cls, head: Link, tail: Link) -> RingBridge:
        """A bridge on links already dialled (with ``hello=HELLO``, the handshake passed) to the head
        and the tail."""
        bridge = cls.__new__(cls)
        bridge._start(head, tail)
        return bridge

    def _start(self, head: Link, tail: Link, welcome_timeout: float = 30.0) -> None:
        self._head, self._tail = head, tail
        try:
            for link in (tail, head):  # welcome: the tail knows where to send tokens before any request exists
                link.sock.settimeout(welcome_timeout)
                welcome, _ = link.recv()
                if welcome.get("type") != "welcome":  # e.g. refused: the session already has a bridge
                    raise LinkRefused(f"the ring's {link.name} refused the bridge: {welcome.get('message', welcome)}")
                link.sock.settimeout(None)
        except BaseException:
            head.close()
            tail.close()
            raise
        self._open: dict[str, RingRequest] = {}
        self._lock = threading.Lock()
        self._stats: queue.Queue[list[dict]] = queue.Queue()
        self._broken: str | None = None
        self.down = threading.Event()  # set once the ring broke (or the bridge left it)
        self.errors: list[dict[str, Any]] = []  # every error frame the tail handed over
        self._ids = itertools.count()
        for link in (self._tail, self._head):
            threading.Thread(target=self._read, args=(link,), name=f"bridge-{link.name}", daemon=True).start()

    @property
    def broken(self) -> str | None:
        """Why the ring broke, or None while it is whole."""
        return self._broken

    def submit(
        self,
        prompt_ids: Sequence[int],
        max_tokens: int,
        *,
        stop_ids: Sequence[int] = (),
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        request_id: str | None = None,
        logprobs: int | None = None,
        grammar: str | None = None,
        grammar_root: str = "root",
        heal: bytes | None = None,
    ) -> RingRequest:
        """Hand a prompt to the head; the request is in flight as soon as this returns. `heal`:
        the bytes its first tokens must write again (a cut last word the prompt was cut before,
        `scorer.healing.healing`)."""
        request = RingRequest(request_id or f"r{next(self._ids)}-{uuid.uuid4().hex[:8]}")
        with self._lock:
            if self._broken:
                raise RingBroken(self._broken)
            self._open[request.id] = request
        header = {
            "type": "submit",
            "request_id": request.id,
            "prompt_ids": list(prompt_ids),
            "max_tokens": max_tokens,
            "stop_ids": list(stop_ids),
            "temperature": temperature,
            "top_p": top_p,
            "seed": seed,
            "logprobs": logprobs,
            "grammar": grammar,
            "grammar_root": grammar_root,
            "heal": heal.hex() if heal else None,
        }
        try:
            self._head.send(header)
        except LinkClosed as exc:
            self._break(f"the ring's head is gone: {exc}")
        return request

    def cancel(self, request_id: str) -> None:
        """Stop generating for a request (its cache rows are freed around the ring)."""
        try:
            self._head.send({"type": "cancel", "request_id": request_id})
        except LinkClosed as exc:
            self._break(f"the ring's head is gone: {exc}")

    def stats(self, timeout: float = 30.0) -> list[dict]:
        """Every stage's hold/idle seconds and queue depth, collected hop by hop around the ring."""
        if self._broken:
            raise RingBroken(self._broken)
        try:
            self._head.send({"type": "stats", "stages": []})
        except LinkClosed as exc:
            self._break(f"the ring's head is gone: {exc}")
            raise RingBroken(str(exc)) from exc
        try:
            return self._stats.get(timeout=timeout)
        except queue.Empty:
            raise RingBroken(f"no stats came back within {timeout:.0f} s") from None

    def close(self) -> None:
        """Leave the ring: the head and the tail see the end of stream and the ring stops."""
        self._break("the bridge left the ring")
        for link in (self._head, self._tail):
            link.close()

    def _read(self, link: Link) -> None:
        try:
            while True:
                header, _ = link.recv()
                self._dispatch(header)
        except LinkClosed as exc:
            self._break(f"the ring broke ({link.name} link): {exc}")

    def _dispatch(self, header: dict[str, Any]) -> None:
        kind = header.get("type")
        if kind == "tokens":
            for row in header["rows"]:
                request = self._open.get(row["request_id"])
                if request is not None:
                    logprobs = {"logprob": row["logprob"], "top": row.get("top") or []} if "logprob" in row else None
                    request._events.put(("token", (int(row["token"]), logprobs)))
        elif kind == "done":
            self._end(header["request_id"], "done", header.get("reason", "stop"))
        elif kind == "error":
            self.errors.append(header)
            for request_id in header["request_ids"]:
                self._end(request_id, "error", header.get("message", "the ring failed this request"))
        elif kind == "stats":
            self._stats.put(header["stages"])

    def _end(self, request_id: str, kind: str, value: str) -> None:
        with self._lock:
            request = self._open.pop(request_id, None)
        if request is not None:
            request._events.put((kind, value))

    def _break(self, reason: str) -> None:
        with self._lock:
            if self._broken is None:
                self._broken = reason
            pending, self._open = list(self._open.values()), {}
        self.down.set()
        for request in pending:
            request._events.put(("broken", reason))
