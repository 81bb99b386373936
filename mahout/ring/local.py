"""Start a whole ring on this machine: stage processes (the CLI, benchmarks) or stage threads
(fast tests). Either way every stage is a `StageAgent` on its own loopback port and the
stages talk to each other directly; the bridge connects only to the head and the tail.
The ring makes its own link secrets (`mahout.ring.keys.ring_keys`: one per link, each stage
handed its own links' only): its stages and its bridge admit nobody else, and stage processes
receive theirs in their environment, not on a command line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from engine.generate import build_stages, even_split
from engine.model import Stage
from mahout.link import listen
from mahout.ring.bridge import RingBridge
from mahout.ring.keys import ring_keys
from mahout.ring.membership import Limits
from mahout.ring.stage import KEYS_ENV, StageAgent, keys_to_env

__all__ = ["ProcessRing", "ThreadRing", "split_layers"]

ROOT = Path(__file__).resolve().parents[2]


def split_layers(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Even contiguous slices; a pipeline needs at least two stages."""
    if n_stages < 2:
        raise ValueError("a pipeline needs at least two stages")
    return even_split(n_layers, n_stages)


class ThreadRing:
    """A ring whose stages are threads of this process (each still behind its own socket)."""

    def __init__(
        self,
        model_path: str | Path,
        ranges: Sequence[tuple[int, int]],
        *,
        limits: Limits,
        slots: int | None = None,
        n_ctx: int = 512,
        stages: Sequence[Stage] | None = None,
    ) -> None:
        """`stages`, if given, are used as they are instead of being loaded for `ranges`."""
        if len(ranges) < 2:
            raise ValueError("a pipeline needs at least two stages")
        if stages is None:
            stages = build_stages(
                model_path, ranges, n_rows=slots or 2 * limits.micro_batch, n_ctx=n_ctx, share_output=True
            )
        self.keys = ring_keys(len(stages))
        servers = [listen() for _ in stages]
        addresses = [server.getsockname()[:2] for server in servers]
        self.agents = [
            StageAgent(
                stage,
                limits=limits,
                keys=self.keys[i],
                next_address=addresses[(i + 1) % len(stages)],
                server=servers[i],
                vocab_path=model_path,
            )
            for i, stage in enumerate(stages)
        ]
        self.threads = [
            threading.Thread(target=self._serve, args=(a,), name=f"stage{a.index}", daemon=True) for a in self.agents
        ]
        for thread in self.threads:
            thread.start()
        self.bridge = RingBridge(addresses[0], addresses[-1], keys=self.keys.bridge)

    @staticmethod
    def _serve(agent: StageAgent) -> None:
        try:
            agent.serve()
        except Exception:  # noqa: BLE001 - kept on agent.error; the ring tears itself down
            pass

    def close(self) -> None:
        self.bridge.close()
        for agent in self.agents:
            agent.close()
        for thread in self.threads:
            thread.join(timeout=10)

    def __enter__(self) -> ThreadRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ProcessRing:
    """A ring of `python -m mahout.ring.stage` processes on loopback."""

    def __init__(
        self,
        model_path: str | Path,
        ranges: Sequence[tuple[int, int]],
        *,
        limits: Limits,
        threads: int = 1,
        slots: int | None = None,
        n_ctx: int = 512,
        ready_timeout: float = 180.0,
        share_output: bool = True,
        stage_module: Sequence[str] = ("mahout.ring.stage",),
    ) -> None:
        """`share_output=False` keeps the whole output head at the tail (for comparisons);
        `stage_module` runs the stages from another entry point (a benchmark's baseline:
        ``("bench.unsealed", "mahout.ring.stage")``)."""
        if len(ranges) < 2:
            raise ValueError("a pipeline needs at least two stages")
        ports = [_free_port() for _ in ranges]
        self.keys = ring_keys(len(ranges))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.procs: list[subprocess.Popen[str]] = []
        for i, (start, end) in enumerate(ranges):
            command = [
                sys.executable,
                "-m",
                *stage_module,
                "--model",
                str(model_path),
                "--start",
                str(start),
                "--end",
                str(end),
                "--index",
                str(i),
                "--stages",
                str(len(ranges)),
                "--listen",
                f"127.0.0.1:{ports[i]}",
                "--next",
                f"127.0.0.1:{ports[(i + 1) % len(ranges)]}",
                "--micro-batch",
                str(limits.micro_batch),
                "--row-width",
                str(limits.row_width),
                "--n-ctx",
                str(n_ctx),
                "--threads",
                str(threads),
                *(["--slots", str(slots)] if slots else []),
                *([] if share_output else ["--whole-output"]),
            ]
            stage_env = {**env, KEYS_ENV: keys_to_env(self.keys[i])}  # its own links' secrets only
            self.procs.append(
                subprocess.Popen(
                    command, cwd=ROOT, env=stage_env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
                )
            )
        try:
            self._wait_ready(ready_timeout)
            self.bridge = RingBridge(("127.0.0.1", ports[0]), ("127.0.0.1", ports[-1]), keys=self.keys.bridge)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for i, proc in enumerate(self.procs):
            assert proc.stdout is not None
            line = ""
            while "READY" not in line:  # readline blocks; a dead process gives "" at once
                if time.monotonic() > deadline:
                    raise TimeoutError(f"stage {i} was not ready within {timeout:.0f} s")
                line = proc.stdout.readline()
                if not line and proc.poll() is not None:
                    why = proc.stderr.read() if proc.stderr else ""
                    raise RuntimeError(f"stage {i} exited with code {proc.returncode}: {why}")

    def close(self) -> None:
        bridge = getattr(self, "bridge", None)
        if bridge is not None:
            bridge.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()

    def __enter__(self) -> ProcessRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
