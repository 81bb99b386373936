"""Admitted links are encrypted as well as authenticated (`mahout.link`, issue 32): frames
still arrive exact; what crosses the wire shows neither the hidden state nor the header;
and a frame that a man in the middle altered, replayed, reordered or dropped drops the
link. The wire is watched and tampered with by a relay between the two ends (`Wiretap`),
as a router on the path could."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time

import pytest
import torch

from mahout.link import GATHER_BYTES, RECORD_BYTES, FrameCaps, Link, LinkClosed, accept, connect, listen, new_secret

ROOMY = FrameCaps(header_bytes=1 << 16, payload_bytes=8 << 20)
HIDDEN = 640  # the shipped model's hidden width
PREFIX_AND_TAG = 8 + 16  # a sealed headers-only frame: the clear >II prefix, then the header and its tag
TAG = 16
MIDDLE = GATHER_BYTES // (4 * HIDDEN) + 1  # rows of a frame too large to gather: its header, then its payload
LARGE = (2 * RECORD_BYTES + 1000) // (4 * HIDDEN) + 1  # rows of a frame whose payload takes three records


class Wiretap:
    """A TCP relay from a dialer to `target`: it records every byte the dialer sends, can
    flip one of them on the way, or hold them back (the test then delivers what it likes)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.server = listen()
        self.address = self.server.getsockname()[:2]
        self.target = target
        self.sent = bytearray()  # dialer to listener, as it crossed the wire
        self.flip_at: int | None = None
        self.hold = False
        self.ready = threading.Event()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        dialer, _ = self.server.accept()
        self.to_listener = socket.create_connection(self.target)
        self.sockets += [dialer, self.to_listener]
        self.ready.set()
        threading.Thread(target=self._pump, args=(self.to_listener, dialer, False), daemon=True).start()
        self._pump(dialer, self.to_listener, True)

    def _pump(self, source: socket.socket, sink: socket.socket, tapped: bool) -> None:
        try:
            while chunk := bytearray(source.recv(1 << 16)):
                if tapped:
                    start = len(self.sent)
                    if self.flip_at is not None and start <= self.flip_at < start + len(chunk):
                        chunk[self.flip_at - start] ^= 0x01
                    self.sent += chunk
                    if self.hold:
                        continue
                sink.sendall(chunk)
        except OSError:
            pass  # the test closed the ends

    def wait_for(self, size: int) -> bytes:
        """The first `size` bytes the dialer sent (once they have all reached the tap)."""
        deadline = time.monotonic() + 5
        while len(self.sent) < size:
            assert time.monotonic() < deadline, f"the tap saw {len(self.sent)} of {size} bytes"
            time.sleep(0.005)
        return bytes(self.sent[:size])

    def close(self) -> None:
        self.server.close()
        for sock in self.sockets:
            sock.close()


def admitted_pair(secret: str, *, tapped: bool = True) -> tuple[Link, Link, Wiretap | None]:
    """(dialer's link, listener's link, the tap between them), both past the handshake."""
    server = listen()
    accepted: list[Link] = []
    thread = threading.Thread(target=lambda: accepted.append(accept(server.accept()[0], secret=secret, caps=ROOMY)))
    thread.start()
    tap = Wiretap(server.getsockname()[:2]) if tapped else None
    address = tap.address if tap else server.getsockname()[:2]
    dialer = connect(address, secret=secret, hello={"role": "upstream"}, caps=ROOMY, timeout=5)
    thread.join(5)
    server.close()
    return dialer, accepted[0], tap


def headers_only_size(header: dict) -> int:
    return PREFIX_AND_TAG + len(json.dumps(header, separators=(",", ":")))


def record_sizes(wire: bytes) -> list[int]:
    """The sizes on the wire of the sealed records of the frame `wire` starts with (each with
    its tag): one when the body is small, else the header's, then the payload's."""
    n_head, n_payload = struct.unpack(">II", wire[:8])
    if n_head + n_payload <= GATHER_BYTES:
        return [n_head + n_payload + TAG]
    full, rest = divmod(n_payload, RECORD_BYTES)
    return [n_head + TAG, *[RECORD_BYTES + TAG] * full, *([rest + TAG] if rest else [])]


