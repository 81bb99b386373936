"""The MoE engine on the tiny qwen3moe file: routing, any subset of experts, slices, llama.cpp."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.gguf_loader import open_gguf
from engine.moe import ExpertBank, Gating, LocalExperts, MoeConfig, MoeModel, moe_ffn, route
from engine.moe_loader import (
    ByteTokenizer,
    expert_tensor_names,
    load_expert_slice,
    load_moe,
    make_tiny_moe,
    read_moe_config,
    write_expert_slice,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_moe(tmp_path_factory.mktemp("moe") / "tiny-moe.gguf", seed=7)


def _config(gating: Gating = Gating.SOFTMAX, e: int = 4, k: int = 2) -> MoeConfig:
    return MoeConfig("qwen3moe", 1, 8, 2, 1, 4, 16, 1e-6, 32, 1e4, e, k, 8, gating)


class RouteTests:
    def test_it_keeps_the_top_k_softmax_experts_renormalised(self) -> None:
        router = torch.eye(4, 8)  # (E, D): expert e scores x[e]
        x = torch.tensor([[0.0, 3.0, 1.0, 2.0, 0, 0, 0, 0]])
        weights, ids = route(x, router, _config())
        assert ids.tolist() == [[1, 3]]
        expected = torch.softmax(torch.tensor([3.0, 2.0]), dim=0)
        assert torch.allclose(weights[0], expected)

    def test_it_uses_sigmoid_scores_when_the_file_says_so(self) -> None:
        router = torch.eye(4, 8)
        x = torch.tensor([[0.0, 3.0, 1.0, 2.0, 0, 0, 0, 0]])
        weights, ids = route(x, router, _config(Gating.SIGMOID))
        assert ids.tolist() == [[1, 3]]
        s = torch.sigmoid(torch.tensor([3.0, 2.0]))
        assert torch.allclose(weights[0], s / s.sum())


class ExpertSubsetTests:
    def test_it_gives_the_same_layer_output_with_experts_split_over_banks(self, tiny: Path) -> None:
        config, weights = load_moe(tiny)
        layer = weights.layers[1]
        x = torch.randn(5, config.d_model, generator=torch.Generator().manual_seed(0))
        whole = moe_ffn(x, layer, config, LocalExperts({1: layer.experts}))
        banks = [load_expert_slice(tiny, 1, first, 3)[1] for first in (0, 3)] + [load_expert_slice(tiny, 1, 6, 2)[1]]

        def split(index: int, inputs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
            return {e: next(b for b in banks if b.holds(e)).compute(e, rows) for e, rows in inputs.items()}

        assert torch.equal(moe_ffn(x, layer, config, split), whole)

    def test_it_asks_only_for_the_routed_experts_with_their_rows(self, tiny: Path) -> None:
        config, weights = load_moe(tiny)
        layer = weights.layers[0]
        x = torch.randn(6, config.d_model, generator=torch.Generator().manual_seed(1))
        asked: dict[int, torch.Tensor] = {}

        def record(index: int, inputs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
            asked.update(inputs)
            return layer.experts.compute_many(inputs)

        moe_ffn(x, layer, config, record)
        _, ids = route(x, layer.router, config)
        assert sorted(asked) == sorted(ids.unique().tolist())
        assert sum(rows.shape[0] for rows in asked.values()) == 6 * config.n_experts_used

    def test_a_bank_refuses_an_expert_it_does_not_hold(self, tiny: Path) -> None:
        _, bank = load_expert_slice(tiny, 0, 2, 2)
        with pytest.raises(KeyError):
            bank.compute(4, torch.zeros(1, 64))


class TinyMoeFileTests:
    def test_it_has_the_real_qwen3moe_layout(self, tiny: Path) -> None:
        reader = open_gguf(tiny)
        names = {t.name for t in reader.tensors}
        for suffix in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "attn_q_norm", "attn_k_norm"):
            assert f"blk.1.{suffix}.weight" in names
        for key in ("expert_count", "expert_used_count", "expert_feed_forward_length"):
            assert f"qwen3moe.{key}" in reader.fields
        config = read_moe_config(reader)
        assert (config.n_experts, config.n_experts_used, config.expert_ffn_dim) == (8, 2, 32)

    def test_it_is_seeded(self, tiny: Path, tmp_path: Path) -> None:
        again = make_tiny_moe(tmp_path / "again.gguf", seed=7)
        assert again.read_bytes() == tiny.read_bytes()

    def test_the_command_line_writes_it(self, tmp_path: Path) -> None:
        out = tmp_path / "cli.gguf"
        result = subprocess.run(
            [sys.executable, "-m", "engine", "make-tiny-moe", str(out)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert read_moe_config(open_gguf(out)).n_layers == 2


class ExpertSliceTests:
    def test_a_slice_file_holds_only_that_slice_and_loads_the_same_experts(self, tiny: Path, tmp_path: Path) -> None:
        dest = tmp_path / "slice.gguf"
        write_expert_slice(tiny, 1, 2, 3, dest)
        assert {t.name for t in open_gguf(dest).tensors} == set(expert_tensor_names(1))
        assert dest.stat().st_size < tiny.stat().st_size / 4
        _, from_slice = load_expert_slice(dest, 1, 2, 3)
        _, from_model = load_expert_slice(tiny, 1, 2, 3)
        assert from_slice.first == 2 and from_slice.count == 3
        for a, b in (
            (from_slice.gate, from_model.gate),
            (from_slice.up, from_model.up),
            (from_slice.down, from_model.down),
        ):
            assert torch.equal(a, b)

    def test_it_refuses_a_slice_past_the_experts(self, tiny: Path) -> None:
        with pytest.raises(ValueError):
            load_expert_slice(tiny, 0, 6, 3)
        with pytest.raises(ValueError):
            load_expert_slice(tiny, 2, 0, 1)

    def test_a_model_without_experts_loads_none(self, tiny: Path) -> None:
        _, weights = load_moe(tiny, with_experts=False)
        assert all(layer.experts is None for layer in weights.layers)
        assert not any("exps" in name for name in weights.names)


class MoeModelTests:
    def test_greedy_generation_is_deterministic_and_matches_split_experts(self, tiny: Path) -> None:
        config, weights = load_moe(tiny)
        prompt = ByteTokenizer().encode("Hello")
        local = MoeModel(config, weights).generate(prompt, 8)
        banks = {layer: load_expert_slice(tiny, layer, 0, 8)[1] for layer in range(config.n_layers)}
        _, bare = load_moe(tiny, with_experts=False)
        assert MoeModel(config, bare, experts=LocalExperts(banks)).generate(prompt, 8) == local
        assert len(local) == 8

    def test_it_matches_llama_cpp_on_the_same_file(self, tiny: Path) -> None:
        llama_cpp = pytest.importorskip("llama_cpp")
        ids = ByteTokenizer().encode("Hello, MoE!")
        llm = llama_cpp.Llama(model_path=str(tiny), n_ctx=64, logits_all=True, verbose=False, n_threads=1)
        llm.eval(ids)
        reference = np.array(llm.scores[: len(ids)])  # (T, V)
        config, weights = load_moe(tiny)
        ours = MoeModel(config, weights)(
            torch.tensor(ids), torch.arange(len(ids)), torch.zeros(len(ids), dtype=torch.long)
        )
        assert np.abs(ours.numpy() - reference).max() < 1e-2
        assert (ours.numpy().argmax(1) == reference.argmax(1)).all()

    def test_expert_bank_checks_its_shapes(self) -> None:
        with pytest.raises(ValueError):
            ExpertBank(0, 0, torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), torch.zeros(2, 4, 8))


class MoeImportTests:
    def test_it_never_imports_django(self) -> None:
        code = (
            "import sys, engine.moe, engine.moe_loader; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'rest_framework', 'channels')); "
            "assert not bad, bad"
        )
        result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
