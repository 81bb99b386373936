"""An expert worker: holds experts [first, first + count) of one layer and computes them for
the rows a coordinator sends.

It loads only its slice (`engine.moe_loader.load_expert_slice`, from the model file or from
the slice file the gateway serves) and listens on TCP. Frames are `mahout.link`'s (a JSON
header plus raw float32 bytes; nothing is unpickled), sent and read without copies. A
connection is admitted only through the link handshake with the worker's secret (the
gateway hands it to this worker's volunteer and to the model's coordinator, nobody else): a
stranger gets the challenge and is dropped, and computes nothing. Then each ``compute``
frame carries ``layer``, ``experts`` and ``counts`` (rows per expert, in order) and the rows
(N, D) concatenated; the answer is a ``result`` frame with the outputs (N, D) in the same
order, or an ``error`` frame. Frames are capped by what the slice can be asked
(`worker_caps`: every expert of the slice over a whole context window), not 1 GiB.

While its owner wants the machine back (`mahout.owner`: the pause flag, serving hours, input)
the server answers every compute frame with an error frame: the coordinator takes it as a
failed worker and computes those experts itself, so no request breaks.

`python -m mahout.moe.worker --model PATH --layer L --first F --count C [--port P]`, with the
secret in ``MAHOUT_MOE_SECRET``, prints ``expert worker listening on HOST:PORT`` once it serves.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from collections.abc import Callable

import torch

from engine.device import add_device_argument
from engine.moe import ExpertBank
from engine.moe_loader import load_expert_slice
from mahout.home import resolve_home
from mahout.link import FrameCaps, HandshakeSlots, Link, LinkClosed, LinkRefused, accept, listen
from mahout.owner import OwnerWatch, add_owner_arguments, announce, owner_guard

__all__ = ["SECRET_ENV", "ExpertServer", "main", "pack_rows", "unpack_rows", "worker_caps"]

SECRET_ENV = "MAHOUT_MOE_SECRET"
HEADER_BYTES = 64 * 1024  # a compute frame's header: ids, the slice's experts and their row counts
FLOAT32_BYTES = 4


def worker_caps(*, d_model: int, count: int, context_length: int) -> FrameCaps:
    """The largest compute frame a slice of `count` experts can be sent: every one of its
    experts with a row for each token of a whole context window (a token picks an expert at
    most once), float32 rows of `d_model`."""
    return FrameCaps(header_bytes=HEADER_BYTES, payload_bytes=context_length * count * d_model * FLOAT32_BYTES)


def pack_rows(inputs: dict[int, torch.Tensor]) -> tuple[list[int], list[int], torch.Tensor]:
    """{expert: rows (N_e, D)} -> (experts, counts, rows (N, D)) in ascending expert order."""
    experts = sorted(inputs)
    return experts, [int(inputs[e].shape[0]) for e in experts], torch.cat([inputs[e] for e in experts])


def unpack_rows(experts: list[int], counts: list[int], rows: torch.Tensor) -> dict[int, torch.Tensor]:
    """The inverse of `pack_rows`; refuses counts that do not add up to the rows."""
    if len(experts) != len(counts) or sum(counts) != rows.shape[0]:
        raise ValueError(f"{len(experts)} experts with counts summing to {sum(counts)} for {rows.shape[0]} rows")
    return dict(zip(experts, torch.split(rows, counts), strict=True))


class ExpertServer:
    """Serves one bank on a listening socket, one thread per coordinator connection; admits
    only a peer that proves it holds `secret`, and reads frames within `caps`."""

    def __init__(
        self,
        bank: ExpertBank,
        *,
        secret: str,
        caps: FrameCaps,
        host: str = "127.0.0.1",
        port: int = 0,
        refusal: Callable[[], str | None] | None = None,
    ) -> None:
        if not secret:
            raise ValueError("an expert worker needs the secret the gateway issued for it")
        self.bank = bank
        self.secret = secret
        self.refusal = refusal  # why not to compute now (the owner wants the machine), read on every batch
        self.caps = caps
        self._server = listen(host, port)
        self.address: tuple[str, int] = self._server.getsockname()[:2]
        self.served = 0
        self.refused = 0  # connections dropped at the handshake
        self._links: list[Link] = []
        self._closed = threading.Event()
        self._handshakes = HandshakeSlots()

    def start(self) -> ExpertServer:
        threading.Thread(target=self._accept, name="moe-worker-accept", daemon=True).start()
        return self

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self._server.accept()
            except OSError:
                return
            if not self._handshakes.take(sock):  # too many strangers mid-handshake: this one is closed
                self.refused += 1
                continue
            name = f"coordinator {peer[0]}:{peer[1]}"
            threading.Thread(target=self._serve, args=(sock, name), name="moe-worker-link", daemon=True).start()

    def _serve(self, sock: socket.socket, name: str) -> None:
        """The handshake on this connection's own thread, then compute frames until it closes."""
        try:
            link = accept(sock, secret=self.secret, caps=self.caps, name=name)
        except LinkRefused:
            self.refused += 1
            return
        finally:
            self._handshakes.give_back()
        self._links.append(link)
        try:
            while True:
                header, rows = link.recv()
                if header.get("type") == "compute":
                    link.send(*self.answer(header, rows))
        except LinkClosed:
            link.close()

    def answer(self, header: dict, rows: torch.Tensor | None) -> tuple[dict, torch.Tensor | None]:
        """One compute frame -> its result frame (or an error frame)."""
        started = time.perf_counter()
        owner = self.refusal() if self.refusal is not None else None
        if owner:  # the coordinator takes an error as a failed worker and computes these experts itself
            return {
                "type": "error",
                "id": header.get("id"),
                "message": f"this machine is its owner's now ({owner})",
            }, None
        try:
            if rows is None or header.get("layer") != self.bank.layer:
                raise ValueError(f"this worker holds layer {self.bank.layer}, not {header.get('layer')}")
            inputs = unpack_rows(header["experts"], header["counts"], rows)
            with torch.inference_mode():
                outputs = self.bank.compute_many(inputs)
        except (KeyError, ValueError, RuntimeError) as exc:
            return {"type": "error", "id": header.get("id"), "message": str(exc)}, None
        self.served += 1
        ms = (time.perf_counter() - started) * 1000
        experts, counts, out = pack_rows(outputs)
        return {"type": "result", "id": header.get("id"), "experts": experts, "counts": counts, "compute_ms": ms}, out

    def close(self) -> None:
        self._closed.set()
        try:
            self._server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._server.close()
        for link in self._links:
            link.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mahout.moe.worker")
    parser.add_argument("--model", required=True, help="the MoE GGUF, or the slice file the gateway served")
    parser.add_argument("--layer", type=int, required=True)
    parser.add_argument("--first", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--home", help="state directory whose pause flag counts (default: $MAHOUT_HOME or ~/.mahout)")
    add_owner_arguments(parser)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    secret = os.environ.get(SECRET_ENV, "")
    if not secret:
        print(
            f"expert worker: set {SECRET_ENV} to the worker's secret (its coordinator holds the same)",
            file=sys.stderr,
            flush=True,
        )
        return 2
    torch.set_num_threads(args.threads)
    config, bank = load_expert_slice(args.model, args.layer, args.first, args.count)
    if args.device.type != "cpu":
        bank.to_device(args.device)
    caps = worker_caps(d_model=config.d_model, count=args.count, context_length=config.context_length)
    watch = OwnerWatch(
        owner_guard(args, resolve_home(args.home)),
        announce(
            lambda line: print(line, flush=True),
            "expert worker",
            paused="refusing batches (its coordinator computes them)",
            resumed="computing batches",
        ),
    )
    server = ExpertServer(
        bank, secret=secret, caps=caps, host=args.host, port=args.port, refusal=lambda: watch.reason
    ).start()
    print(f"expert worker listening on {server.address[0]}:{server.address[1]}", flush=True)
    watch.start()
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    watch.stop()
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