def close_all(*things: Link | Wiretap | None) -> None:
    for thing in things:
        if thing is not None:
            thing.close()


class SealedLinkTests:
    def test_it_carries_tensors_and_bare_headers_both_ways(self) -> None:
        dialer, listener, _ = admitted_pair(new_secret(), tapped=False)
        try:
            rows = torch.randn(4, HIDDEN)
            for n in range(3):  # each frame under the next nonce
                dialer.send({"type": "batch", "n": n}, rows * n)
                header, got = listener.recv()
                assert header == {"type": "batch", "n": n, "dtype": "float32", "shape": [4, HIDDEN]}
                assert got is not None and torch.equal(got, rows * n)
            listener.send({"type": "result"}, rows.T)  # a non-contiguous tensor
            _, got = dialer.recv()
            assert got is not None and torch.equal(got, rows.T)
            got += 1  # the received tensor owns a writable buffer
            listener.send({"type": "done"})
            assert dialer.recv() == ({"type": "done"}, None)
        finally:
            close_all(dialer, listener)

    def test_the_wire_shows_neither_the_hidden_state_nor_the_header(self) -> None:
        rows = torch.full((16, HIDDEN), 1234.5)
        pattern = struct.pack("<f", 1234.5) * 4
        dialer, listener, tap = admitted_pair(new_secret())
        assert tap is not None
        try:
            dialer.send({"type": "batch", "secret_prompt": "elephants never forget"}, rows)
            _, got = listener.recv()
            assert got is not None and torch.equal(got, rows)
            assert pattern not in tap.sent and b"elephants never forget" not in tap.sent
        finally:
            close_all(dialer, listener, tap)

    def test_the_tap_does_see_a_plain_links_hidden_state(self) -> None:
        """The control for the test above: the same frame over an unsealed link is readable."""
        server = listen()
        tap = Wiretap(server.getsockname()[:2])
        ours = Link(socket.create_connection(tap.address), "plain", caps=ROOMY)
        theirs = Link(server.accept()[0], "plain", caps=ROOMY)
        try:
            ours.send({"type": "batch"}, torch.full((16, HIDDEN), 1234.5))
            theirs.recv()
            assert struct.pack("<f", 1234.5) * 4 in tap.sent
        finally:
            server.close()
            close_all(ours, theirs, tap)

    @pytest.mark.parametrize(
        "rows", [1, 16, MIDDLE, LARGE], ids=["one_record", "gathered", "header_and_payload", "payload_in_records"]
    )
    def test_a_frame_is_sealed_in_records_and_arrives_exact(self, rows: int) -> None:
        """A hidden state of a few rows is one record (one AEAD call each side); a larger frame
        its header, then its payload in records of at most RECORD_BYTES; the payload starts
        8-aligned in the body (the header padded), and the wire holds nothing else."""
        dialer, listener, tap = admitted_pair(new_secret())
        assert tap is not None
        try:
            start, sent = len(tap.sent), torch.randn(rows, HIDDEN)
            dialer.send({"type": "batch", "n": rows}, sent)
            header, got = listener.recv()
            assert header == {"type": "batch", "n": rows, "dtype": "float32", "shape": [rows, HIDDEN]}
            assert got is not None and torch.equal(got, sent)
            n_head, n_payload = struct.unpack(">II", tap.sent[start : start + 8])
            assert n_head % 8 == 0 and n_payload == sent.nbytes
            sizes = record_sizes(bytes(tap.sent[start:]))
            assert len(sizes) == {1: 1, 16: 1, MIDDLE: 2, LARGE: 4}[rows]
            assert tap.wait_for(start + 8 + sum(sizes)) and len(tap.sent) == start + 8 + sum(sizes)
        finally:
            close_all(dialer, listener, tap)

    def test_two_sessions_over_the_same_secret_seal_the_same_frame_differently(self) -> None:
        """Fresh keys per session: the nonce counter restarts, so reusing a key would be fatal."""
        secret, frame, seen = new_secret(), {"type": "batch"}, []
        for _ in range(2):
            dialer, listener, tap = admitted_pair(secret)
            assert tap is not None
            try:
                start = len(tap.sent)
                dialer.send(frame, torch.zeros(1, HIDDEN))
                listener.recv()
                seen.append(bytes(tap.sent[start + 8 :]))  # after the clear prefix
            finally:
                close_all(dialer, listener, tap)
        assert seen[0] != seen[1]


