"""The GPU paths with llama.cpp's offload query and the vendors' tools stubbed at the boundary
(no GPU reaches CI; `bench/gpu_check.sh` is the real check): what is found, what is said at
start, how many layers go on the GPU, and that the benchmark, its cache and the loader follow."""

from __future__ import annotations

from pathlib import Path

import pytest

from mahout import gpu as gpu_module
from mahout import host as host_module
from mahout.gpu import AUTO, Gpu, Offload, gpus_present, llama_backends, parse_gpu_layers, plan_offload, startup_report
from mahout.loader import BudgetError, ModelLoader, check_fits

NVIDIA_SMI = "NVIDIA GeForce RTX 4090, 24564, 23012\nNVIDIA GeForce RTX 3060, 12288, 12000\n"
CUDA_BUILD = "CUDA : ARCHS = 890 | USE_GRAPHS = 1 | PEER_MAX_BATCH_SIZE = 128 | CPU : SSE3 = 1 | AVX2 = 1 | "


def tools(answers: dict[str, str]):  # noqa: ANN201
    def run(argv: list[str]) -> str | None:
        return answers.get(argv[0])

    def which(name: str) -> str | None:
        return f"/usr/bin/{name}" if name in answers else None

    return run, which


class FindingTests:
    def test_nvidia_cards_are_read_from_nvidia_smi(self) -> None:
        run, which = tools({"nvidia-smi": NVIDIA_SMI})
        found = gpus_present(run=run, which=which, system="linux")
        assert found == [
            Gpu("nvidia", "NVIDIA GeForce RTX 4090", 24564.0, 23012.0),
            Gpu("nvidia", "NVIDIA GeForce RTX 3060", 12288.0, 12000.0),
        ]

    def test_amd_cards_are_read_from_rocm_smi(self) -> None:
        csv = (
            "device,Card series,VRAM Total Memory (B),VRAM Total Used Memory (B)\n"
            "card0,Radeon RX 7900 XTX,25753026560,1073741824\n"
        )
        run, which = tools({"rocm-smi": csv})
        (card,) = gpus_present(run=run, which=which, system="linux")
        assert (card.vendor, card.name, round(card.total_mb), round(card.free_mb)) == (
            "amd",
            "Radeon RX 7900 XTX",
            24560,
            23536,
        )

    def test_apple_silicon_shares_its_memory_and_a_plain_pc_has_none(self) -> None:
        run, which = tools({})
        (mac,) = gpus_present(run=run, which=which, system="darwin", machine="arm64", memory_mb=lambda: 16384.0)
        assert (mac.vendor, mac.free_mb) == ("apple", 12288.0)
        assert gpus_present(run=run, which=which, system="linux") == []
        assert gpus_present(run=run, which=which, system="darwin", machine="x86_64") == []

    def test_the_backends_are_llama_cpps_own_list(self) -> None:
        assert llama_backends(CUDA_BUILD) == ["CUDA", "CPU"]
        assert llama_backends() == ["CPU"], "this project's build is CPU-only"


class StartupReportTests:
    def test_a_gpu_behind_a_cpu_only_build_is_named_with_the_rebuild_command(self) -> None:
        (line,) = startup_report([Gpu("nvidia", "RTX 4090", 24564, 23012)], False, ["CPU"])
        assert "RTX 4090" in line and "built for the CPU only" in line
        assert 'CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir llama-cpp-python==' in line
        (mac,) = startup_report([Gpu("apple", "Apple silicon (Metal)", 16384, 12288)], False, ["CPU"])
        assert '-DGGML_METAL=on' in mac

    def test_a_usable_gpu_and_no_gpu_say_so(self) -> None:
        assert (
            "backends: CUDA, CPU" in startup_report([Gpu("nvidia", "RTX 4090", 24564, 23012)], True, ["CUDA", "CPU"])[0]
        )
        assert startup_report([], False, ["CPU"]) == ["mahout: no GPU found: serving on the CPU"]


