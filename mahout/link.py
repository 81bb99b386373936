"""Framed TCP links between host agents (ring stages, the ring's bridge, expert workers and
their coordinator), the handshake that admits only peers holding the gateway's secret, and
the `Heartbeat` thread their control loops tick on.

A frame is ``>II`` (header length, payload length), the header as UTF-8 JSON, then the
payload. A frame that carries a tensor names its ``dtype`` and ``shape`` in the header and
its payload is the tensor's raw little-endian bytes (float32 hidden states, no pickling:
an agent never executes what a peer sends it).

* `Link` wraps one TCP connection: `send` is thread-safe and hands the kernel the header
  and the tensor's own memory in one `sendmsg`; `recv` reads the payload straight into the
  buffer the tensor then wraps, and returns ``(header, tensor)`` or raises `LinkClosed` at
  end of stream. Both ends set TCP_NODELAY: a frame is one write, so Nagle never holds
  back its tail waiting for a delayed ACK.
* Every read is bounded by `FrameCaps` (the receiver's own: a ring stage's follow from its
  plan's widths, an expert worker's from its slice): a frame announcing more is refused
  from its 8-byte prefix, before anything is allocated for it, and so is a frame whose
  tensor does not match its own header (`FrameRefused`, a `LinkClosed`).

The handshake (both directions proven, HMAC-SHA256 over fresh nonces with the secret the
gateway issued for this link: a ring's links each have their own, known to its two ends
only, `mahout.ring.keys`; an expert worker's is its own): the listener speaks first with a
``challenge`` naming the protocol's `VERSION`, a nonce and a fresh X25519 public key; the
dialer answers ``hello`` with its identity, its own nonce and key and a proof over the
challenge (its key included) and that hello; the listener checks it with
`hmac.compare_digest` and, only if it holds, answers ``admitted`` with a proof over both
nonces and both keys, which the dialer checks before it sends anything else. A listener
that admits several peers on one socket picks the secret by the identity the hello claims
(`accept`'s ``secret_for``: a ring stage knows the one upstream neighbour and, at the head
and the tail, the bridge it expects) and refuses any other identity before checking a proof.
A peer without the secret gets the challenge and nothing more; a dialer never sends a byte
to something that did not greet it in this protocol. A peer of another protocol version is
told apart from one without the secret (`LinkRefused` says which).

Once a peer is admitted, every frame is sealed (AES-GCM, from `cryptography`): each side
derives one key per direction with HKDF-SHA256 from the secret and the X25519 exchange,
salted with both handshake nonces. The exchange keeps the session's keys from anyone who
holds the secret but only watched the handshake: the gateway that issued the secret, or the
relay it runs for hosts behind NAT, sees ciphertext it cannot open, even from its database.
(The gateway is still the one that vouches for both ends: one that actively put itself in
the middle of a handshake, with the secret, could. Nothing here defends against that.)
A sealed frame's body
is its JSON header (padded with spaces to 8 bytes when a payload follows, so the payload
lands aligned in the receiver's buffer), then its payload, sealed in records (TLS's shape),
each with its tag, under nonces counted per direction and with the clear ``>II`` prefix as
associated data. A frame of up to `GATHER_BYTES` (a ring's decode step or an expert batch)
is one record, one AEAD call on each side; a larger one is its header, then its payload in records
of at most `RECORD_BYTES`, sealed straight from the tensor's memory and opened straight into
the receiver's, a cache-sized record at a time as it goes to and comes off the socket. The
prefix stays readable so the caps still refuse a frame before anything is allocated; a frame
that was altered, replayed, reordered, dropped or cut short fails a tag and drops the link
(`FrameRefused`). Frame sizes (to 8 bytes) and timing stay visible on the wire.

* `accept` is the listener's side; `connect` (retrying while the peer is not listening yet:
  ring stages start together) and `dial` (one attempt: an expert worker that is not there
  must fail the batch at once) the dialer's.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import math
import secrets
import socket
import string
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = [
    "HANDSHAKE_CAPS",
    "HEADERS_ONLY",
    "RECORD_BYTES",
    "FrameCaps",
    "FrameRefused",
    "HandshakeSlots",
    "Heartbeat",
    "Link",
    "LinkClosed",
    "LinkRefused",
    "VERSION",
    "accept",
    "connect",
    "dial",
    "listen",
    "new_secret",
]

_PREFIX = struct.Struct(">II")  # header length, payload length
VERSION = 3  # the handshake's; 3: secrets per link, bound to its two ends (2 had one per ring)
_TAG = f"elephant-link-{VERSION}"
_DTYPES = {"float32": np.float32, "int64": np.int64}
HANDSHAKE_TIMEOUT_SECONDS = 10.0  # a peer that does not finish the handshake in this time is dropped
MAX_PENDING_HANDSHAKES = 16  # connections in the handshake at once, per listener; more are closed at once
MIN_SECRET_CHARS = 32
_NONCE_BYTES = 16
_KEY_BYTES = 32  # an X25519 public key
_TAG_BYTES = 16  # AES-GCM's tag, after each sealed record
RECORD_BYTES = (
    1 << 18
)  # plaintext bytes per sealed record: small enough to stay in cache between the cipher and the socket
GATHER_BYTES = 1 << 17  # a body up to this size is one record, header and payload gathered: one AEAD call, one recv
FLUSH_RECORDS = 4  # sealed records handed to the kernel at once (1 MiB: still in cache)
_ALIGN = 8  # a sealed frame's payload starts at a multiple of this in its body (int64 and float32 rows)
_Buffer = TypeVar("_Buffer", bytearray, memoryview)


class LinkClosed(ConnectionError):
    """The peer closed the connection (or it broke)."""


class FrameRefused(LinkClosed, ValueError):
    """A frame larger than the receiver's caps, or one that does not match its own header;
    the link is dropped (nothing was allocated for an oversized payload)."""


class LinkRefused(LinkClosed):
    """The handshake failed: the peer does not hold the secret (or we do not hold its)."""


@dataclass(frozen=True)
class FrameCaps:
    """The largest frame a receiver accepts: JSON header bytes and payload bytes."""

    header_bytes: int
    payload_bytes: int

    def check(self, n_head: int, n_payload: int, name: str) -> None:
        if n_head > self.header_bytes or n_payload > self.payload_bytes:
            raise FrameRefused(
                f"link {name}: frame of {n_head} + {n_payload} bytes exceeds the caps of "
                f"{self.header_bytes} + {self.payload_bytes} bytes"
            )


HEADERS_ONLY = FrameCaps(header_bytes=1 << 20, payload_bytes=0)  # control messages, no tensors (the bridge's)
HANDSHAKE_CAPS = FrameCaps(header_bytes=4096, payload_bytes=0)  # a challenge, a hello, an answer


def _frame_parts(header: dict[str, Any], tensor: torch.Tensor | None) -> tuple[bytes, memoryview]:
    """A frame as (JSON header, payload); the payload is the tensor's own memory."""
    payload = memoryview(b"")
    if tensor is not None:
        tensor = tensor.detach().contiguous()
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise ValueError(f"cannot send a {dtype} tensor")
        header = {**header, "dtype": dtype, "shape": list(tensor.shape)}
        # no copy; (an ndarray is a buffer: numpy's stubs say so only for Python 3.12 on)
        payload = memoryview(tensor.numpy().reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    return json.dumps(header, separators=(",", ":")).encode(), payload


def _header(raw: bytes | bytearray, name: str) -> dict[str, Any]:
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise FrameRefused(f"link {name}: the frame's header is not JSON") from exc
    if not isinstance(header, dict):
        raise FrameRefused(f"link {name}: the frame's header is not an object")
    return header


def _payload_size(header: dict[str, Any], name: str) -> int:
    """The payload size a tensor header announces (checked before the payload is read)."""
    dtype, shape = header.get("dtype"), header.get("shape")
    if dtype not in _DTYPES or not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise FrameRefused(f"link {name}: a payload without a valid dtype and shape")
    return math.prod(shape) * np.dtype(_DTYPES[dtype]).itemsize


def _tensor(header: dict[str, Any], payload: bytearray, offset: int = 0) -> torch.Tensor:
    """Wrap a received payload, from `offset` of its buffer on (writable, owned by the tensor
    from now on)."""
    return torch.from_numpy(np.frombuffer(payload, dtype=_DTYPES[header["dtype"]], offset=offset)).reshape(
        header["shape"]
    )


class _Seal:
    """One direction of a sealed link: its AES-GCM key and the count of records sealed so far,
    which is each record's nonce (a key is used for one session and one direction only, so a
    nonce never repeats under it; a receiver that expects the next count refuses a replay).
    Sealed records pass through one scratch buffer (a record and its tag at most), on their
    way to the socket or off it into the frame's own buffer: a fresh one per record would
    cost its page faults."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self._count = 0
        self._scratch = bytearray()

    def scratch(self, size: int) -> memoryview:
        if len(self._scratch) < size:
            self._scratch = bytearray(size)
        return memoryview(self._scratch)[:size]

    def _next_nonce(self) -> bytes:
        nonce = self._count.to_bytes(12, "big")
        self._count += 1
        return nonce

    def seal_one(self, prefix: bytes, body: bytes) -> bytes:
        """A small frame's whole body (up to GATHER_BYTES) as one record: one AEAD call."""
        return self._aead.encrypt(self._next_nonce(), body, prefix)

    def seal(self, prefix: bytes, head: bytes, payload: memoryview) -> Iterator[memoryview]:
        """A larger frame's body (`head`, then `payload`) as sealed records, in order, gathered
        in the scratch buffer up to `FLUSH_RECORDS` at a time: each view yielded is valid until
        the next is asked for (a sender holds its lock until the kernel has taken each)."""
        spans = _records(len(head), payload.nbytes)
        total = len(head) + payload.nbytes + len(spans) * _TAG_BYTES
        room = self.scratch(min(total, max(FLUSH_RECORDS * (RECORD_BYTES + _TAG_BYTES), len(head) + _TAG_BYTES)))
        used = 0
        for start, end in spans:
            size = end - start + _TAG_BYTES
            if used + size > len(room):
                yield room[:used]
                used = 0
            self._aead.encrypt_into(
                self._next_nonce(), _span(head, payload, start, end), prefix, room[used : used + size]
            )
            used += size
        yield room[:used]

    def open_into(self, sealed: memoryview, prefix: bytes, plain: bytearray | memoryview, name: str) -> None:
        """Open the next record into `plain` (its place in the frame's body)."""
        try:
            self._aead.decrypt_into(self._next_nonce(), sealed, prefix, plain)
        except InvalidTag as exc:
            raise FrameRefused(
                f"link {name}: a frame failed its authentication (altered, replayed or out of order)"
            ) from exc


def _records(n_head: int, n_payload: int) -> list[tuple[int, int]]:
    """The [start, end) spans of a body (header, then payload) that are sealed one record each:
    a small frame (up to GATHER_BYTES) as one; else the header, then the payload in
    records of at most RECORD_BYTES, each sealed straight from the tensor's memory."""
    size = n_head + n_payload
    if size <= GATHER_BYTES:
        return [(0, size)]
    return [(0, n_head), *((start, min(start + RECORD_BYTES, size)) for start in range(n_head, size, RECORD_BYTES))]


def _span(head: bytes, payload: memoryview, start: int, end: int) -> bytes | memoryview:
    """The plaintext of the record [start, end) of a larger frame's body: its header, or a view of its payload."""
    return head if end == len(head) else payload[start - len(head) : end - len(head)]


class Link:
    """One framed TCP connection between two agents; `caps` bound every frame it reads
    (a link starts with the handshake's: set the receiver's own once the peer is admitted).
    A link the handshake admitted seals its frames (`_secure`); a bare `Link` over a socket
    does not (tests and the benchmark's baseline only: `accept`, `connect` and `dial` are
    the agents' only way to a peer)."""

    def __init__(self, sock: socket.socket, name: str = "", *, caps: FrameCaps = HANDSHAKE_CAPS) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.name = name
        self.caps = caps
        self.peer: dict[str, Any] = {}  # the admitted peer's hello (its role and identity)
        self._send_lock = threading.Lock()
        self._outbound: _Seal | None = None
        self._inbound: _Seal | None = None

    def _secure(self, send_key: bytes, recv_key: bytes) -> None:
        """Seal every frame from now on (both ends switch after the handshake's last frame)."""
        self._outbound, self._inbound = _Seal(send_key), _Seal(recv_key)

    def send(self, header: dict[str, Any], tensor: torch.Tensor | None = None) -> None:
        head, payload = _frame_parts(header, tensor)
        with self._send_lock:  # nonces are counted in the order records go on the wire
            try:
                if self._outbound is None:
                    _send_all(self.sock, [memoryview(_PREFIX.pack(len(head), payload.nbytes) + head), payload])
                else:
                    self._send_sealed(head, payload)
            except OSError as exc:
                raise LinkClosed(f"link {self.name} broke: {exc}") from exc

    def _send_sealed(self, head: bytes, payload: memoryview) -> None:
        """The clear prefix, then the body's sealed records, handed to the kernel as they are sealed."""
        assert self._outbound is not None
        if payload.nbytes:
            head += b" " * (-len(head) % _ALIGN)  # JSON allows the trailing spaces
        prefix = _PREFIX.pack(len(head), payload.nbytes)
        if len(head) + payload.nbytes <= GATHER_BYTES:  # one record, one sendmsg, as unsealed
            _send_all(self.sock, [memoryview(prefix), memoryview(self._outbound.seal_one(prefix, head + payload))])
            return
        parts = [memoryview(prefix)]
        for records in self._outbound.seal(prefix, head, payload):
            parts.append(records)
            _send_all(self.sock, parts)
            parts = []

    def recv(self, caps: FrameCaps | None = None) -> tuple[dict[str, Any], torch.Tensor | None]:
        """The next frame, within `caps` (default: the link's); `FrameRefused` otherwise."""
        prefix = bytes(self._into(bytearray(_PREFIX.size)))
        n_head, n_payload = _PREFIX.unpack(prefix)
        (caps or self.caps).check(n_head, n_payload, self.name)  # before any allocation
        if self._inbound is None:
            header = _header(self._into(bytearray(n_head)), self.name)
            body, offset = None, 0
        else:
            if n_payload and n_head % _ALIGN:
                raise FrameRefused(f"link {self.name}: a sealed frame's payload is not aligned")
            body, offset = self._opened(n_head, n_payload, prefix), n_head
            header = _header(body[:n_head], self.name)
        if not n_payload:
            return header, None
        if _payload_size(header, self.name) != n_payload:
            raise FrameRefused(f"link {self.name}: the payload does not match its dtype and shape")
        return header, _tensor(header, self._into(bytearray(n_payload)) if body is None else body, offset)

    def _opened(self, n_head: int, n_payload: int, prefix: bytes) -> bytearray:
        """A sealed frame's body (header, then payload), read and opened record by record into
        a buffer of its own (the payload's tensor wraps it)."""
        assert self._inbound is not None
        body = bytearray(n_head + n_payload)
        view = memoryview(body)
        for start, end in _records(n_head, n_payload):
            sealed = self._into(self._inbound.scratch(end - start + _TAG_BYTES))
            self._inbound.open_into(sealed, prefix, view[start:end], self.name)
        return body

    def _into(self, buffer: _Buffer) -> _Buffer:
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
    """A listening socket, on loopback unless told otherwise (port 0: any free port; read it
    from ``getsockname()``)."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((host, port))
    server.listen(8)
    return server


# -- the handshake ---------------------------------------------------------------------


def new_secret() -> str:
    """A fresh shared secret (what the gateway issues; a local ring makes its own)."""
    return secrets.token_hex(32)


def _key(secret: str) -> bytes:
    if len(secret or "") < MIN_SECRET_CHARS:
        raise ValueError(f"a link secret must be at least {MIN_SECRET_CHARS} characters (the gateway issues it)")
    return secret.encode()


def _proof(key: bytes, *parts: str) -> str:
    return hmac.new(key, "|".join((_TAG, *parts)).encode(), hashlib.sha256).hexdigest()


class _Ephemeral:
    """One side's fresh X25519 key pair, for one handshake only: the session's keys need its
    exchange, so whoever holds the secret but only watched the handshake (the gateway that
    issued it, its relay) cannot derive them."""

    def __init__(self) -> None:
        self._private = X25519PrivateKey.generate()
        self.public = self._private.public_key().public_bytes_raw().hex()

    def shared(self, theirs: str, name: str) -> bytes:
        try:
            return self._private.exchange(X25519PublicKey.from_public_bytes(bytes.fromhex(theirs)))
        except ValueError as exc:  # e.g. a low-order point, whose exchange is all zeros
            raise LinkRefused(f"link {name}: the peer's key exchange is not usable") from exc


def _session_keys(key: bytes, shared: bytes, challenge: str, hello: str) -> tuple[bytes, bytes]:
    """This session's keys, (dialer to listener, listener to dialer): HKDF over the secret and
    the X25519 exchange, salted with both sides' fresh nonces, one `info` per direction."""
    salt = bytes.fromhex(challenge) + bytes.fromhex(hello)

    def derive(direction: str) -> bytes:
        return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=f"{_TAG} {direction}".encode()).derive(
            key + shared
        )

    return derive("dial->listen"), derive("listen->dial")


