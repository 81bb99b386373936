"""`mahout stage` leaves the machine to its owner: two real stage processes form a ring through
a fake control plane; the pause flag in one stage's home makes it leave the ring (the bridge
sees the ring break), clear the address it listened at (nobody dials a stale one) and join
none while set; cleared, it binds again and reports its new address to rejoin. A stage stopped
by SIGTERM clears its address too."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mahout.credentials import TOKEN_ENV
from mahout.home import set_paused
from mahout.ring.api import RingApi
from mahout.ring.rendezvous import RendezvousTimeout, bridge_connect
from mahout.tests.fake_gateway import TOKEN
from mahout.tests.test_ring_cli import ENGINE_TOKENS, ROOT, RingGateway


class StageProcess:
    """`python -m mahout stage` for stage `index` of ring 1, its output collected line by line."""

    def __init__(self, url: str, index: int, home: Path) -> None:
        self.lines: list[str] = []
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mahout",
                "stage",
                "--server",
                url,
                "--ring",
                "1",
                "--stage",
                str(index),
                "--bind",
                "127.0.0.1:0",
                "--n-ctx",
                "128",
                "--wait",
                "120",
                "--home",
                str(home),
                "--no-idle-detect",
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, TOKEN_ENV: TOKEN},
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def said(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


def _eventually(check: Callable[[], object], what: str, stages: list[StageProcess], deadline_s: float = 180) -> None:
    ends = time.monotonic() + deadline_s
    while not check():
        assert all(s.process.poll() is None for s in stages), "\n".join(line for s in stages for line in s.lines)
        assert time.monotonic() < ends, f"never happened: {what}\n" + "\n".join(
            line for s in stages for line in s.lines
        )
        time.sleep(0.1)


@pytest.fixture
def prompt() -> list[int]:
    from engine.gguf_loader import default_model_path
    from engine.tokenizer import Tokenizer

    return Tokenizer(default_model_path()).encode("The capital of France is")


@pytest.fixture
def ring(tmp_path: Path) -> Iterator[tuple[RingGateway, list[StageProcess], list[Path]]]:
    homes = [tmp_path / "stage0", tmp_path / "stage1"]
    with RingGateway() as gateway:
        gateway.n_stages = 2
        stages = [StageProcess(gateway.url, i, home) for i, home in enumerate(homes)]
        try:
            yield gateway, stages, homes
        finally:
            for stage in stages:
                stage.stop()


class StageOwnerTests:
    def test_the_pause_flag_makes_a_stage_leave_its_ring_and_clearing_it_rejoins(
        self,
        ring: tuple[RingGateway, list[StageProcess], list[Path]],
        prompt: list[int],
    ) -> None:
        gateway, stages, homes = ring
        api = RingApi(gateway.url, TOKEN)
        try:
            bridge = bridge_connect(api, 1, 2, keys=gateway.keys.bridge, timeout=180, say=lambda _line: None)
            assert bridge.submit(prompt, 4).result() == ENGINE_TOKENS[:4]

            left_from = gateway.addresses[1]
            set_paused(homes[1], True)
            _eventually(lambda: bridge.down.is_set(), "the bridge seeing the ring break", stages)
            _eventually(lambda: (1, left_from) in gateway.left, "the paused stage clearing its address", stages)
            assert 1 not in gateway.addresses
            _eventually(
                lambda: stages[1].said("stage 1: paused (pause flag set): not joining the ring until free"),
                "the paused stage refusing to rejoin",
                stages,
            )
            assert stages[1].said("stage 1: paused (pause flag set): leaving the ring")
            bridge.close()
            with pytest.raises(RendezvousTimeout):  # no ring forms while the owner has the machine
                bridge_connect(api, 1, 2, keys=gateway.keys.bridge, timeout=3, say=lambda _line: None)

            set_paused(homes[1], False)
            _eventually(lambda: stages[1].said("stage 1: resumed: joining the ring"), "the stage resuming", stages)
            _eventually(
                lambda: gateway.addresses.get(1, left_from) != left_from, "the stage reporting its new address", stages
            )

            _eventually(lambda: 0 in gateway.addresses, "stage 0 listening again", stages)
            listening = gateway.addresses[0]
            stages[0].process.terminate()
            assert stages[0].process.wait(30) != 0
            assert (0, listening) in gateway.left and 0 not in gateway.addresses, "SIGTERM cleared its address"
        finally:
            api.close()
        assert not stages[0].said("paused"), "only the paused machine's stage paused"