class PlanTests:
    GPU = Gpu("nvidia", "RTX 3060", 12288, 12000)

    def test_auto_puts_every_layer_that_fits_the_free_memory(self) -> None:
        everything = plan_offload(AUTO, gpu=self.GPU, supported=True, model_mb=253, n_layers=18)
        assert (everything.layers, everything.device) == (19, "RTX 3060") and everything.vram_mb == pytest.approx(
            253, abs=1
        )
        big = plan_offload(AUTO, gpu=self.GPU, supported=True, model_mb=40_000, n_layers=79)  # a 70B Q4: 500 MB a layer
        assert big.layers == int((12000 - gpu_module.RESERVE_MB) // (40_000 / 80)) and big.vram_mb < 12000

    def test_a_number_is_taken_as_asked_and_nothing_without_a_usable_gpu(self) -> None:
        assert plan_offload(6, gpu=self.GPU, supported=True, model_mb=253, n_layers=18).layers == 6
        assert plan_offload(99, gpu=self.GPU, supported=True, model_mb=253, n_layers=18).layers == 19
        for kwargs in ({"gpu": None, "supported": True}, {"gpu": self.GPU, "supported": False}):
            assert plan_offload(AUTO, model_mb=253, n_layers=18, **kwargs) == Offload(0, 18, 0.0, "cpu")
        assert plan_offload(0, gpu=self.GPU, supported=True, model_mb=253, n_layers=18).layers == 0

    def test_the_flag_takes_auto_or_a_count(self) -> None:
        assert parse_gpu_layers("auto") == AUTO and parse_gpu_layers("12") == 12
        with pytest.raises(ValueError):
            parse_gpu_layers("-1")
        from mahout.__main__ import build_parser

        assert build_parser().parse_args(["run", "--gpu-layers", "0"]).gpu_layers == 0
        with pytest.raises(SystemExit):
            build_parser().parse_args(["run", "--gpu-layers", "lots"])


class HostWiringTests:
    def test_the_benchmark_runs_with_the_plan_and_its_cache_is_kept_per_offload(
        self,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        from mahout.catalog import CATALOG
        from protocol.catalog import MODEL_FILES

        model = tmp_path / "gemma.gguf"
        model.write_bytes(b"GGUF" + b"\0" * 4096)
        spec = CATALOG["gemma-3-270m"]
        monkeypatch.setitem(MODEL_FILES, "gemma-3-270m", {"sha256": "ab" * 32, "quantization": "Q4_K_M"})
        calls: list[Offload | None] = []

        def measure(path: Path, threads: int, *, progress: bool = True, offload: Offload | None = None) -> dict:
            calls.append(offload)
            layers = offload.layers if offload else 0
            return {
                "prompt_tps": 900.0,
                "gen_tps": 150.0,
                "ttft_ms": 5.0,
                "memory_mb": 120.0,
                "threads": threads,
                "load_ms": 50.0,
                "device": offload.device if offload else "cpu",
                "gpu_layers": layers,
                "vram_mb": offload.vram_mb if offload else 0.0,
            }

        monkeypatch.setitem(
            CATALOG,
            "gemma-3-270m",
            type(spec)(
                spec.name, spec.kind, spec.modules, lambda home: (model, "ab" * 32), measure, spec.open, offloads=True
            ),
        )
        monkeypatch.setattr(gpu_module, "model_layers", lambda path: 18)
        setup = host_module.GpuSetup(AUTO, Gpu("nvidia", "RTX 3060", 12288, 12000), True)
        first = host_module.benchmark_model("gemma-3-270m", tmp_path, 2, out=lambda line: None, gpu=setup)
        assert calls[-1] is not None and calls[-1].layers == 19 and first.offload == calls[-1]
        assert (first.benchmark["gpu_layers"], first.benchmark["device"]) == (19, "RTX 3060")
        host_module.benchmark_model("gemma-3-270m", tmp_path, 2, out=lambda line: None, gpu=setup)
        assert len(calls) == 1, "the same offload: the cached benchmark"
        cpu = host_module.benchmark_model(
            "gemma-3-270m", tmp_path, 2, out=lambda line: None, gpu=host_module.GpuSetup(0, setup.gpu, True)
        )
        assert len(calls) == 2 and calls[-1] is None and cpu.benchmark["gpu_layers"] == 0, (
            "another offload: measured again"
        )


class LoaderTests:
    def test_gpu_memory_is_a_budget_of_its_own(self) -> None:
        loads: list[str] = []
        loader = ModelLoader(
            lambda name: loads.append(name) or name,
            {"a": 500.0, "b": 500.0},
            10_000,
            out=lambda line: None,
            vram_mb={"a": 7_000.0, "b": 7_000.0},
            vram_budget_mb=12_000.0,
        )
        with loader.acquire("a"):
            pass
        with loader.acquire("b"):  # memory has room for both; the GPU has not
            assert loader.loaded() == ["b"]
        assert loads == ["a", "b"]
        with pytest.raises(BudgetError, match="lower --gpu-layers"):
            check_fits({"a": 500.0}, 10_000, vram_mb={"a": 13_000.0}, vram_budget_mb=12_000.0)


class RealBuildTests:
    def test_asking_for_layers_on_a_cpu_only_build_still_serves(self) -> None:
        """llama.cpp keeps every layer on the CPU when its build has no GPU backend."""
        from mahout.gpu import model_layers, offload_supported
        from mahout.model_files import shipped_model_source_path
        from scorer.llama import load_llama

        path = shipped_model_source_path()
        assert model_layers(path) == 18 and offload_supported() is False
        llm = load_llama(path, n_ctx=128, threads=1, gpu_layers=19)
        try:
            assert llm.tokenize(b"hello")
        finally:
            llm.close()