def _canonical(hello: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in hello.items() if k != "proof"}, sort_keys=True, separators=(",", ":"))


def _hex(message: dict[str, Any], kind: str, field: str, size: int) -> str | None:
    """A `kind` message's `field` of `size` bytes in hex (a nonce or a public key), or None."""
    value = message.get(field)
    ok = (
        message.get("type") == kind
        and isinstance(value, str)
        and len(value) == 2 * size
        and all(c in string.hexdigits for c in value)
    )  # read as bytes: it salts or makes the session keys
    return value if ok else None


def _nonce_and_key(message: dict[str, Any], kind: str) -> tuple[str, str] | None:
    nonce, public = _hex(message, kind, "nonce", _NONCE_BYTES), _hex(message, kind, "key", _KEY_BYTES)
    return None if nonce is None or public is None else (nonce, public)


class HandshakeSlots:
    """A listener's bound on connections still in the handshake: a stranger who opens many
    (and never answers the challenge) cannot pile up threads and sockets for the handshake
    timeout each; past the bound a new connection is closed at once. Peers that passed the
    handshake do not count."""

    def __init__(self, limit: int = MAX_PENDING_HANDSHAKES) -> None:
        self._free = threading.BoundedSemaphore(limit)

    def take(self, sock: socket.socket) -> bool:
        """A slot for this connection, or False with the socket closed."""
        if self._free.acquire(blocking=False):
            return True
        with contextlib.suppress(OSError):
            sock.close()
        return False

    def give_back(self) -> None:
        self._free.release()


