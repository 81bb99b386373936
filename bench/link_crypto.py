"""What sealing costs a link (issue 32): hidden-state frames streamed one way over loopback
through an encrypted link (admitted by the handshake: AES-GCM under its session keys)
versus a plain one (a bare `Link` over a socket, as links were before; the baseline exists
only here and in tests), in the same run.

Frames: micro-batches of 1, 4 and 16 rows of the shipped model's 640-float hidden state
(a ring's decode steps), a prefill pass of 4 rows of 64 tokens, an expert batch (8 rows of
Qwen 3 30B-A3B's 2048-float state: 4 decoding requests with 2 experts each on one worker)
and a 16 MiB frame. A receiving process takes the frames as a next stage would (each
arrives as its own tensor); a round is the time from the first send to the receiver's
answer that it has them all.
Rounds alternate between the plain and the encrypted link (and which goes first) so
machine noise hits both; medians are reported, with encrypted / plain for frames/s and
MB/s (the same ratio: the same frames cross both), and the time sealing adds per frame.
Wall time on a shared machine is noisy, so each side's CPU time per frame (its thread's,
the sender's and the receiver's) is reported too: what sealing costs each end, whatever
else the machine was doing.

Loopback is the worst case for the ratio: nothing but copies and the cipher cost time
here, where a real network adds its own transfer time to both sides (the added time per
frame is what to set against a real link's time per frame).

`--rate` (root, Linux) measures over a link of that bandwidth instead: the same run inside a
network namespace of its own whose loopback the kernel shapes with a token bucket (`tc qdisc
… tbf rate RATE`), as a host's uplink limits a stage's sends; the namespace is removed after.

    .venv/bin/python bench/link_crypto.py [--rounds 7] [--seconds 0.3] [--rate 1gbit]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.queues import Queue
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from mahout.link import FrameCaps, Link, accept, connect, listen, new_secret  # noqa: E402

HIDDEN = 640  # the shipped Gemma 3 270M's hidden width
SIZES = {
    "1 row": (1, HIDDEN),
    "4 rows": (4, HIDDEN),
    "16 rows": (16, HIDDEN),
    "prefill": (4 * 64, HIDDEN),
    "experts": (8, 2048),
    "16 MiB": (4096, 1024),
}
CAPS = FrameCaps(header_bytes=1 << 16, payload_bytes=16 << 20)


def receiver(secret: str, port: Queue) -> None:
    """The receiving agent, in a process of its own as a next stage is: it takes the plain
    link's connection, then the encrypted one's, and on each answers every round's frames
    with ``done``."""
    server = listen()
    port.put(server.getsockname()[1])
    plain = Link(server.accept()[0], "plain", caps=CAPS)
    sealed = accept(server.accept()[0], secret=secret, caps=CAPS)
    server.close()
    threading.Thread(target=serve_rounds, args=(plain,), daemon=True).start()
    serve_rounds(sealed)


def serve_rounds(link: Link) -> None:
    while (header := link.recv()[0])["type"] == "round":
        cpu = time.thread_time()
        for _ in range(header["frames"]):
            link.recv()
        link.send({"type": "done", "cpu_s": time.thread_time() - cpu})


@dataclass
class Round:
    """One round: its wall seconds, and the CPU seconds of the sending and the receiving thread."""

    seconds: float
    sender_cpu_s: float
    receiver_cpu_s: float


def stream(link: Link, rows: torch.Tensor, frames: int) -> Round:
    """A round of `frames` frames, timed from its start to the receiver's ``done``."""
    start, cpu = time.perf_counter(), time.thread_time()
    link.send({"type": "round", "frames": frames})
    for i in range(frames):
        link.send({"type": "batch", "id": i}, rows)
    sender_cpu = time.thread_time() - cpu
    done, _ = link.recv()
    return Round(time.perf_counter() - start, sender_cpu, done["cpu_s"])


def frames_per_round(link: Link, rows: torch.Tensor, seconds: float) -> int:
    """Enough frames for a round of about `seconds` on the plain link (measured once)."""
    probe = 8
    elapsed = stream(link, rows, probe).seconds
    return max(probe, int(probe * seconds / elapsed))


