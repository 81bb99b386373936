"""The expert relay, with real processes on loopback: a daphne gateway carrying the relay
routes, a volunteer that registers no address (as if behind NAT) and serves through the
relay, and a coordinator that reaches it only through the gateway."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
import torch

from conftest import ROOT, free_port, make_host, stack_env, wait_until
from engine.moe import LocalExperts, MoeModel
from engine.moe_loader import ByteTokenizer, load_moe, make_tiny_moe
from mahout.moe.control import CoordinatorAgent, MeshClient
from mahout.moe.coordinator import WorkerFailed
from mahout.moe.policy import DispatchPolicy, LoadState
from mahout.moe.relay import RelayTransport, decode_frame, encode_frame
from mahout.moe.runner import MoeRunner
from mesh.tests.market import trusted_host

if TYPE_CHECKING:
    from collections.abc import Iterator

    from catalog.models import CatalogModel

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def relay_gateway(transactional_db: None, e2e_dirs: Path) -> Iterator[str]:
    port = free_port()
    log = (e2e_dirs / "logs" / f"relay-gateway-{port}.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "config.asgi:application"],
        cwd=ROOT, env=stack_env(), stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert process.poll() is None, f"gateway exited: see {log.name}"
        try:
            return httpx.get(f"{url}/v1/models", timeout=1).status_code in (200, 401)
        except httpx.HTTPError:
            return False

    wait_until(up, timeout=60, what="the gateway to answer")
    yield url
    process.terminate()
    process.wait(timeout=10)
    log.close()


class FrameTests:
    def test_a_frame_round_trips_and_a_truncated_one_is_refused(self) -> None:
        rows = torch.randn(3, 4)
        header, back = decode_frame(encode_frame({"type": "compute", "id": 7}, rows))
        assert header["id"] == 7 and torch.equal(back, rows)
        with pytest.raises(ValueError):
            decode_frame(encode_frame({"type": "compute"}, rows)[:-1])


class ExpertRelayTests:
    def test_a_natted_volunteer_serves_through_the_relay_with_no_flags(self, catalog: CatalogModel, relay_gateway: str, tmp_path: Path, e2e_dirs: Path) -> None:
        from mesh.experts import services as moe_services

        tiny = make_tiny_moe(tmp_path / "tiny-moe.gguf", seed=9)
        coordinator_host, volunteer_host = make_host(name="coordinator"), trusted_host("behind-nat")
        moe_services.expert_model_register(name="tiny-moe", gguf_path=tiny, slice_size=8, boost=1,
                                           coordinator=coordinator_host.host)
        config, weights = load_moe(tiny)
        prompt = ByteTokenizer().encode("Through the relay")
        expected = MoeModel(config, weights).generate(prompt, 10)

        # Every call engages the worker (seed 004's rule): this test follows batches through the relay and a
        # vanished worker's fallback, which the latency-aware default would skip once it measured the relay slower.
        runner = MoeRunner(tiny, policy=DispatchPolicy(grace_s=30.0, latency_aware=False), n_slots=2)
        runner.monitor.state = LoadState(busy=2, under_load=True, last_load_at=0.0)  # saturated, as reported below
        client = MeshClient(relay_gateway, coordinator_host.token)
        agent = CoordinatorAgent(runner, client, "tiny-moe", interval_s=0.3)
        log = (e2e_dirs / "logs" / "relay-volunteer.log").open("w")
        volunteer = subprocess.Popen(
            [sys.executable, "-m", "mahout", "moe", "volunteer", "--server", relay_gateway, "--token", volunteer_host.token,
             "--poll", "0.3", "--heartbeat", "0.5", "--no-idle-detect", "--home", str(e2e_dirs / "volunteer-home")],
            # (no --direct: behind NAT is the default)
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        )
        try:
            agent.tick()  # busy 2: saturated, one replica per slice wanted

            def attached() -> bool:
                assert volunteer.poll() is None, "the volunteer exited: see relay-volunteer.log"
                agent.tick()
                return len(runner.coordinator.workers) == 1

            wait_until(attached, timeout=60, what="the volunteer to register through the relay", interval=0.3)
            (entry,) = client.coordinator_report("tiny-moe", 2, [])["dispatch_map"]
            assert entry["relay"] and entry["address"] == ""
            assert runner.generate(prompt, 10) == expected
            stats = runner.coordinator.stats
            assert stats.remote_experts > 0 and stats.fallbacks == 0
            assert runner.coordinator.workers[str(entry["id"])].last_serve_ms > 0

            stranger = RelayTransport(relay_gateway, volunteer_host.token, entry["id"])  # not the coordinator
            with pytest.raises(WorkerFailed):
                stranger.request({"type": "compute", "id": 1, "layer": 0, "experts": [0], "counts": [1]},
                                 torch.zeros(1, config.d_model), 2.0)

            volunteer.kill()  # the worker vanishes: its experts are computed locally, answers unchanged
            volunteer.wait()
            assert runner.generate(prompt, 10) == expected
            assert runner.coordinator.stats.fallbacks >= 1
        finally:
            runner.close()
            client.close()
            volunteer.kill()
            volunteer.wait()
            log.close()

    def test_local_experts_are_the_reference(self, tmp_path: Path) -> None:
        tiny = make_tiny_moe(tmp_path / "tiny.gguf", seed=9)
        config, weights = load_moe(tiny)
        local = LocalExperts({layer.index: layer.experts for layer in weights.layers})
        x = torch.randn(2, config.d_model)
        assert torch.equal(local(0, {1: x})[1], weights.layers[0].experts.compute(1, x))
