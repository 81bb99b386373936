"""Reaching expert workers behind NAT through the gateway's relay (a Channels WebSocket).

A frame on the relay is one `mahout.link` frame as a binary WebSocket message: the
``>II`` lengths, the JSON header, the raw tensor bytes. Nothing is pickled.

* `RelayWorkerLink` (worker side): holds `…/api/moe/relay/worker/<id>` open (reconnecting
  with bounded backoff) and answers each compute frame with the worker's `ExpertServer`,
  within the server's frame caps. The gateway authenticates both ends with their host
  tokens and lets only the model's coordinator reach the worker, so no link handshake
  runs over the relay.
* `RelayTransport` (coordinator side): a `Transport` over `…/api/moe/relay/coordinator/<id>`;
  any failure or timeout raises `WorkerFailed`, so the coordinator computes locally.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from mahout.link import FrameCaps, decode_frame, encode_frame
from mahout.moe.coordinator import ANSWER_HEADER_BYTES, WorkerFailed
from mahout.moe.worker import ExpertServer

__all__ = ["RelayTransport", "RelayWorkerLink", "decode_frame", "encode_frame", "relay_url", "serve_reconnecting",
           "websocket_base"]

OPEN_TIMEOUT_S = 5.0
RECONNECT_MIN_S, RECONNECT_MAX_S = 0.5, 10.0


def serve_reconnecting(serve: Callable[[], None], stop: threading.Event, *, ended: Callable[[], object],
                       lost: Callable[[Exception, float], None]) -> None:
    """Run `serve` (one connection's life) until `stop` is set: `ended()` after each, and
    after a failure `lost(error, seconds)` and a wait that doubles up to `RECONNECT_MAX_S`."""
    wait = RECONNECT_MIN_S
    while not stop.is_set():
        try:
            serve()
            wait = RECONNECT_MIN_S
        except Exception as exc:  # noqa: BLE001 - any failure means: reconnect later
            if not stop.is_set():
                lost(exc, wait)
        ended()
        stop.wait(wait)
        wait = min(wait * 2, RECONNECT_MAX_S)


def websocket_base(server: str) -> str:
    """The gateway's WebSocket origin for its HTTP(S) URL (``ws://`` or ``wss://``)."""
    return server.rstrip("/").replace("https://", "wss://", 1).replace("http://", "ws://", 1)


def relay_url(server: str, role: str, worker_id: int) -> str:
    return f"{websocket_base(server)}/api/moe/relay/{role}/{worker_id}"


class RelayWorkerLink:
    """Serves `server`'s slice over the relay until stopped."""

    def __init__(self, server_url: str, token: str, worker_id: int, server: ExpertServer, *,
                 out: Callable[[str], None] = print) -> None:
        self.url = relay_url(server_url, "worker", worker_id)
        self.headers = {"Authorization": f"Bearer {token}"}
        self.server = server
        self.out = out
        self.connected = threading.Event()
        self._stop = threading.Event()
        self._socket: Any = None

    def start(self) -> RelayWorkerLink:
        threading.Thread(target=self._run, name="moe-relay-worker", daemon=True).start()
        return self

    def _run(self) -> None:
        serve_reconnecting(self._serve, self._stop, ended=self.connected.clear, lost=lambda exc, wait: self.out(
            f"mahout moe: relay connection lost ({type(exc).__name__}); retrying in {wait:.1f} s"))

    def _serve(self) -> None:
        from websockets.sync.client import connect

        caps = self.server.caps
        largest = 8 + caps.header_bytes + caps.payload_bytes  # the frame's prefix, header and payload
        with connect(self.url, additional_headers=self.headers, open_timeout=OPEN_TIMEOUT_S, max_size=largest) as socket:
            self._socket = socket
            self.connected.set()
            for message in socket:
                if isinstance(message, bytes):
                    header, rows = decode_frame(message, caps)
                    socket.send(encode_frame(*self.server.answer(header, rows)))

    def stop(self) -> None:
        self._stop.set()
        if self._socket is not None:
            self._socket.close()


class RelayTransport:
    """A coordinator's link to one worker through the relay, one request at a time."""

    def __init__(self, server_url: str, token: str, worker_id: int) -> None:
        self.url = relay_url(server_url, "coordinator", worker_id)
        self.headers = {"Authorization": f"Bearer {token}"}
        self._socket: Any = None
        self._lock = threading.Lock()

    def request(self, header: dict, rows: torch.Tensor, timeout: float) -> tuple[dict, torch.Tensor | None]:
        from websockets.exceptions import WebSocketException
        from websockets.sync.client import connect

        with self._lock:
            try:
                if self._socket is None:  # kept open across requests; closed by `_drop`
                    opened = connect(self.url, additional_headers=self.headers, open_timeout=timeout, max_size=None)
                    self._socket = opened.__enter__()
                self._socket.send(encode_frame(header, rows))
                message = self._socket.recv(timeout=timeout)
                if not isinstance(message, bytes):
                    raise ValueError("the relay sent text, not a frame")
                return decode_frame(message, FrameCaps(ANSWER_HEADER_BYTES, rows.nbytes))  # no larger than sent
            except (WebSocketException, OSError, TimeoutError, ValueError) as exc:
                self._drop()
                raise WorkerFailed(f"relay to {self.url}: {type(exc).__name__}: {exc}") from exc

    def _drop(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def close(self) -> None:
        with self._lock:
            self._drop()
