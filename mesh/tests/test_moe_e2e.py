"""The scripted load ramp, with real processes on loopback: a daphne gateway, volunteer
mahout processes, and an MoE coordinator reporting to the gateway.

idle coordinator serves locally -> concurrent requests saturate it -> demand appears ->
volunteers are recruited, download their slices, register and get dispatched -> outputs
equal the local-only outputs -> load stops -> workers age out, the target returns to base.
And the same ramp with volunteers too far away to be worth engaging (a delay on each batch's
round trip): the coordinator only probes them, so it holds its boost back and releases them
while it is still saturated.
The coordinator is bound by the operator, two volunteers are trusted hosts and two are
strangers on probation (a default deployment's pure volunteers: their batches are checked at
the probation share), and every coordinator-to-worker link passes the handshake with that
worker's own secret.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from conftest import ROOT, Gateway, make_host, stack_env, wait_until
from engine.moe import MoeModel
from engine.moe_loader import ByteTokenizer, load_moe, make_tiny_moe
from mahout.moe.control import CoordinatorAgent, MeshClient
from mahout.moe.coordinator import Transport
from mahout.moe.policy import DispatchPolicy
from mahout.moe.runner import MoeRunner
from mesh.experts.models import ExpertWorker
from mesh.tests.market import LOCAL_SWARM_ENV, trusted_host

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch

    from catalog.models import CatalogModel
    from testkit.personas import ServingHost

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

PROMPTS = ["The elephant", "A swarm of experts", "Load rises"]
N_TOKENS = 24
TOKENIZER = ByteTokenizer()


MARKET_ENV = {
    "MOE_COOLDOWN_SECONDS": "2",
    "MOE_COORDINATOR_STALE_SECONDS": "5",
    "MOE_WORKER_STALE_SECONDS": "5",
    **LOCAL_SWARM_ENV,
}


@pytest.fixture
def moe_gateway(transactional_db: None, e2e_dirs: Path) -> Iterator[Gateway]:
    # The ramp keeps its volunteers while saturated, though the coordinator mostly probes them
    # (the next test releases such volunteers: here they must stay to be watched).
    gateway = Gateway(stack_env({**MARKET_ENV, "MOE_UNUSED_GRACE_SECONDS": "3600"}), e2e_dirs / "logs")
    yield gateway
    gateway.stop()


@pytest.fixture
def impatient_gateway(transactional_db: None, e2e_dirs: Path) -> Iterator[Gateway]:
    gateway = Gateway(stack_env({**MARKET_ENV, "MOE_UNUSED_GRACE_SECONDS": "2"}), e2e_dirs / "logs")
    yield gateway
    gateway.stop()


class FarAway:
    """A worker's transport with a home link's round trip added to each batch."""

    def __init__(self, transport: Transport, delay_s: float) -> None:
        self.transport, self.delay_s = transport, delay_s

    def request(self, header: dict, rows: torch.Tensor, timeout: float) -> tuple[dict, torch.Tensor | None]:
        time.sleep(self.delay_s)
        return self.transport.request(header, rows, timeout)

    def close(self) -> None:
        self.transport.close()


def _volunteer(url: str, token: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mahout",
            "moe",
            "volunteer",
            "--server",
            url,
            "--token",
            token,
            "--poll",
            "0.3",
            "--heartbeat",
            "0.5",
            "--no-idle-detect",
            "--home",
            str(log.parent / "volunteer-home"),
        ],  # not this machine's owner
        cwd=ROOT,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )


def _market(tmp_path: Path, seed: int) -> tuple[Path, ServingHost, dict[str, list[int]]]:
    """A tiny MoE model for sale (base 0, boost 1), its bound coordinator's host, and each
    prompt's local-only answer."""
    from mesh.experts import services as moe_services

    tiny = make_tiny_moe(tmp_path / "tiny-moe.gguf", seed=seed)
    coordinator_host = make_host(name="coordinator")
    moe_services.expert_model_register(
        name="tiny-moe", gguf_path=tiny, slice_size=4, base_target=0, boost=1, coordinator=coordinator_host.host
    )
    config, weights = load_moe(tiny)
    expected = {p: MoeModel(config, weights).generate(TOKENIZER.encode(p), N_TOKENS) for p in PROMPTS}
    return tiny, coordinator_host, expected


