"""What sealing costs a link (issue 32): hidden-state frames streamed one way over loopback
through an encrypted link (admitted by the handshake: AES-GCM under its session keys)
versus a plain one (a bare `Link` over a socket, as links were before; the baseline exists
only here and in tests), in the same run.

Frames: micro-batches of 1, 4 and 16 rows of the shipped model's 640-float hidden state,
and a 16 MiB frame. A receiver thread takes the frames as a stage would (each arrives as
its own tensor); a round is the time from the first send to the last frame received.
Rounds alternate between the plain and the encrypted link (and which goes first) so
machine noise hits both; medians are reported, with encrypted / plain for frames/s and
MB/s (the same ratio: the same frames cross both).

Loopback is the worst case for the ratio: nothing but copies and the cipher cost time
here, where a real network adds its own transfer time to both sides.

    .venv/bin/python bench/link_crypto.py [--rounds 7] [--seconds 0.3]
"""
from __future__ import annotations

import argparse
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from mahout.link import FrameCaps, Link, accept, connect, listen, new_secret  # noqa: E402

HIDDEN = 640  # the shipped Gemma 3 270M's hidden width
SIZES = {"1 row": (1, HIDDEN), "4 rows": (4, HIDDEN), "16 rows": (16, HIDDEN), "16 MiB": (4096, 1024)}
CAPS = FrameCaps(header_bytes=1 << 16, payload_bytes=16 << 20)


def plain_pair() -> tuple[Link, Link]:
    server = listen()
    sender = Link(socket.create_connection(server.getsockname()[:2]), "plain", caps=CAPS)
    receiver = Link(server.accept()[0], "plain", caps=CAPS)
    server.close()
    return sender, receiver


def sealed_pair() -> tuple[Link, Link]:
    secret, server, accepted = new_secret(), listen(), []
    thread = threading.Thread(target=lambda: accepted.append(accept(server.accept()[0], secret=secret, caps=CAPS)))
    thread.start()
    sender = connect(server.getsockname()[:2], secret=secret, hello={"role": "upstream"}, caps=CAPS, timeout=5)
    thread.join(5)
    server.close()
    return sender, accepted[0]


def stream_seconds(sender: Link, receiver: Link, rows: torch.Tensor, frames: int) -> float:
    """Seconds to send `frames` frames of `rows` and receive them all on another thread."""
    done = threading.Event()

    def receive() -> None:
        for _ in range(frames):
            receiver.recv()
        done.set()

    reader = threading.Thread(target=receive)
    start = time.perf_counter()
    reader.start()
    for i in range(frames):
        sender.send({"type": "batch", "id": i}, rows)
    done.wait()
    elapsed = time.perf_counter() - start
    reader.join()
    return elapsed


def frames_per_round(pair: tuple[Link, Link], rows: torch.Tensor, seconds: float) -> int:
    """Enough frames for a round of about `seconds` on the plain link (measured once)."""
    probe = 8
    elapsed = stream_seconds(*pair, rows, probe)
    return max(probe, int(probe * seconds / elapsed))


def measure(rounds: int, seconds: float) -> None:
    links = {"plain": plain_pair(), "encrypted": sealed_pair()}
    print(f"{'frame':>8} {'bytes':>10} {'plain frames/s':>15} {'encrypted frames/s':>19} "
          f"{'plain MB/s':>11} {'encrypted MB/s':>15} {'encrypted / plain':>18}")
    try:
        for label, shape in SIZES.items():
            rows = torch.randn(*shape)
            frames = frames_per_round(links["plain"], rows, seconds)
            for pair in links.values():  # warm both up
                stream_seconds(*pair, rows, max(2, frames // 4))
            rates: dict[str, list[float]] = {"plain": [], "encrypted": []}
            for r in range(rounds):
                for kind in (("plain", "encrypted") if r % 2 == 0 else ("encrypted", "plain")):
                    rates[kind].append(frames / stream_seconds(*links[kind], rows, frames))
            plain, sealed = statistics.median(rates["plain"]), statistics.median(rates["encrypted"])
            mb = rows.nbytes / 1e6
            print(f"{label:>8} {rows.nbytes:>10} {plain:>15.0f} {sealed:>19.0f} "
                  f"{plain * mb:>11.0f} {sealed * mb:>15.0f} {sealed / plain:>18.2f}")
    finally:
        for sender, receiver in links.values():
            sender.close()
            receiver.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.3, help="about how long one round streams")
    args = parser.parse_args()
    torch.set_num_threads(1)
    measure(args.rounds, args.seconds)


if __name__ == "__main__":
    main()
