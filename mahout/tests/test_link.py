"""The agents' link (`mahout.link`, shared by the ring and the expert market): frames travel
without copies and arrive exact; a frame over the receiver's caps is refused from its prefix,
before anything is allocated for it; the handshake admits only a peer holding the secret,
both ways, and a stranger learns nothing but the challenge."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
import tracemalloc
from collections.abc import Callable

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from mahout.link import (
    HEADERS_ONLY,
    VERSION,
    FrameCaps,
    FrameRefused,
    Link,
    LinkClosed,
    LinkRefused,
    accept,
    connect,
    dial,
    listen,
    new_secret,
)

ROOMY = FrameCaps(header_bytes=1 << 16, payload_bytes=8 << 20)


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    server = listen()
    client = socket.create_connection(server.getsockname()[:2])
    accepted, _ = server.accept()
    server.close()
    return client, accepted


def read_frame(sock: socket.socket) -> dict:
    """One frame's header off a raw socket, as a stranger would read it."""
    n_head, n_payload = struct.unpack(">II", _exactly(sock, 8))
    header = json.loads(_exactly(sock, n_head))
    _exactly(sock, n_payload)
    return header


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def raw_frame(header: dict) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack(">II", len(head), 0) + head


class Listener:
    """A listening socket whose accepted connections go through `accept`; records the outcome."""

    def __init__(
        self, secret: str | None, caps: FrameCaps = ROOMY, *, secret_for: Callable[[dict], str | None] | None = None
    ) -> None:
        self.server = listen()
        self.address = self.server.getsockname()[:2]
        self.links: list[Link] = []
        self.refused: list[LinkRefused] = []
        self.done = threading.Event()
        threading.Thread(target=self._one, args=(secret, caps, secret_for), daemon=True).start()

    def _one(self, secret: str | None, caps: FrameCaps, secret_for: Callable[[dict], str | None] | None) -> None:
        sock, _ = self.server.accept()
        try:
            self.links.append(accept(sock, secret=secret, secret_for=secret_for, caps=caps, timeout=5.0))
        except LinkRefused as exc:
            self.refused.append(exc)
        self.done.set()

    def close(self) -> None:
        self.server.close()
        for link in self.links:
            link.close()


class LinkTests:
    def test_it_carries_tensors_of_any_layout_and_bare_headers_both_ways(self) -> None:
        a, b = tcp_pair()
        ours, theirs = Link(a, "ours", caps=ROOMY), Link(b, "theirs", caps=ROOMY)
        try:
            rows = torch.randn(3, 5)
            ours.send({"type": "compute", "id": 1}, rows)
            header, got = theirs.recv()
            assert header == {"type": "compute", "id": 1, "dtype": "float32", "shape": [3, 5]}
            assert got is not None and torch.equal(got, rows)
            theirs.send({"type": "result"}, rows.T)  # a non-contiguous tensor
            header, got = ours.recv()
            assert got is not None and torch.equal(got, rows.T)
            ours.send({"type": "hello"})
            assert theirs.recv() == ({"type": "hello"}, None)
        finally:
            ours.close()
            theirs.close()

    def test_a_large_frame_arrives_whole_through_a_socket_with_a_timeout(self) -> None:
        a, b = tcp_pair()
        a.settimeout(5.0)  # a timed socket may send only part of a buffer per call
        ours, theirs = Link(a, "ours"), Link(b, "theirs", caps=ROOMY)
        rows = torch.randn(512, 2048)  # 4 MiB: far more than a socket buffer
        received: list = []
        reader = threading.Thread(target=lambda: received.append(theirs.recv()))
        reader.start()
        try:
            ours.send({"type": "compute"}, rows)
            reader.join(10)
            ((_, got),) = received
            assert torch.equal(got, rows)
        finally:
            ours.close()
            theirs.close()


