"""`mahout moe coordinator --device auto|cpu|cuda[:N]` (`mahout.moe.device`), as stages and
workers have it: the option is parsed and checked like theirs (a clear refusal of CUDA where
torch sees none), reaches the coordinator, and puts every tensor of the model (its experts
and KV cache too) on the device, which then answers as the model does on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.moe_loader import make_tiny_moe
from mahout.__main__ import build_parser, main
from mahout.moe.device import DeviceMoeModel
from mahout.moe.serve import coordinator_runner
from mahout.tests.fake_gateway import TOKEN

pytestmark = pytest.mark.usefixtures("one_thread")

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this torch sees a CUDA GPU")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here (run where one is lent)")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_moe(tmp_path_factory.mktemp("moe") / "tiny-moe.gguf", seed=2)


def coordinator_args(*device: str) -> list[str]:
    return [
        "moe",
        "coordinator",
        "--server",
        "http://127.0.0.1:9",
        "--token",
        TOKEN,
        "--model",
        "m.gguf",
        "--name",
        "m",
        *device,
    ]


class DeviceOptionTests:
    def test_it_takes_cpu_and_picks_the_cpu_for_auto_without_a_gpu(self) -> None:
        assert build_parser().parse_args(coordinator_args("--device", "cpu")).device == torch.device("cpu")
        expected = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        assert build_parser().parse_args(coordinator_args()).device == expected

    @NO_CUDA
    def test_cuda_without_a_gpu_is_refused_saying_why(self, capsys: pytest.CaptureFixture[str]) -> None:
        for asked in ("cuda", "cuda:1"):
            with pytest.raises(SystemExit) as exited:
                build_parser().parse_args(coordinator_args("--device", asked))
            assert exited.value.code == 2
            assert "CUDA was asked for, but this torch sees no CUDA GPU" in capsys.readouterr().err

    def test_a_device_the_engine_does_not_run_on_is_refused(self, capsys: pytest.CaptureFixture[str]) -> None:
        with pytest.raises(SystemExit):
            build_parser().parse_args(coordinator_args("--device", "tpu"))
        assert "'tpu' is not a device: auto, cpu or cuda[:N]" in capsys.readouterr().err

    def test_the_chosen_device_reaches_the_coordinator(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        seen: dict = {}
        monkeypatch.setattr("mahout.moe.serve.serve_coordinator", lambda **kwargs: seen.update(kwargs) or 0)
        assert main([*coordinator_args("--device", "cpu"), "--home", str(tmp_path)]) == 0
        assert seen["device"] == torch.device("cpu") and seen["name"] == "m"


class DeviceModelTests:
    def test_every_tensor_of_the_model_lands_on_the_device(self, tiny: Path) -> None:
        """On torch's `meta` device (shapes without storage; no GPU here): nothing the
        coordinator computes with is left behind on the CPU."""
        runner = coordinator_runner(tiny, slots=2)
        try:
            banks = runner.coordinator.local.banks  # the experts the coordinator computes itself
            moved = DeviceMoeModel(runner.model, torch.device("meta"))
            weights = moved.model.weights
            tensors = [weights.embedding, weights.output_norm, weights.output, moved.cache.k, moved.cache.v]
            for layer in weights.layers:
                tensors += [v for v in vars(layer).values() if isinstance(v, torch.Tensor)]
            for bank in banks.values():
                tensors += [bank.gate, bank.up, bank.down]
            assert len(banks) == len(weights.layers)
            assert {t.device.type for t in tensors} == {"meta"}
            assert (moved.cache.n_rows, moved.cache.k.shape[1]) == (2, 2)
        finally:
            runner.close()

    def test_a_model_moved_answers_as_the_cpu_model_does(self, tiny: Path) -> None:
        """The move and the calls through it (inputs to the device, logits back), run to the CPU."""
        plain, moved = coordinator_runner(tiny, slots=1), coordinator_runner(tiny, slots=1)
        try:
            moved.model = DeviceMoeModel(moved.model, torch.device("cpu"))  # type: ignore[assignment]
            prompt = plain.tokenizer.encode("The elephant")
            assert moved.generate(prompt, 8) == plain.generate(prompt, 8)
        finally:
            plain.close()
            moved.close()

    @CUDA
    def test_on_a_gpu_the_coordinator_computes_there_and_answers_on_the_cpu(self, tiny: Path) -> None:
        plain, moved = coordinator_runner(tiny, slots=1), coordinator_runner(tiny, slots=1, device=torch.device("cuda"))
        try:
            assert isinstance(moved.model, DeviceMoeModel) and moved.model.cache.k.device.type == "cuda"
            assert {bank.gate.device.type for bank in moved.coordinator.local.banks.values()} == {"cuda"}
            prompt = plain.tokenizer.encode("The elephant")
            logits = moved.model(
                torch.tensor(prompt),
                torch.arange(len(prompt)),
                torch.zeros(len(prompt), dtype=torch.long),
                torch.tensor([len(prompt) - 1]),
            )
            want = plain.model(
                torch.tensor(prompt),
                torch.arange(len(prompt)),
                torch.zeros(len(prompt), dtype=torch.long),
                torch.tensor([len(prompt) - 1]),
            )
            assert logits.device.type == "cpu" and torch.allclose(logits, want, rtol=1e-3, atol=1e-3)
        finally:
            plain.close()
            moved.close()