def accept(
    sock: socket.socket,
    *,
    secret: str | None = None,
    secret_for: Callable[[dict[str, Any]], str | None] | None = None,
    caps: FrameCaps,
    name: str = "",
    timeout: float = HANDSHAKE_TIMEOUT_SECONDS,
) -> Link:
    """The listener's side of the handshake on an accepted socket: the admitted peer's link
    (its hello in ``link.peer``, its frames bounded by `caps` from now on), or `LinkRefused`
    with the socket closed after nothing but the challenge was sent.

    The peer proves `secret`; or, with `secret_for`, the secret that function names for the
    identity the peer's hello claims (its role, its stage): None refuses that identity, so a
    peer holding some other link's secret is refused even where it could prove that one."""
    if (secret is None) == (secret_for is None):
        raise ValueError("give the link's secret, or how to find it from the peer's hello (not both)")
    fixed = None if secret is None else _key(secret)
    link = Link(sock, name or "inbound")
    ours, ephemeral = secrets.token_hex(_NONCE_BYTES), _Ephemeral()
    try:
        sock.settimeout(timeout)
        link.send({"type": "challenge", "version": VERSION, "nonce": ours, "key": ephemeral.public})
        hello, _ = link.recv(HANDSHAKE_CAPS)
        if hello.get("version") != VERSION:
            raise LinkRefused(
                f"link {link.name}: the peer speaks link protocol {hello.get('version', 2)}, not {VERSION} "
                "(update mahout on its machine)"
            )
        fresh = _nonce_and_key(hello, "hello")
        proof = hello.get("proof")
        claimed = {k: v for k, v in hello.items() if k not in ("proof", "nonce", "key", "type", "version")}
        key = fixed if secret_for is None else _claimed_key(secret_for, claimed)
        if key is None:
            raise LinkRefused(f"link {link.name}: a peer claiming to be {claimed} is not one this end expects")
        if (
            fresh is None
            or not isinstance(proof, str)
            or not hmac.compare_digest(proof, _proof(key, "dial", ours, ephemeral.public, _canonical(hello)))
        ):
            raise LinkRefused(f"link {link.name}: the peer did not prove it holds the secret")
        theirs, their_key = fresh
        link.send({"type": "admitted", "proof": _proof(key, "listen", theirs, ours, their_key, ephemeral.public)})
        inbound, outbound = _session_keys(key, ephemeral.shared(their_key, link.name), ours, theirs)
        link._secure(outbound, inbound)
        sock.settimeout(None)
    except LinkRefused:
        link.close()
        raise
    except (LinkClosed, OSError) as exc:
        link.close()
        raise LinkRefused(f"link {link.name}: handshake failed: {exc}") from exc
    link.peer, link.caps = {k: v for k, v in hello.items() if k not in ("proof", "nonce", "key", "version")}, caps
    return link