class FrameCapsTests:
    def test_an_oversized_frame_is_refused_from_its_prefix_without_allocating_it(self) -> None:
        a, b = tcp_pair()
        b.settimeout(5.0)  # were the payload awaited, the test would fail here, not hang
        theirs = Link(b, "theirs", caps=ROOMY)
        try:
            a.sendall(struct.pack(">II", 20, 3 << 30))  # announces 3 GiB, sends nothing more
            tracemalloc.start()
            with pytest.raises(FrameRefused, match="exceeds the caps"):
                theirs.recv()
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            assert peak < 1 << 20, f"{peak} bytes were allocated for a refused frame"
            a.sendall(struct.pack(">II", 20, 0))
            with pytest.raises(FrameRefused):
                theirs.recv(FrameCaps(header_bytes=4, payload_bytes=0))  # a header over the caps is refused too
        finally:
            a.close()
            theirs.close()

    def test_a_payload_that_does_not_match_its_header_is_refused(self) -> None:
        a, b = tcp_pair()
        theirs = Link(b, "theirs", caps=ROOMY)
        try:
            head = json.dumps({"type": "batch", "dtype": "float32", "shape": [1000, 1000]}).encode()
            a.sendall(struct.pack(">II", len(head), 16) + head + bytes(16))
            with pytest.raises(FrameRefused, match="does not match its dtype and shape"):
                theirs.recv()
        finally:
            a.close()
            theirs.close()


