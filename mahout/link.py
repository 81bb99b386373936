"""Framed TCP links between host agents (ring stages, the ring's bridge, expert workers and
their coordinator), and the `Heartbeat` thread their control loops tick on.

A frame is ``>II`` (header length, payload length), the header as UTF-8 JSON, then the
payload. A frame that carries a tensor names its ``dtype`` and ``shape`` in the header and
its payload is the tensor's raw little-endian bytes (float32 hidden states, no pickling:
an agent never executes what a peer sends it).

* `Link` wraps one TCP connection: `send` is thread-safe and hands the kernel the header
  and the tensor's own memory in one `sendmsg`; `recv` reads the payload straight into the
  buffer the tensor then wraps, and returns ``(header, tensor)`` or raises `LinkClosed` at
  end of stream. Both ends set TCP_NODELAY: a frame is one write, so Nagle never holds
  back its tail waiting for a delayed ACK.
* `encode_frame` / `decode_frame` are the same frame as one bytes message (the relay's).
* `connect` retries while the peer is not listening yet (ring stages start together);
  `dial` makes one attempt (an expert worker that is not there must fail the batch at once).
"""
from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = [
    "MAX_HEADER_BYTES", "MAX_PAYLOAD_BYTES", "Heartbeat", "Link", "LinkClosed", "connect", "decode_frame", "dial",
    "encode_frame", "listen",
]

_PREFIX = struct.Struct(">II")  # header length, payload length
MAX_HEADER_BYTES = 1 << 20
MAX_PAYLOAD_BYTES = 1 << 30
_DTYPES = {"float32": np.float32, "int64": np.int64}


class LinkClosed(ConnectionError):
    """The peer closed the connection (or it broke)."""


def _frame_parts(header: dict[str, Any], tensor: torch.Tensor | None) -> tuple[bytes, memoryview]:
    """A frame as (prefix + JSON header, payload); the payload is the tensor's own memory."""
    payload = memoryview(b"")
    if tensor is not None:
        tensor = tensor.detach().contiguous()
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise ValueError(f"cannot send a {dtype} tensor")
        header = {**header, "dtype": dtype, "shape": list(tensor.shape)}
        payload = memoryview(tensor.numpy().reshape(-1).view(np.uint8))  # no copy
    head = json.dumps(header, separators=(",", ":")).encode()
    return _PREFIX.pack(len(head), payload.nbytes) + head, payload


def _tensor(header: dict[str, Any], payload: bytearray) -> torch.Tensor:
    """Wrap a received payload (writable, owned by the tensor from now on)."""
    return torch.from_numpy(np.frombuffer(payload, dtype=_DTYPES[header["dtype"]])).reshape(header["shape"])


def encode_frame(header: dict[str, Any], tensor: torch.Tensor | None = None) -> bytes:
    """One whole frame as bytes (the relay carries it as one WebSocket message)."""
    head, payload = _frame_parts(header, tensor)
    return head + payload


def decode_frame(frame: bytes) -> tuple[dict[str, Any], torch.Tensor | None]:
    """The inverse of `encode_frame`; refuses a frame whose lengths do not match its size."""
    if len(frame) < _PREFIX.size:
        raise ValueError("frame too short")
    n_head, n_payload = _PREFIX.unpack_from(frame)
    if _PREFIX.size + n_head + n_payload != len(frame):
        raise ValueError("frame lengths do not match its size")
    header = json.loads(frame[_PREFIX.size : _PREFIX.size + n_head])
    if not n_payload:
        return header, None
    return header, _tensor(header, bytearray(frame[_PREFIX.size + n_head :]))


class Link:
    """One framed TCP connection between two agents."""

    def __init__(self, sock: socket.socket, name: str = "") -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.name = name
        self._send_lock = threading.Lock()

    def send(self, header: dict[str, Any], tensor: torch.Tensor | None = None) -> None:
        head, payload = _frame_parts(header, tensor)
        with self._send_lock:
            try:
                _send_all(self.sock, [memoryview(head), payload])
            except OSError as exc:
                raise LinkClosed(f"link {self.name} broke: {exc}") from exc

    def recv(self) -> tuple[dict[str, Any], torch.Tensor | None]:
        n_head, n_payload = _PREFIX.unpack(self._into(bytearray(_PREFIX.size)))
        if n_head > MAX_HEADER_BYTES or n_payload > MAX_PAYLOAD_BYTES:
            raise LinkClosed(f"link {self.name}: frame too large ({n_head} + {n_payload} bytes)")
        header = json.loads(self._into(bytearray(n_head)))
        if not n_payload:
            return header, None
        return header, _tensor(header, self._into(bytearray(n_payload)))

    def _into(self, buffer: bytearray) -> bytearray:
        """Fill `buffer` from the socket (the tensor then wraps it as it is)."""
        view, got = memoryview(buffer), 0
        while got < len(buffer):
            try:
                n = self.sock.recv_into(view[got:], len(buffer) - got)
            except OSError as exc:
                raise LinkClosed(f"link {self.name} broke: {exc}") from exc
            if n == 0:
                raise LinkClosed(f"link {self.name} closed by its peer")
            got += n
        return buffer

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _send_all(sock: socket.socket, buffers: list[memoryview]) -> None:
    """`sendmsg` until every byte is out (a socket with a timeout may send part of it)."""
    pending = [b for b in buffers if b.nbytes]
    while pending:
        sent = sock.sendmsg(pending)
        while sent and pending:
            if sent >= pending[0].nbytes:
                sent -= pending.pop(0).nbytes
            else:
                pending[0], sent = pending[0][sent:], 0


def listen(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening socket (port 0: any free port; read it from ``getsockname()``)."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((host, port))
    server.listen(8)
    return server


def connect(address: tuple[str, int], *, hello: dict[str, Any], timeout: float = 60.0, name: str = "") -> Link:
    """Connect to an agent, retrying while it is not listening yet, and say who we are."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        try:
            sock = socket.create_connection(address, timeout=5.0)
            break
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise LinkClosed(f"could not reach {address[0]}:{address[1]} within {timeout:.0f} s: {exc}") from exc
        time.sleep(delay)
        delay = min(delay * 2, 0.5)
    sock.settimeout(None)
    link = Link(sock, name or f"{address[0]}:{address[1]}")
    link.send({"type": "hello", **hello})
    return link


def dial(address: tuple[str, int], *, hello: dict[str, Any], timeout: float) -> Link:
    """Connect once (no retries) and say who we are."""
    try:
        sock = socket.create_connection(address, timeout=timeout)
    except OSError as exc:
        raise LinkClosed(f"could not reach {address[0]}:{address[1]}: {exc}") from exc
    link = Link(sock, f"{address[0]}:{address[1]}")
    link.send({"type": "hello", **hello})
    return link


class Heartbeat:
    """Calls `beat` every `interval_s` seconds on a daemon thread, from `start` until `stop`.

    The first beat comes at once (``at_once=False``: after one interval). `beat` handles its
    own failures (a control plane that is down is tried again on the next beat): whatever it
    raises ends the heartbeat.
    """

    def __init__(self, beat: Callable[[], object], interval_s: float, *, name: str, at_once: bool = True) -> None:
        self.beat, self.interval_s, self.at_once = beat, interval_s, at_once
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def _run(self) -> None:
        if self.at_once and not self._stop.is_set():
            self.beat()
        while not self._stop.wait(self.interval_s):
            self.beat()

    def stop(self, timeout: float | None = None) -> None:
        """No beat starts after this; wait up to `timeout` seconds for one under way."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout)
