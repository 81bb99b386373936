"""An expert worker: holds experts [first, first + count) of one layer and computes them for
the rows a coordinator sends.

It loads only its slice (`engine.moe_loader.load_expert_slice`, from the model file or from
the slice file the gateway serves) and listens on TCP. Frames are `mahout.link`'s (a JSON
header plus raw float32 bytes; nothing is unpickled), sent and read without copies. After
the coordinator's ``hello``, each ``compute`` frame carries ``layer``, ``experts`` and
``counts`` (rows per expert, in order) and the rows (N, D) concatenated; the answer is a
``result`` frame with the outputs (N, D) in the same order, or an ``error`` frame.

`python -m mahout.moe.worker --model PATH --layer L --first F --count C [--port P]` prints
``expert worker listening on HOST:PORT`` once it serves.
"""
from __future__ import annotations

import argparse
import socket
import sys
import threading
import time

import torch

from engine.moe import ExpertBank
from engine.moe_loader import load_expert_slice
from mahout.link import Link, LinkClosed, listen

__all__ = ["ExpertServer", "main", "pack_rows", "unpack_rows"]


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
    """Serves one bank on a listening socket, one thread per coordinator connection."""

    def __init__(self, bank: ExpertBank, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.bank = bank
        self._server = listen(host, port)
        self.address: tuple[str, int] = self._server.getsockname()[:2]
        self.served = 0
        self._links: list[Link] = []
        self._closed = threading.Event()

    def start(self) -> ExpertServer:
        threading.Thread(target=self._accept, name="moe-worker-accept", daemon=True).start()
        return self

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self._server.accept()
            except OSError:
                return
            link = Link(sock, f"coordinator {peer[0]}:{peer[1]}")
            self._links.append(link)
            threading.Thread(target=self._serve, args=(link,), name="moe-worker-link", daemon=True).start()

    def _serve(self, link: Link) -> None:
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
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    _, bank = load_expert_slice(args.model, args.layer, args.first, args.count)
    server = ExpertServer(bank, host=args.host, port=args.port).start()
    print(f"expert worker listening on {server.address[0]}:{server.address[1]}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