class HandshakeTests:
    def test_peers_holding_the_secret_are_admitted_with_their_identity(self) -> None:
        secret = new_secret()
        listener = Listener(secret)
        try:
            link = connect(
                listener.address, secret=secret, hello={"role": "upstream", "stage": 1}, caps=ROOMY, timeout=5
            )
            assert listener.done.wait(5) and not listener.refused
            (theirs,) = listener.links
            assert theirs.peer == {"type": "hello", "role": "upstream", "stage": 1}
            link.send({"type": "batch"}, torch.ones(2, 3))
            header, rows = theirs.recv()
            assert header["type"] == "batch" and rows is not None and torch.equal(rows, torch.ones(2, 3))
            link.close()
        finally:
            listener.close()

    def test_a_stranger_gets_the_challenge_and_nothing_more(self) -> None:
        listener = Listener(new_secret())
        stranger = socket.create_connection(listener.address, timeout=5)
        try:
            challenge = read_frame(stranger)
            assert challenge["type"] == "challenge" and len(challenge["nonce"]) == 32
            stranger.sendall(raw_frame({"type": "hello", "role": "bridge"}))  # the old, unauthenticated hello
            assert listener.done.wait(5) and listener.refused and not listener.links
            assert stranger.recv(1 << 16) == b"", "the listener closed the connection without another byte"
        finally:
            stranger.close()
            listener.close()

    def test_a_key_swapped_into_the_challenge_is_refused(self) -> None:
        """The key exchange is under the proofs: a man in the middle without the secret who
        puts a key of his own into the challenge (to read the session) admits nobody."""
        secret = new_secret()
        listener, middle = Listener(secret), listen()

        def swap() -> None:
            dialer, _ = middle.accept()
            with dialer, socket.create_connection(listener.address) as upstream:
                challenge = read_frame(upstream)
                dialer.sendall(
                    raw_frame({**challenge, "key": X25519PrivateKey.generate().public_key().public_bytes_raw().hex()})
                )
                upstream.sendall(raw_frame(read_frame(dialer)))  # the hello, as sent
                with contextlib.suppress(EOFError):
                    dialer.sendall(raw_frame(read_frame(upstream)))

        thread = threading.Thread(target=swap, daemon=True)
        thread.start()
        try:
            with pytest.raises(LinkRefused):
                dial(middle.getsockname()[:2], secret=secret, hello={"role": "coordinator"}, caps=ROOMY, timeout=5)
            assert listener.done.wait(5) and listener.refused and not listener.links
            thread.join(5)
        finally:
            middle.close()
            listener.close()

    def test_a_wrong_secret_is_refused_both_ways(self) -> None:
        listener = Listener(new_secret())
        try:
            with pytest.raises(LinkRefused, match="refused our proof"):
                dial(listener.address, secret=new_secret(), hello={"role": "coordinator"}, caps=ROOMY, timeout=5)
            assert listener.done.wait(5) and listener.refused
        finally:
            listener.close()

    def test_a_dialer_sends_nothing_to_an_impostor_listener(self) -> None:
        """Whatever listens at a stale address without the secret is never sent the dialer's
        data: the dialer checks the listener's proof before its first frame."""
        server = listen()
        got: list[bytes] = []

        def impostor() -> None:
            sock, _ = server.accept()
            sock.sendall(raw_frame({"type": "challenge", "version": VERSION, "nonce": "0" * 32, "key": "ab" * 32}))
            hello = read_frame(sock)
            sock.sendall(raw_frame({"type": "admitted", "proof": "f" * 64}))  # cannot prove: no secret
            sock.settimeout(2)
            try:
                got.append(sock.recv(1 << 16))
            except TimeoutError:
                got.append(b"timeout")
            got.append(json.dumps(hello).encode())
            sock.close()

        thread = threading.Thread(target=impostor, daemon=True)
        thread.start()
        try:
            with pytest.raises(LinkRefused, match="did not prove"):
                dial(
                    server.getsockname()[:2],
                    secret=new_secret(),
                    hello={"role": "bridge"},
                    caps=HEADERS_ONLY,
                    timeout=5,
                )
            thread.join(5)
            assert got[0] == b"", "the dialer closed at once and sent nothing after its hello"
        finally:
            server.close()

    def test_a_listener_that_never_greets_is_given_up_on(self) -> None:
        server = listen()  # never accepts: the connection waits in its backlog, and no challenge comes
        raised: list[BaseException] = []

        def dialer() -> None:
            try:
                dial(server.getsockname()[:2], secret=new_secret(), hello={}, caps=HEADERS_ONLY, timeout=0.3)
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                raised.append(exc)

        thread = threading.Thread(target=dialer, daemon=True)
        try:
            thread.start()
            thread.join(30)  # only a bound on a hang: the dial's own timeout ends it
            assert not thread.is_alive(), "the dialer still waits for a challenge"
            assert len(raised) == 1 and isinstance(raised[0], LinkClosed)
            assert "timed out" in str(raised[0]), "its own timeout ended the wait, not the listener"
        finally:
            server.close()

    def test_a_short_secret_is_refused(self) -> None:
        a, b = tcp_pair()
        try:
            with pytest.raises(ValueError, match="at least 32 characters"):
                accept(b, secret="short", caps=ROOMY)
        finally:
            a.close()
            b.close()


