"""Remote experts on loopback: real expert worker processes, a coordinator that dispatches to
them, answers equal to local-only compute, and a worker dying mid-dispatch. A stranger's
socket is refused and computes nothing; a coordinator without the worker's secret computes
locally; a compute frame over the slice's caps is refused unread."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.moe import LocalExperts, MoeModel
from engine.moe_loader import ByteTokenizer, load_moe, make_tiny_moe, write_expert_slice
from mahout.link import LinkClosed, dial, new_secret
from mahout.moe.coordinator import Coordinator, TcpTransport, WorkerFailed, WorkerSpec
from mahout.moe.policy import DispatchPolicy, LoadMonitor, LoadState
from mahout.moe.runner import MoeRunner, as_streamed
from mahout.moe.worker import SECRET_ENV, worker_caps
from testkit.formats import BYTES, rendered

ROOT = Path(__file__).resolve().parents[2]
SLICES = [(0, 0, 4), (0, 4, 4), (1, 0, 8)]  # (layer, first, count): every expert of the tiny model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_moe(tmp_path_factory.mktemp("moe") / "tiny-moe.gguf", seed=3)


# A worker runs the same float32 matmuls with its own thread count, so sums are ordered
# differently: values of ~30 were seen to differ by ~1e-4 (5.9126 vs 5.9127) on a busy CI.
FLOAT32_RTOL = 1e-4


SECRET = new_secret()  # what the gateway would hand the worker's volunteer and its coordinator


def start_worker(model: Path, layer: int, first: int, count: int) -> tuple[subprocess.Popen, tuple[str, int]]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mahout.moe.worker",
            "--model",
            str(model),
            "--layer",
            str(layer),
            "--first",
            str(first),
            "--count",
            str(count),
            "--no-idle-detect",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, SECRET_ENV: SECRET},
    )
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    assert line.startswith("expert worker listening on "), line
    host, port = line.rsplit(" ", 1)[1].split(":")
    return process, (host, int(port))


@pytest.fixture(scope="module")
def workers(tiny: Path) -> Iterator[list[tuple[subprocess.Popen, WorkerSpec]]]:
    started = []
    for index, (layer, first, count) in enumerate(SLICES):
        process, address = start_worker(tiny, layer, first, count)
        started.append((process, WorkerSpec(f"w{index}", layer, first, count, address, secret=SECRET)))
    yield started
    for process, _ in started:
        process.kill()
        process.wait()


def _loaded_coordinator(local: LocalExperts) -> Coordinator:
    """Under load, engaging every attached worker (seed 004's rule): these tests are about the
    remote path itself, which the latency-aware default skips wherever it is slower."""
    monitor = LoadMonitor(lambda: 0, DispatchPolicy(latency_aware=False))
    monitor.state = LoadState(busy=2, under_load=True, last_load_at=0.0)
    return Coordinator(local, monitor=monitor)


def _logits(model: MoeModel, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor(ids), torch.arange(len(ids)), torch.zeros(len(ids), dtype=torch.long))  # (T, V)


class RemoteExpertTests:
    def test_remote_experts_give_the_local_answer(
        self, tiny: Path, workers: list[tuple[subprocess.Popen, WorkerSpec]]
    ) -> None:
        config, weights = load_moe(tiny)
        local = LocalExperts({layer.index: layer.experts for layer in weights.layers})
        prompt = ByteTokenizer().encode("The elephant")
        reference = _logits(MoeModel(config, weights), prompt)
        expected_tokens = MoeModel(config, weights).generate(prompt, 8)
        coordinator = _loaded_coordinator(local)
        try:
            for _, spec in workers:
                coordinator.attach(spec)
            remote = MoeModel(config, weights, experts=coordinator)
            assert torch.allclose(_logits(remote, prompt), reference, rtol=FLOAT32_RTOL, atol=1e-5)
            assert coordinator.stats.local_experts == 0 and coordinator.stats.remote_experts > 0
            assert all(state.last_serve_ms > 0 for state in coordinator.workers.values())
            assert MoeModel(config, weights, experts=coordinator).generate(prompt, 8) == expected_tokens
        finally:
            coordinator.close()

    def test_a_worker_serving_a_downloaded_slice_file_gives_the_same_experts(self, tiny: Path, tmp_path: Path) -> None:
        config, weights = load_moe(tiny)
        slice_path = tmp_path / "slice.gguf"
        write_expert_slice(tiny, 1, 2, 4, slice_path)
        process, address = start_worker(slice_path, 1, 2, 4)
        coordinator = _loaded_coordinator(LocalExperts({layer.index: layer.experts for layer in weights.layers}))
        try:
            coordinator.attach(WorkerSpec("slice", 1, 2, 4, address, secret=SECRET))
            x = torch.randn(5, config.d_model, generator=torch.Generator().manual_seed(0))
            inputs = {e: x for e in range(2, 6)}
            remote = coordinator(1, inputs)
            assert coordinator.stats.remote_experts == 4
            for e in range(2, 6):  # float32 sums in another process's thread layout differ in the last bits
                assert torch.allclose(remote[e], weights.layers[1].experts.compute(e, x), rtol=FLOAT32_RTOL, atol=1e-5)
        finally:
            coordinator.close()
            process.kill()
            process.wait()

    def test_a_worker_dying_mid_dispatch_falls_back_to_local_compute(self, tiny: Path) -> None:
        config, weights = load_moe(tiny)
        local = LocalExperts({layer.index: layer.experts for layer in weights.layers})
        prompt = ByteTokenizer().encode("Mid-answer")
        expected = MoeModel(config, weights).generate(prompt, 10)
        processes = [start_worker(tiny, layer, first, count) for layer, first, count in SLICES]
        coordinator = _loaded_coordinator(local)
        calls = [0]
        original = coordinator.__call__

        def kill_after_some(layer: int, inputs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
            calls[0] += 1
            if calls[0] == 5:  # mid-answer: every worker dies
                for process, _ in processes:
                    process.kill()
                    process.wait()
            return original(layer, inputs)

        try:
            for index, ((_, address), (layer, first, count)) in enumerate(zip(processes, SLICES, strict=True)):
                coordinator.attach(WorkerSpec(f"w{index}", layer, first, count, address, secret=SECRET))
            model = MoeModel(config, weights, experts=kill_after_some)
            assert model.generate(prompt, 10) == expected
            assert coordinator.stats.fallbacks >= 1 and coordinator.stats.remote_experts > 0
            assert not any(state.alive for state in coordinator.workers.values())
        finally:
            coordinator.close()
            for process, _ in processes:
                process.kill()


def _frame(header: dict, payload: bytes = b"") -> bytes:
    head = json.dumps(header).encode()
    return struct.pack(">II", len(head), len(payload)) + head + payload


class WorkerAdmissionTests:
    def test_a_stranger_is_refused_and_computes_nothing(
        self, tiny: Path, workers: list[tuple[subprocess.Popen, WorkerSpec]]
    ) -> None:
        _, spec = workers[0]
        assert spec.address is not None
        stranger = socket.create_connection(spec.address, timeout=5)
        try:
            stranger.sendall(_frame({"type": "hello", "role": "coordinator"}))  # the old hello, no proof
            rows = torch.zeros(1, 64).numpy().tobytes()
            stranger.sendall(
                _frame(
                    {
                        "type": "compute",
                        "id": 1,
                        "layer": 0,
                        "experts": [0],
                        "counts": [1],
                        "dtype": "float32",
                        "shape": [1, 64],
                    },
                    rows,
                )
            )
            heard = b""
            while chunk := stranger.recv(1 << 16):
                heard += chunk
        finally:
            stranger.close()
        n_head, n_payload = struct.unpack(">II", heard[:8])
        assert json.loads(heard[8 : 8 + n_head])["type"] == "challenge" and len(heard) == 8 + n_head + n_payload, (
            "the stranger got the challenge and nothing more: no result"
        )

    def test_a_coordinator_without_the_workers_secret_computes_locally(
        self, tiny: Path, workers: list[tuple[subprocess.Popen, WorkerSpec]]
    ) -> None:
        config, weights = load_moe(tiny)
        coordinator = _loaded_coordinator(LocalExperts({layer.index: layer.experts for layer in weights.layers}))
        _, spec = workers[0]
        try:
            coordinator.attach(
                WorkerSpec("wrong", spec.layer, spec.first, spec.count, spec.address, secret=new_secret())
            )
            x = torch.randn(3, config.d_model, generator=torch.Generator().manual_seed(1))
            out = coordinator(spec.layer, {spec.first: x})
            assert torch.equal(out[spec.first], weights.layers[spec.layer].experts.compute(spec.first, x))
            assert (coordinator.stats.remote_experts, coordinator.stats.fallbacks) == (0, 1)
            with pytest.raises(WorkerFailed, match="refused our proof"):
                TcpTransport(spec.address, new_secret()).request({"type": "compute"}, x, 2.0)
            with pytest.raises(WorkerFailed, match="no secret"):
                TcpTransport(spec.address, "").request({"type": "compute"}, x, 2.0)
        finally:
            coordinator.close()

    def test_a_compute_frame_over_the_slices_caps_is_refused_unread(
        self, tiny: Path, workers: list[tuple[subprocess.Popen, WorkerSpec]]
    ) -> None:
        config, _ = load_moe(tiny)
        _, spec = workers[0]
        caps = worker_caps(d_model=config.d_model, count=spec.count, context_length=config.context_length)
        assert caps.payload_bytes == config.context_length * spec.count * config.d_model * 4
        link = dial(spec.address, secret=SECRET, hello={"role": "coordinator"}, caps=caps, timeout=5)
        try:
            link.sock.sendall(struct.pack(">II", 64, caps.payload_bytes + 4))  # announced, never sent
            with pytest.raises(LinkClosed):
                link.recv()  # the worker dropped the link at the prefix
        finally:
            link.close()


class MoeRunnerTests:
    def test_concurrent_requests_saturate_the_slots_and_a_new_worker_is_tried(
        self, tiny: Path, workers: list[tuple[subprocess.Popen, WorkerSpec]]
    ) -> None:
        runner = MoeRunner(tiny, policy=DispatchPolicy(probe_timeout_s=0.5), n_slots=4)
        quiet = MoeRunner(tiny, n_slots=1)
        try:
            prompt = ByteTokenizer().encode("load")
            expected = quiet.generate(prompt, 6)
            assert quiet.coordinator.stats.remote_experts == 0
            first = runner.generate_stream(prompt, 6)
            second = runner.generate_stream(prompt, 6)
            tokens = [next(first), next(second)]  # two requests in their slots
            assert runner.monitor.tick().under_load
            for _, spec in workers:
                runner.coordinator.attach(spec)
            tokens += list(first) + list(second)
            assert tokens[:1] + tokens[2:7] == expected and tokens[1:2] + tokens[7:] == expected
            assert runner.coordinator.stats.remote_experts > 0
            assert runner.monitor.tick().busy == 0
        finally:
            runner.close()
            quiet.close()

    def test_stream_speaks_the_runner_interface(self, tiny: Path) -> None:
        runner = MoeRunner(tiny, n_slots=2)
        try:
            prompt = ByteTokenizer().encode("Hi")
            expected = as_streamed(
                runner.tokenizer.spell(runner.generate(prompt, 5))
            )  # as llama.cpp's stream writes it
            first, second = runner.slot(), runner.slot()
            pieces = list(
                first.stream(
                    rendered(
                        {"kind": "completion", "prompt": "Hi", "params": {"max_tokens": 5, "temperature": 0}}, BYTES
                    )
                )
            )
            assert first.completion_tokens == 5 and first.finish_reason == "length"
            assert "".join(pieces) == expected
            assert second.completion_tokens == 0  # each slot keeps its own job's figures
        finally:
            runner.close()

    def test_a_slot_draws_at_the_jobs_temperature_with_its_seed_as_the_specified_sampler_does(self, tiny: Path) -> None:
        """Each token is `select(logits, u=uniform(seed, position))` over the model's own logits,
        replayed here one token at a time on a model of its own; the same seed draws the same
        answer, a top_p that keeps one token draws the greedy one, and the slot reports the
        tokens and the seed (the audit's input), as a single-machine host does."""
        from protocol.sampling import select, uniform

        config, weights = load_moe(tiny)
        replay = MoeModel(config, weights)
        runner = MoeRunner(tiny, n_slots=1)
        slot = runner.slot()

        def answer(**params: object) -> tuple[str, list[int]]:
            job = rendered({"kind": "completion", "prompt": "Elephants", "params": {"max_tokens": 12, **params}}, BYTES)
            return "".join(slot.stream(job)), list(slot.token_ids)

        try:
            prompt = ByteTokenizer().encode("Elephants")
            greedy = runner.generate(prompt, 12)
            text, drawn = answer(temperature=1.3, top_p=1.0, seed=7)
            assert slot.seed == 7 and len(drawn) == slot.completion_tokens
            assert answer(temperature=1.3, top_p=1.0, seed=7) == (text, drawn)
            assert drawn != greedy, "at 1.3 the tiny model's flat distribution draws away from the greedy answer"
            logits = replay.forward(
                torch.tensor(prompt),
                torch.arange(len(prompt)),
                torch.zeros(len(prompt), dtype=torch.long),
                torch.tensor([len(prompt) - 1]),
            )[0]
            for step, token in enumerate(drawn):
                position = len(prompt) + step
                assert token == select(logits.float().numpy(), temperature=1.3, top_p=1.0, u=uniform(7, position)), step
                logits = replay.forward(torch.tensor([token]), torch.tensor([position]), torch.tensor([0]))[0]
            assert answer(temperature=1.3, top_p=1e-9, seed=8)[1] == greedy
            assert answer(temperature=0, seed=9)[1] == greedy
            assert answer(temperature=1.3, seed=8)[1] != drawn
        finally:
            runner.close()
