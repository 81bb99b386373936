"""The ring's wire format: length-prefixed frames of a JSON header plus raw tensor bytes.

A frame is ``>II`` (header length, payload length), the header as UTF-8 JSON, then the
payload. A frame that carries a tensor names its ``dtype`` and ``shape`` in the header and
its payload is the tensor's raw little-endian bytes (float32 hidden states, no pickling:
a stage never executes what a neighbour sends it).

`Link` wraps one TCP connection: `send` is thread-safe, `recv` returns ``(header, tensor)``
or raises `LinkClosed` at end of stream.
"""
from __future__ import annotations

import json
import socket
import struct
import threading
import time
from typing import Any

import numpy as np
import torch

__all__ = ["Link", "LinkClosed", "connect", "listen"]

_PREFIX = struct.Struct(">II")
MAX_HEADER_BYTES = 1 << 20
MAX_PAYLOAD_BYTES = 1 << 30
_DTYPES = {"float32": (torch.float32, np.float32), "int64": (torch.int64, np.int64)}


class LinkClosed(ConnectionError):
    """The peer closed the connection (or it broke)."""


class Link:
    """One framed TCP connection between two ring agents."""

    def __init__(self, sock: socket.socket, name: str = "") -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.name = name
        self._send_lock = threading.Lock()

    def send(self, header: dict[str, Any], tensor: torch.Tensor | None = None) -> None:
        payload = b""
        if tensor is not None:
            tensor = tensor.detach().contiguous()
            dtype = str(tensor.dtype).removeprefix("torch.")
            if dtype not in _DTYPES:
                raise ValueError(f"cannot send a {dtype} tensor")
            header = {**header, "dtype": dtype, "shape": list(tensor.shape)}
            payload = tensor.numpy().tobytes()
        head = json.dumps(header, separators=(",", ":")).encode()
        with self._send_lock:
            try:
                self.sock.sendall(_PREFIX.pack(len(head), len(payload)) + head + payload)
            except OSError as exc:
                raise LinkClosed(f"link {self.name} broke: {exc}") from exc

    def recv(self) -> tuple[dict[str, Any], torch.Tensor | None]:
        n_head, n_payload = _PREFIX.unpack(self._exactly(_PREFIX.size))
        if n_head > MAX_HEADER_BYTES or n_payload > MAX_PAYLOAD_BYTES:
            raise LinkClosed(f"link {self.name}: frame too large ({n_head} + {n_payload} bytes)")
        header = json.loads(self._exactly(n_head))
        if not n_payload:
            return header, None
        torch_dtype, np_dtype = _DTYPES[header["dtype"]]
        array = np.frombuffer(bytearray(self._exactly(n_payload)), dtype=np_dtype)
        return header, torch.from_numpy(array).reshape(header["shape"])

    def _exactly(self, n: int) -> bytes:
        buffer = bytearray(n)
        view, got = memoryview(buffer), 0
        while got < n:
            try:
                chunk = self.sock.recv_into(view[got:], n - got)
            except OSError as exc:
                raise LinkClosed(f"link {self.name} broke: {exc}") from exc
            if chunk == 0:
                raise LinkClosed(f"link {self.name} closed by its peer")
            got += chunk
        return bytes(buffer)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def listen(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening socket (port 0: any free port; read it from ``getsockname()``)."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((host, port))
    server.listen(8)
    return server


def connect(address: tuple[str, int], *, hello: dict[str, Any], timeout: float = 60.0, name: str = "") -> Link:
    """Connect to a ring agent, retrying while it is not listening yet, and say who we are."""
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