class LinkIdentityTests:
    """Issue 50: a listener that admits several peers picks each one's secret by the identity
    it claims (`accept(secret_for=...)`), and refuses an identity it does not expect."""

    def test_the_secret_is_the_claimed_identitys_and_an_unexpected_identity_is_refused(self) -> None:
        mine, theirs = new_secret(), new_secret()
        expected = {("upstream", 1): mine}

        def secret_for(claimed: dict) -> str | None:
            return expected.get((claimed.get("role"), claimed.get("stage")))

        admitted = Listener(None, secret_for=secret_for)
        try:
            link = dial(admitted.address, secret=mine, hello={"role": "upstream", "stage": 1}, caps=ROOMY, timeout=5)
            assert admitted.done.wait(5) and admitted.links[0].peer == {"type": "hello", "role": "upstream", "stage": 1}
            link.close()
        finally:
            admitted.close()
        for secret, hello in (
            (theirs, {"role": "upstream", "stage": 2}),  # its own secret, but not a peer this end expects
            (theirs, {"role": "upstream", "stage": 1}),
        ):  # claims the expected peer without its secret
            listener = Listener(None, secret_for=secret_for)
            try:
                with pytest.raises(LinkRefused, match="refused our proof"):
                    dial(listener.address, secret=secret, hello=hello, caps=ROOMY, timeout=5)
                assert listener.done.wait(5) and listener.refused and not listener.links
            finally:
                listener.close()
        assert "is not one this end expects" in str(_refusal(secret_for, theirs, {"role": "upstream", "stage": 2}))
        with pytest.raises(ValueError, match="not both"):
            accept(socket.socket(), secret=mine, secret_for=secret_for, caps=ROOMY)

    def test_a_peer_of_the_older_protocol_is_told_apart_from_one_without_the_secret(self) -> None:
        server = listen()

        def old_listener() -> None:
            sock, _ = server.accept()
            sock.sendall(raw_frame({"type": "challenge", "nonce": "0" * 32, "key": "ab" * 32}))  # version 2 named none
            with contextlib.suppress(OSError, EOFError):
                read_frame(sock)
            sock.close()

        thread = threading.Thread(target=old_listener, daemon=True)
        thread.start()
        try:
            with pytest.raises(LinkRefused, match="speaks link protocol 2"):
                dial(
                    server.getsockname()[:2],
                    secret=new_secret(),
                    hello={"role": "bridge"},
                    caps=HEADERS_ONLY,
                    timeout=5,
                )
            thread.join(5)
        finally:
            server.close()


def _refusal(secret_for: Callable[[dict], str | None], secret: str, hello: dict) -> LinkRefused:
    """The listener's own refusal of a dialler with `secret` saying `hello`."""
    listener = Listener(None, secret_for=secret_for)
    try:
        with contextlib.suppress(LinkRefused):
            dial(listener.address, secret=secret, hello=hello, caps=ROOMY, timeout=5)
        assert listener.done.wait(5)
        return listener.refused[0]
    finally:
        listener.close()


class PendingHandshakeTests:
    """A stranger who opens connections and never answers the challenge holds at most
    MAX_PENDING_HANDSHAKES of them; past that a listener closes new ones at once (issue 15)."""

    def test_an_expert_worker_closes_connections_past_its_pending_handshakes(self, tmp_path, monkeypatch) -> None:
        from engine.moe_loader import load_expert_slice, make_tiny_moe
        from mahout import link as link_module
        from mahout.moe.worker import ExpertServer, worker_caps

        monkeypatch.setattr(link_module, "MAX_PENDING_HANDSHAKES", 2)
        monkeypatch.setattr(link_module.HandshakeSlots.__init__, "__defaults__", (2,))
        path = make_tiny_moe(tmp_path / "tiny.gguf", seed=3)
        config, bank = load_expert_slice(path, 0, 0, 4)
        secret = new_secret()
        server = ExpertServer(
            bank, secret=secret, caps=worker_caps(d_model=config.d_model, count=4, context_length=config.context_length)
        ).start()
        strangers = [socket.create_connection(server.address, timeout=5) for _ in range(3)]
        try:
            challenged = [s.recv(4096) for s in strangers[:2]]
            assert all(challenged), "the first two are in the handshake: each got the challenge"
            assert strangers[2].recv(4096) == b"", "the third is closed at once, before any challenge"
            deadline = time.monotonic() + 2
            while server.refused < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.refused >= 1
            for stranger in strangers[:2]:
                stranger.close()
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # their slots come back once the worker sees them go
                try:
                    coordinator = dial(
                        server.address, secret=secret, hello={"role": "coordinator"}, caps=HEADERS_ONLY, timeout=5
                    )
                    break
                except (LinkRefused, LinkClosed):
                    time.sleep(0.1)
            else:
                pytest.fail("an honest coordinator could not connect once the strangers left")
            coordinator.close()
        finally:
            for stranger in strangers:
                stranger.close()
            server.close()