def per_frame_us(rounds: list[Round], frames: int, side: str) -> float:
    """The median CPU µs one frame cost a side ("sender" or "receiver")."""
    return statistics.median(getattr(r, f"{side}_cpu_s") for r in rounds) * 1e6 / frames


def measure(rounds: int, seconds: float) -> None:
    secret, port = new_secret(), get_context("spawn").Queue()
    agent = get_context("spawn").Process(target=receiver, args=(secret, port), daemon=True)
    agent.start()
    address = ("127.0.0.1", port.get(timeout=60))
    links = {
        "plain": Link(socket.create_connection(address), "plain", caps=CAPS),
        "encrypted": connect(address, secret=secret, hello={"role": "upstream"}, caps=CAPS, timeout=10),
    }
    print(
        f"{'frame':>8} {'bytes':>10} {'plain frames/s':>15} {'encrypted frames/s':>19} "
        f"{'plain MB/s':>11} {'encrypted MB/s':>15} {'encrypted / plain':>18} {'added µs/frame':>15}"
        f" {'CPU µs/frame send plain/enc':>28} {'recv plain/enc':>15}"
    )
    try:
        for label, shape in SIZES.items():
            rows = torch.randn(*shape)
            frames = frames_per_round(links["plain"], rows, seconds)
            for link in links.values():  # warm both up
                stream(link, rows, max(2, frames // 4))
            measured: dict[str, list[Round]] = {"plain": [], "encrypted": []}
            for r in range(rounds):
                for kind in ("plain", "encrypted") if r % 2 == 0 else ("encrypted", "plain"):
                    measured[kind].append(stream(links[kind], rows, frames))
            plain, sealed = (
                statistics.median(frames / r.seconds for r in measured[kind]) for kind in ("plain", "encrypted")
            )
            cpu = {
                side: [per_frame_us(measured[kind], frames, side) for kind in ("plain", "encrypted")]
                for side in ("sender", "receiver")
            }
            mb = rows.nbytes / 1e6
            print(
                f"{label:>8} {rows.nbytes:>10} {plain:>15.0f} {sealed:>19.0f} "
                f"{plain * mb:>11.0f} {sealed * mb:>15.0f} {sealed / plain:>18.2f} {1e6 / sealed - 1e6 / plain:>15.0f}"
                f" {cpu['sender'][0]:>19.1f} / {cpu['sender'][1]:<6.1f} "
                f"{cpu['receiver'][0]:>7.1f} / {cpu['receiver'][1]:<6.1f}"
            )
    finally:
        for link in links.values():
            link.send({"type": "stop"})
            link.close()
        agent.join(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.3, help="about how long one round streams")
    parser.add_argument("--rate", help="shape the link to this bandwidth (tc's units: 100mbit, 1gbit); needs root")
    args = parser.parse_args()
    if args.rate and os.environ.get(_SHAPED) != args.rate:
        shaped(args.rate)
        return
    torch.set_num_threads(1)
    if args.rate:
        print(f"over loopback shaped to {args.rate} (tc tbf, namespace {_NETNS})")
    measure(args.rounds, args.seconds)


_NETNS, _SHAPED = "eh-linkbench", "LINK_BENCH_SHAPED"


def shaped(rate: str) -> None:
    """Run this script again inside a namespace whose loopback sends at `rate`; remove it after."""

    def ip(*words: str) -> None:
        subprocess.run(["ip", *words], check=True)

    subprocess.run(["ip", "netns", "del", _NETNS], capture_output=True)  # (one a killed run left)
    ip("netns", "add", _NETNS)
    try:
        ip("-n", _NETNS, "link", "set", "lo", "up")
        # burst: a few ms of the rate (at least 64 KiB); latency: how long a packet may queue
        subprocess.run(
            [
                "tc",
                "-n",
                _NETNS,
                "qdisc",
                "add",
                "dev",
                "lo",
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "256kb",
                "latency",
                "50ms",
            ],
            check=True,
        )
        subprocess.run(
            ["ip", "netns", "exec", _NETNS, sys.executable, *sys.argv], check=True, env={**os.environ, _SHAPED: rate}
        )
    finally:
        subprocess.run(["ip", "netns", "del", _NETNS], capture_output=True)


if __name__ == "__main__":
    main()
