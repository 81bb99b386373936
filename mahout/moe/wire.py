"""The expert dispatch's TCP link: `mahout.ring.wire`'s frames, sent and read without copies.

The frames are byte for byte the ring's (``>II`` lengths, the JSON header, the tensor's raw
little-endian bytes; nothing is pickled), so a relay or a ring tool reads them alike. What
differs is the hot path, which a coordinator crosses twice per remote worker per layer:

* `send` hands the kernel the header and the tensor's own memory in one `sendmsg` (the
  ring's `Link` copies the tensor into bytes, then concatenates);
* `recv` reads the payload straight into the buffer the tensor then wraps (no copies);
* both ends set TCP_NODELAY (the ring's `Link` does too): a frame is one write, so Nagle
  never holds back its tail waiting for a delayed ACK;
* `encode_frame` / `decode_frame` are the same frame as one bytes message (the relay's);
* `dial` makes one attempt within its timeout: a worker that is not there must fail the
  batch at once, so the coordinator computes those experts itself instead of waiting.
"""
from __future__ import annotations

import json
import socket
import struct
from typing import Any

import numpy as np
import torch

from mahout.ring.wire import MAX_HEADER_BYTES, MAX_PAYLOAD_BYTES, Link, LinkClosed

__all__ = ["ExpertLink", "decode_frame", "dial", "encode_frame"]

_PREFIX = struct.Struct(">II")  # header length, payload length
_DTYPES = {"float32": np.float32, "int64": np.int64}


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


class ExpertLink(Link):
    """One framed TCP connection between a coordinator and an expert worker."""

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


def dial(address: tuple[str, int], *, hello: dict[str, Any], timeout: float) -> ExpertLink:
    """Connect once (no retries) and say who we are."""
    try:
        sock = socket.create_connection(address, timeout=timeout)
    except OSError as exc:
        raise LinkClosed(f"could not reach {address[0]}:{address[1]}: {exc}") from exc
    link = ExpertLink(sock, f"{address[0]}:{address[1]}")
    link.send({"type": "hello", **hello})
    return link
