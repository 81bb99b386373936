"""Ordered, batched token pushes that never make generation wait on the network.

Generated pieces are handed to :meth:`BatchPusher.add`, which only appends to a buffer. A
sender thread takes everything buffered, pushes it as one batch, then waits out the rest
of ``interval`` (about 50 ms) before the next batch. So a host far from the gateway sends
bigger batches instead of generating slower, and a nearby one streams smoothly.

Batches are numbered ``seq = 0, 1, 2, …`` by the single sender, so they leave in order;
the HTTP client retries a batch with the same body, hence the same ``seq`` (the server
dedupes). When a push fails for good (409: the job is no longer ours; 403; the server is
unreachable), the error is raised from the next :meth:`add` or from :meth:`flush`, which
is how the loop stops generating at once.

The last batch carries the answer's ``finish_reason`` (:meth:`BatchPusher.flush`), sent
even when it has no text left: a process that dies before "complete" then leaves the
gateway an answer it knows is whole, which it settles instead of continuing.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from mahout.api import HostApi

FLUSH_INTERVAL_SECONDS = 0.05
FINISH_REASONS = ("stop", "length")  # what a batch may say (the gateway refuses anything else)
JOIN_TIMEOUT_SECONDS = 60.0


class BatchPusher:
    """Streams one job's text to the gateway; use as a context manager, end with :meth:`flush`."""

    def __init__(self, api: HostApi, job_id: Any, interval: float = FLUSH_INTERVAL_SECONDS) -> None:
        self._api, self._job_id, self._interval = api, job_id, interval
        self._cond = threading.Condition()
        self._pending: list[str] = []
        self._logprobs: list[dict] | None = None  # the pending text's tokens' entries, when the job asked for them
        self._closing = False
        self._finish = ""  # the answer's finish_reason, for its last batch
        self._abandoned = False
        self._error: BaseException | None = None
        self.seq = 0
        self._thread = threading.Thread(target=self._send_loop, name=f"mahout-push-{job_id}", daemon=True)
        self._thread.start()

    def __enter__(self) -> BatchPusher:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_rest: object) -> None:
        """On an error, drop what is unsent and stop the sender without waiting for the server."""
        if exc_type is not None:
            with self._cond:
                self._abandoned = self._closing = True
                self._cond.notify_all()

    def add(self, piece: str) -> None:
        """Queue ``piece`` for the next batch (a :class:`~mahout.runners.Piece` brings its
        log-probability entries along); raises the sender's error if pushing failed."""
        self._raise_if_failed()
        entries = getattr(piece, "logprobs", None)
        with self._cond:
            self._pending.append(str(piece))
            if entries is not None:
                self._logprobs = [*(self._logprobs or []), *entries]
            self._cond.notify_all()

    def flush(self, finish_reason: str = "") -> None:
        """Send everything still buffered, wait for the sender to finish, raise its error if any.
        A ``finish_reason`` ("stop" or "length") goes with the last batch, an empty one if
        nothing is left to send."""
        with self._cond:
            self._finish = finish_reason if finish_reason in FINISH_REASONS else ""
            self._closing = True
            self._cond.notify_all()
        self._thread.join(JOIN_TIMEOUT_SECONDS)
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _next_batch(self) -> tuple[str, list[dict] | None, str] | None:
        """Block until there is text to send (or the end); the batch, with the finish_reason
        when it is the last one; ``None`` means stop."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending or self._closing)
            if self._abandoned or not (self._pending or self._finish):
                return None
            batch = "".join(self._pending), self._logprobs, self._finish  # (a finish_reason is set only by flush)
            self._pending.clear()
            self._logprobs, self._finish = None, ""
            return batch

    def _pace(self, sent_at: float) -> None:
        """Let pieces accumulate until ``interval`` after the last send (cut short by flush)."""
        with self._cond:
            self._cond.wait_for(lambda: self._closing, timeout=max(0.0, sent_at + self._interval - time.monotonic()))

    def _send_loop(self) -> None:
        while (batch := self._next_batch()) is not None:
            text, entries, finish = batch
            sent_at = time.monotonic()
            extra: dict[str, Any] = {} if entries is None else {"logprobs": entries}
            if finish:
                extra["finish_reason"] = finish
            try:
                self._api.push_tokens(self._job_id, seq=self.seq, text=text, **extra)
            except Exception as exc:  # noqa: BLE001 - handed to the generating thread
                self._error = exc
                return
            self.seq += 1
            self._pace(sent_at)
