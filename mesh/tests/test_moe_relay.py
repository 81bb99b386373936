"""The expert relay, with real processes on loopback: a daphne gateway carrying the relay
routes, a volunteer that registers no address (as if behind NAT) and serves through the
relay, and a coordinator that reaches it only through the gateway. What the relay carries
is the worker's sealed link: a hop in its path that flips a bit (as a tampering gateway
could) drops the link, the worker computes nothing it sent, and the answers stay the same."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
import torch

from conftest import ROOT, free_port, make_host, stack_env, wait_until
from engine.moe import LocalExperts, MoeModel
from engine.moe_loader import ByteTokenizer, load_expert_slice, load_moe, make_tiny_moe
from mahout.moe.control import CoordinatorAgent, MeshClient
from mahout.moe.coordinator import TcpTransport, WorkerFailed, WorkerSpec
from mahout.moe.policy import DispatchPolicy, LoadState
from mahout.moe.relay import RelayTransport, RelayWorkerLink
from mahout.moe.runner import MoeRunner
from mahout.moe.worker import ExpertServer, pack_rows, worker_caps
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
        cwd=ROOT,
        env=stack_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
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


class Tamperer(socketserver.ThreadingTCPServer):
    """A loopback hop in a relayed link's path, seeing the bytes the relay carries: it keeps a
    copy of them and passes them on, except that, once `arm`ed for a direction ("out": to the
    worker, "back": to the coordinator), it flips one bit of the next chunk going that way."""

    daemon_threads = True

    def __init__(self, target: tuple[str, int]) -> None:
        super().__init__(("127.0.0.1", 0), _Hop)
        self.target = target
        self.seen = bytearray()
        self.armed = {"out": False, "back": False}
        self.address = self.server_address[:2]
        threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True).start()

    def arm(self, direction: str) -> None:
        self.armed[direction] = True

    def pipe(self, source: socket.socket, sink: socket.socket, direction: str) -> None:
        try:
            while data := source.recv(1 << 16):
                self.seen += data
                if self.armed[direction]:
                    self.armed[direction] = False
                    data = data[:-1] + bytes([data[-1] ^ 1])
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):  # shut down, so the thread reading the other way ends too
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _Hop(socketserver.BaseRequestHandler):
    server: Tamperer

    def handle(self) -> None:
        far = socket.create_connection(self.server.target)
        back = threading.Thread(target=self.server.pipe, args=(far, self.request, "back"), daemon=True)
        back.start()
        self.server.pipe(self.request, far, "out")
        back.join()
        far.close()


class ExpertRelayTests:
    def test_a_natted_volunteer_serves_through_the_relay_with_no_flags(
        self, catalog: CatalogModel, relay_gateway: str, tmp_path: Path, e2e_dirs: Path
    ) -> None:
        from mesh.experts import services as moe_services

        tiny = make_tiny_moe(tmp_path / "tiny-moe.gguf", seed=9)
        coordinator_host, volunteer_host = make_host(name="coordinator"), trusted_host("behind-nat")
        moe_services.expert_model_register(
            name="tiny-moe", gguf_path=tiny, slice_size=8, boost=1, coordinator=coordinator_host.host
        )
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
            [
                sys.executable,
                "-m",
                "mahout",
                "moe",
                "volunteer",
                "--server",
                relay_gateway,
                "--token",
                volunteer_host.token,
                "--poll",
                "0.3",
                "--heartbeat",
                "0.5",
                "--no-idle-detect",
                "--home",
                str(e2e_dirs / "volunteer-home"),
            ],
            # (no --direct: behind NAT is the default)
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
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

            stranger = RelayTransport(
                relay_gateway, volunteer_host.token, entry["id"], entry["secret"]
            )  # not the coordinator
            with pytest.raises(WorkerFailed):
                stranger.request(
                    {"type": "compute", "id": 1, "layer": 0, "experts": [0], "counts": [1]},
                    torch.zeros(1, config.d_model),
                    2.0,
                )
            stranger.close()

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

    def test_a_bit_flipped_on_the_relay_drops_the_link_and_the_answers_stay_the_same(
        self,
        catalog: CatalogModel,
        relay_gateway: str,
        tmp_path: Path,
    ) -> None:
        from mesh.experts import services as moe_services
        from mesh.experts.models import ExpertWorker

        tiny = make_tiny_moe(tmp_path / "tiny-moe.gguf", seed=9)
        coordinator_host, volunteer_host = make_host(name="coordinator"), make_host(name="behind-nat")
        model = moe_services.expert_model_register(
            name="tiny-moe", gguf_path=tiny, slice_size=8, boost=1, coordinator=coordinator_host.host
        )
        worker = ExpertWorker.objects.create(model=model, host=volunteer_host.host, layer=0, first=0, count=8)
        config, bank = load_expert_slice(tiny, 0, 0, 8)
        server = ExpertServer(
            bank,
            secret=worker.secret,
            caps=worker_caps(d_model=config.d_model, count=8, context_length=config.context_length),
        ).start()
        link = RelayWorkerLink(relay_gateway, volunteer_host.token, worker.pk, server, out=lambda line: None).start()
        relayed = RelayTransport(relay_gateway, coordinator_host.token, worker.pk, worker.secret)
        tamperer = Tamperer(relayed.portal.address)  # between the coordinator and its portal to the relay
        transport = TcpTransport(tamperer.address, worker.secret, connect_timeout=5.0)
        inputs = {1: torch.randn(3, config.d_model), 5: torch.randn(2, config.d_model)}
        experts, counts, rows = pack_rows(inputs)
        answer = pack_rows(bank.compute_many(inputs))[2]

        def ask() -> torch.Tensor:
            header, out = transport.request(
                {"type": "compute", "id": 1, "layer": 0, "experts": experts, "counts": counts}, rows, 10.0
            )
            assert header["type"] == "result" and out is not None
            return out

        runner = MoeRunner(tiny, policy=DispatchPolicy(grace_s=30.0, latency_aware=False), n_slots=2)
        try:
            assert link.connected.wait(10)
            assert torch.equal(ask(), answer)
            seen = bytes(tamperer.seen)  # what the relay carried: the handshake, then ciphertext only
            assert rows.numpy().tobytes() not in seen and answer.numpy().tobytes() not in seen
            for direction in ("out", "back"):
                served = server.served
                tamperer.arm(direction)
                with pytest.raises(WorkerFailed, match="closed|authentication"):
                    ask()
                assert server.served == served + (direction == "back")  # an altered request is never computed
                assert torch.equal(ask(), answer)  # dialled again: a fresh sealed link

            # Through the coordinator: the altered answer is refused and computed here instead.
            full_config, weights = load_moe(tiny)
            prompt = ByteTokenizer().encode("Sealed end to end")
            expected = MoeModel(full_config, weights).generate(prompt, 6)
            runner.monitor.state = LoadState(busy=2, under_load=True, last_load_at=0.0)
            runner.coordinator.attach(WorkerSpec(str(worker.pk), 0, 0, 8, None, secret=worker.secret), transport)
            tamperer.arm("back")
            assert runner.generate(prompt, 6) == expected
            stats = runner.coordinator.stats
            assert stats.fallbacks >= 1 and stats.mismatches == 0
        finally:
            runner.close()
            relayed.close()
            tamperer.close()
            link.stop()
            server.close()

    def test_local_experts_are_the_reference(self, tmp_path: Path) -> None:
        tiny = make_tiny_moe(tmp_path / "tiny.gguf", seed=9)
        config, weights = load_moe(tiny)
        local = LocalExperts({layer.index: layer.experts for layer in weights.layers})
        x = torch.randn(2, config.d_model)
        assert torch.equal(local(0, {1: x})[1], weights.layers[0].experts.compute(1, x))