class Load:
    """One client per prompt asking the coordinator without pause, from `start` to `stop`."""

    def __init__(self, runner: MoeRunner) -> None:
        self.results: list[tuple[str, list[int]]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._ask, args=(runner, p), daemon=True) for p in PROMPTS]

    def _ask(self, runner: MoeRunner, prompt: str) -> None:
        while not self._stop.is_set():
            self.results.append((prompt, runner.generate(TOKENIZER.encode(prompt), N_TOKENS)))

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)

    def wrong(self, expected: dict[str, list[int]]) -> list[tuple[str, list[int]]]:
        return [(prompt, tokens) for prompt, tokens in self.results if tokens != expected[prompt]]


def _until_remote(runner: MoeRunner, volunteers: list[subprocess.Popen], what: str) -> None:
    def sent() -> bool:
        assert all(v.poll() is None for v in volunteers), "a volunteer exited: see its log"
        return runner.coordinator.stats.remote_experts > 0

    wait_until(sent, timeout=90, what=what)


class LoadRampTests:
    def test_volunteers_join_under_load_answer_as_local_and_age_out(
        self, catalog: CatalogModel, moe_gateway: Gateway, tmp_path: Path, e2e_dirs: Path
    ) -> None:
        tiny, coordinator_host, expected = _market(tmp_path, seed=5)

        # Loopback workers for a tiny model are slower than its local experts, so the latency-aware
        # rule mostly probes them on the side: every 0.2 s here, so they keep serving (and being checked).
        policy = DispatchPolicy(
            probe_interval_s=0.2, probe_timeout_s=0.2, grace_s=5.0, idle_timeout_s=1.0, latency_probe_s=0.2
        )
        runner = MoeRunner(tiny, policy=policy, n_slots=4).start()
        client = MeshClient(moe_gateway.url, coordinator_host.token)
        agent = CoordinatorAgent(runner, client, "tiny-moe", interval_s=0.3).start()
        hosts = [
            trusted_host("v0"),
            make_host(name="stranger1", qualified=False),
            trusted_host("v2"),
            make_host(name="stranger3", qualified=False),
        ]
        volunteers = [
            _volunteer(moe_gateway.url, host.token, e2e_dirs / "logs" / f"volunteer-{i}.log")
            for i, host in enumerate(hosts)
        ]
        try:
            # idle: one request at a time is served locally, nothing is scarce
            assert runner.generate(TOKENIZER.encode(PROMPTS[0]), N_TOKENS) == expected[PROMPTS[0]]
            assert runner.coordinator.stats.remote_experts == 0
            wait_until(lambda: agent.reports >= 2, timeout=10, what="coordinator reports")
            assert client.demand() == {"recruiting": False, "slices": []}

            # load: concurrent requests until remote experts have been dispatched
            saturated_at = time.monotonic()
            load = Load(runner).start()
            wait_until(lambda: client.recruitment()[0]["saturated"], timeout=20, what="the gateway to see saturation")
            _until_remote(runner, volunteers, "a first remote dispatch")
            first_remote_s = runner.coordinator.stats.first_remote_at - saturated_at
            wait_until(
                lambda: len([w for w in client.recruitment()[0]["workers"] if w["last_serve_ms"] > 0]) >= 2,
                timeout=60,
                what="proven workers in the recruitment view",
            )
            stats = runner.coordinator.stats
            served_remote = stats.remote_experts + stats.probes
            wait_until(
                lambda: {w["probation"] for w in client.recruitment()[0]["workers"]} == {True, False},
                timeout=30,
                what="workers on probation and trusted ones in the recruitment view",
            )
            wait_until(lambda: runner.coordinator.stats.checks > 0, timeout=30, what="a remote batch checked here")
            assert runner.coordinator.stats.mismatches == 0
            time.sleep(1.0)
            load.stop()
            assert stats.remote_experts + stats.probes > served_remote  # kept sending under load (engaged or probed)
            wrong = load.wrong(expected)
            assert load.results and not wrong, (runner.coordinator.stats, len(load.results), wrong[:2], expected)
            (view,) = client.recruitment()
            assert view["effective_target"] == view["base_target"] + view["boost"] or not view["saturated"]

            # quiet: the target returns to base, workers retire and leave the dispatch map
            def aged_out() -> bool:
                (model,) = client.recruitment()
                return (
                    not model["saturated"]
                    and model["effective_target"] == model["base_target"]
                    and not model["workers"]
                )

            wait_until(aged_out, timeout=30, what="workers to age out")
            wait_until(lambda: not runner.coordinator.workers, timeout=10, what="the dispatch map to empty")
            before = runner.coordinator.stats.remote_experts
            assert runner.generate(TOKENIZER.encode(PROMPTS[1]), N_TOKENS) == expected[PROMPTS[1]]
            assert runner.coordinator.stats.remote_experts == before
            assert client.demand()["recruiting"] is False
            print(f"first remote dispatch {first_remote_s:.2f} s after saturation began")
        finally:
            agent.stop()
            runner.close()
            client.close()
            for process in volunteers:
                process.kill()
                process.wait()

    def test_volunteers_it_only_probes_are_released_while_it_stays_saturated(
        self,
        catalog: CatalogModel,
        impatient_gateway: Gateway,
        tmp_path: Path,
        e2e_dirs: Path,
    ) -> None:
        tiny, coordinator_host, expected = _market(tmp_path, seed=6)
        policy = DispatchPolicy(probe_interval_s=0.2, probe_timeout_s=0.2, grace_s=5.0, latency_probe_s=0.2)
        runner = MoeRunner(tiny, policy=policy, n_slots=4).start()
        client = MeshClient(impatient_gateway.url, coordinator_host.token)
        agent = CoordinatorAgent(runner, client, "tiny-moe", interval_s=0.3)
        direct = agent.transport_for
        runner.coordinator.transport_for = lambda spec: FarAway(direct(spec), 0.2)  # 200 ms away: never worth it
        agent.start()
        hosts = [trusted_host("far0"), trusted_host("far1")]
        volunteers = [
            _volunteer(impatient_gateway.url, host.token, e2e_dirs / "logs" / f"far-volunteer-{i}.log")
            for i, host in enumerate(hosts)
        ]
        load = Load(runner)
        try:
            load.start()
            wait_until(lambda: client.recruitment()[0]["saturated"], timeout=20, what="the gateway to see saturation")
            _until_remote(runner, volunteers, "a volunteer's first try")

            def released() -> bool:
                (model,) = client.recruitment()
                return model["saturated"] and model["boost_held"] and not model["workers"]

            wait_until(released, timeout=60, what="the boost held back and the volunteers released, still saturated")
            stats = runner.coordinator.stats
            assert stats.engaged_experts == 0 and stats.probes > 0 and stats.mismatches == 0
            assert client.demand() == {"recruiting": False, "slices": []}  # nobody else is recruited meanwhile
            tried_workers = ExpertWorker.objects.filter(model__name="tiny-moe", last_serve_ms__gt=0)
            assert tried_workers.exists() and {w.retired_reason for w in tried_workers} == {
                "its coordinator computes faster than it answers (it sent only probes)"
            }
            wait_until(lambda: not runner.coordinator.workers, timeout=10, what="the dispatch map to empty")
            load.stop()
            wrong = load.wrong(expected)
            assert load.results and not wrong, (runner.coordinator.stats, len(load.results), wrong[:2])
        finally:
            load.stop()
            agent.stop()
            runner.close()
            client.close()
            for volunteer in volunteers:
                volunteer.kill()
                volunteer.wait()
