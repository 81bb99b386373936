"""The expert dispatch's link (`mahout.link`, shared with the ring) sends and reads frames without
copies: tensors of any layout arrive exact, and a large frame arrives whole."""
from __future__ import annotations

import socket
import threading

import torch

from mahout.link import Link, listen


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    server = listen()
    client = socket.create_connection(server.getsockname()[:2])
    accepted, _ = server.accept()
    server.close()
    return client, accepted


class LinkTests:
    def test_it_carries_tensors_of_any_layout_and_bare_headers_both_ways(self) -> None:
        a, b = tcp_pair()
        ours, theirs = Link(a, "ours"), Link(b, "theirs")
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
        ours, theirs = Link(a, "ours"), Link(b, "theirs")
        rows = torch.randn(512, 2048)  # 4 MiB: far more than a socket buffer
        received: list = []
        reader = threading.Thread(target=lambda: received.append(theirs.recv()))
        reader.start()
        try:
            ours.send({"type": "compute"}, rows)
            reader.join(10)
            (_, got), = received
            assert torch.equal(got, rows)
        finally:
            ours.close()
            theirs.close()