def _claimed_key(secret_for: Callable[[dict[str, Any]], str | None], claimed: dict[str, Any]) -> bytes | None:
    """The key for the identity a hello claims, or None where the listener expects no such peer."""
    secret = secret_for(claimed)
    return None if secret is None else _key(secret)


def _greet(link: Link, key: bytes, hello: dict[str, Any], caps: FrameCaps, timeout: float) -> Link:
    """The dialer's side of the handshake: answer the challenge, check the listener's proof."""
    try:
        link.sock.settimeout(timeout)
        challenge, _ = link.recv(HANDSHAKE_CAPS)
        fresh = _nonce_and_key(challenge, "challenge")
        if fresh is None:
            raise LinkRefused(f"link {link.name}: the peer does not speak the link protocol")
        if challenge.get("version") != VERSION:
            raise LinkRefused(
                f"link {link.name}: the peer speaks link protocol {challenge.get('version', 2)}, not {VERSION} "
                "(update mahout on its machine)"
            )
        theirs, their_key = fresh
        ours, ephemeral = secrets.token_hex(_NONCE_BYTES), _Ephemeral()
        message = {**hello, "type": "hello", "version": VERSION, "nonce": ours, "key": ephemeral.public}
        link.send({**message, "proof": _proof(key, "dial", theirs, their_key, _canonical(message))})
        try:
            answer, _ = link.recv(HANDSHAKE_CAPS)
        except LinkClosed as exc:
            raise LinkRefused(f"link {link.name}: the peer refused our proof (a different secret?)") from exc
        proof = answer.get("proof")
        if (
            answer.get("type") != "admitted"
            or not isinstance(proof, str)
            or not hmac.compare_digest(proof, _proof(key, "listen", ours, theirs, ephemeral.public, their_key))
        ):
            raise LinkRefused(f"link {link.name}: the peer did not prove it holds the secret")
        outbound, inbound = _session_keys(key, ephemeral.shared(their_key, link.name), theirs, ours)
        link._secure(outbound, inbound)
        link.sock.settimeout(None)
    except LinkRefused:
        link.close()
        raise
    except (LinkClosed, OSError) as exc:
        link.close()
        raise LinkRefused(f"link {link.name}: handshake failed: {exc}") from exc
    link.caps = caps
    return link


def connect(
    address: tuple[str, int],
    *,
    secret: str,
    hello: dict[str, Any],
    caps: FrameCaps,
    timeout: float = 60.0,
    name: str = "",
) -> Link:
    """Connect to an agent, retrying while it is not listening yet, and pass the handshake
    as `hello` (its role and identity); `LinkRefused` if either side's proof fails."""
    key = _key(secret)
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
    link = Link(sock, name or f"{address[0]}:{address[1]}")
    return _greet(link, key, hello, caps, max(1.0, min(HANDSHAKE_TIMEOUT_SECONDS, deadline - time.monotonic())))


def dial(address: tuple[str, int], *, secret: str, hello: dict[str, Any], caps: FrameCaps, timeout: float) -> Link:
    """Connect once (no retries) and pass the handshake."""
    key = _key(secret)
    try:
        sock = socket.create_connection(address, timeout=timeout)
    except OSError as exc:
        raise LinkClosed(f"could not reach {address[0]}:{address[1]}: {exc}") from exc
    return _greet(Link(sock, f"{address[0]}:{address[1]}"), key, hello, caps, timeout)


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