class TamperingTests:
    @pytest.mark.parametrize("offset", [8 + 3, 8 + 200], ids=["in_the_header", "in_the_hidden_state"])
    def test_a_flipped_bit_drops_the_link(self, offset: int) -> None:
        dialer, listener, tap = admitted_pair(new_secret())
        assert tap is not None
        try:
            tap.flip_at = len(tap.sent) + offset
            dialer.send({"type": "batch"}, torch.randn(16, HIDDEN))
            with pytest.raises(LinkClosed, match="failed its authentication"):
                listener.recv()
        finally:
            close_all(dialer, listener, tap)

    @pytest.mark.parametrize("order", [(0, 0), (1, 0), (1,)], ids=["replayed", "reordered", "one_dropped"])
    def test_a_frame_out_of_its_place_drops_the_link(self, order: tuple[int, ...]) -> None:
        dialer, listener, tap = admitted_pair(new_secret())
        assert tap is not None
        try:
            start, tap.hold = len(tap.sent), True
            frames = [{"type": "batch", "n": 0}, {"type": "batch", "n": 1}]
            for frame in frames:
                dialer.send(frame)
            ends = [start + headers_only_size(frames[0])]
            ends.append(ends[0] + headers_only_size(frames[1]))
            wire = tap.wait_for(ends[1])
            sealed = [wire[start : ends[0]], wire[ends[0] : ends[1]]]
            for n in order:
                tap.to_listener.sendall(sealed[n])
            if order[0] == 0:  # the genuine first frame still arrives, its replay does not
                assert listener.recv() == (frames[0], None)
            with pytest.raises(LinkClosed, match="failed its authentication"):
                listener.recv()
        finally:
            close_all(dialer, listener, tap)

    @pytest.mark.parametrize("change", ["flipped_in_the_last_record", "records_swapped", "record_dropped"])
    def test_a_large_frame_with_a_record_out_of_its_place_drops_the_link(self, change: str) -> None:
        """Each record has its own tag and nonce: a record of a large frame altered, moved within
        the frame or missing fails its authentication (the next frame's first record then stands
        in for the missing one)."""
        dialer, listener, tap = admitted_pair(new_secret())
        assert tap is not None
        try:
            start, tap.hold = len(tap.sent), True
            dialer.send({"type": "batch"}, torch.randn(LARGE, HIDDEN))
            dialer.send({"type": "next"}, torch.randn(1, HIDDEN))
            prefix = tap.wait_for(start + 8)[start:]
            sizes = record_sizes(prefix)
            ends = [start + 8 + sum(sizes[: i + 1]) for i in range(len(sizes))]
            wire = bytearray(tap.wait_for(ends[-1] + 8 + TAG + 2 * 1024))[start:]
            records = [wire[8 + sum(sizes[:i]) : 8 + sum(sizes[: i + 1])] for i in range(len(sizes))]
            after = wire[8 + sum(sizes) :]
            if change == "flipped_in_the_last_record":
                records[-1][-TAG - 1] ^= 0x01
            elif change == "records_swapped":
                records[1], records[2] = records[2], records[1]
            else:
                del records[1]
            tap.to_listener.sendall(bytes(wire[:8] + b"".join(records) + after))
            with pytest.raises(LinkClosed, match="failed its authentication"):
                listener.recv()
        finally:
            close_all(dialer, listener, tap)
