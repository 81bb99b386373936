"""The MoE engine on real mixture-of-experts architectures, against llama.cpp on the same file.

The model is `testkit.families`' tiny `qwen3moe`: Qwen 3's real vocabulary (151,936 tokens)
and template, three layers of 8 float16 experts with 2 routed per token, seeded random weights.
llama.cpp decodes it greedily; the engine's logits after each prompt must lie within
LOGITS_ATOL of llama.cpp's, and its tokens must be llama.cpp's until the two part at a
near-tie (`engine.tests.test_families.Reference`). The same holds when every layer's
experts come from slice files, as volunteers download them.

The experts matter to these logits (their weights are drawn wider than the rest, see
`testkit.families.MOE_FAMILIES`): the engine lies 1.2-2.3e-3 off llama.cpp on these prompts
(both round to float16, in different places: llama.cpp its activations, the engine each
product's inputs and outputs, `engine.model.linear`); keeping the top-2 weights without
renormalising them, as llama.cpp's qwen3moe does, would put them 0.065-0.11 off.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.gguf_meta import open_gguf
from engine.moe import LocalExperts, MoeConfig, MoeModel, MoeWeights
from engine.moe_loader import has_byte_vocabulary, load_expert_slice, load_moe, read_moe_config, write_expert_slice
from engine.tests.test_families import N_TOKENS, Reference
from testkit.families import sdist_models, tiny_model

N_LAYERS = 3
LOGITS_ATOL = 0.005


@pytest.fixture(scope="module")
def moe_path(qwen3moe_file: Path) -> Path:
    return qwen3moe_file  # the root conftest's: N_LAYERS layers


@pytest.fixture(scope="module")
def loaded(moe_path: Path) -> tuple[MoeConfig, MoeWeights]:
    return load_moe(moe_path)


@pytest.fixture(scope="module")
def reference(moe_path: Path) -> Iterator[Reference]:
    ref = Reference(moe_path)
    yield ref
    ref.llama.close()


def _first_logits(model: MoeModel, prompt_ids: list[int]) -> np.ndarray:
    """The logits after the prompt (V,), prefilled into cache row 0."""
    n = len(prompt_ids)
    logits = model(torch.tensor(prompt_ids), torch.arange(n), torch.zeros(n, dtype=torch.long), torch.tensor([n - 1]))
    return logits[0].numpy()


class Qwen3MoeFileTests:
    def test_it_is_a_real_vocabulary_qwen3moe_file(self, moe_path: Path) -> None:
        reader = open_gguf(moe_path)
        config = read_moe_config(reader)
        assert (config.arch, config.n_layers, config.n_experts, config.n_experts_used) == ("qwen3moe", N_LAYERS, 8, 2)
        assert config.vocab_size > 150_000 and not has_byte_vocabulary(reader)
        assert "blk.2.ffn_gate_exps.weight" in {t.name for t in reader.tensors}


class Qwen3MoeGoldenTests:
    def test_its_logits_and_greedy_tokens_are_llama_cpps(self, loaded: tuple, reference: Reference) -> None:
        config, weights = loaded
        for index, prompt_ids in enumerate(reference.prompts):
            model = MoeModel(config, weights, n_rows=1, n_ctx=64)
            _, want_logits = reference.greedy[index]
            off = float(np.abs(_first_logits(model, prompt_ids) - want_logits).max())
            assert off < LOGITS_ATOL, f"prompt {index}: logits {off:.5f} off llama.cpp's"
            reference.assert_agrees(index, MoeModel(config, weights, n_rows=1, n_ctx=64).generate(prompt_ids, N_TOKENS))

    def test_unnormalised_top_k_weights_would_show(self, loaded: tuple, reference: Reference) -> None:
        """The golden test can fail: llama.cpp's qwen3moe renormalises the kept weights, and
        leaving that out moves these logits well past LOGITS_ATOL."""
        config, weights = loaded
        wrong = MoeModel(replace(config, norm_topk=False), weights, n_rows=1, n_ctx=64)
        off = float(np.abs(_first_logits(wrong, reference.prompts[0]) - reference.greedy[0][1]).max())
        assert off > 4 * LOGITS_ATOL

    def test_experts_from_slice_files_give_the_same_tokens(
        self,
        moe_path: Path,
        loaded: tuple,
        reference: Reference,
        tmp_path: Path,
    ) -> None:
        """Layer 1's experts from two slice files, as two volunteers hold them (cut from the
        float16 file as the gateway cuts them), the other layers' here: the same tokens."""
        config, weights = loaded
        whole = MoeModel(config, weights, n_rows=1, n_ctx=64).generate(reference.prompts[1], N_TOKENS)
        slices = []
        for first in (0, 4):
            write_expert_slice(moe_path, 1, first, 4, tmp_path / f"slice-{first}.gguf")
            slices.append(load_expert_slice(tmp_path / f"slice-{first}.gguf", 1, first, 4)[1])
        local = LocalExperts({layer.index: layer.experts for layer in weights.layers})

        def sliced(layer: int, inputs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
            if layer != 1:
                return local(layer, inputs)
            return {e: next(bank for bank in slices if bank.holds(e)).compute(e, rows) for e, rows in inputs.items()}

        assert (
            MoeModel(config, weights, experts=sliced, n_rows=1, n_ctx=64).generate(reference.prompts[1], N_TOKENS)
            == whole
        )


class Qwen3MoeRopeTests:
    def test_linear_rope_scaling_is_llama_cpps(self, tmp_path: Path) -> None:
        """Positions divided by the file's factor, as llama.cpp does: scaled, the logits after
        a 10-token prompt lie 2.2e-3 off llama.cpp's; computed unscaled, 0.48."""
        path = tiny_model(
            "qwen3moe",
            sdist_models(tmp_path / "sdist"),
            tmp_path / "scaled.gguf",
            n_layer=N_LAYERS,
            rope_linear_factor=4.0,
        )
        reference = Reference(path)
        try:
            config, weights = load_moe(path)
            assert config.rope_scale == 0.25
            prompt_ids, (_, want) = reference.prompts[2], reference.greedy[2]
            off = float(np.abs(_first_logits(MoeModel(config, weights, n_rows=1, n_ctx=64), prompt_ids) - want).max())
            unscaled = MoeModel(replace(config, rope_scale=1.0), weights, n_rows=1, n_ctx=64)
            assert off < LOGITS_ATOL < float(np.abs(_first_logits(unscaled, prompt_ids) - want).max())
        finally:
            reference.llama.close()

    def test_a_scaling_it_does_not_compute_is_refused(self, tmp_path: Path) -> None:
        from gguf import GGUFWriter

        writer = GGUFWriter(str(tmp_path / "yarn.gguf"), "qwen3moe")
        for key, value in (
            ("block_count", 1),
            ("context_length", 64),
            ("embedding_length", 64),
            ("attention.head_count", 4),
            ("expert_count", 8),
            ("expert_used_count", 2),
            ("expert_feed_forward_length", 32),
        ):
            writer.add_uint32(f"qwen3moe.{key}", value)
        writer.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", 1e-6)
        writer.add_string("qwen3moe.rope.scaling.type", "yarn")
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        with pytest.raises(ValueError, match="RoPE scaling 'yarn' is not supported"):
            read_moe_config(open_gguf(tmp_path / "yarn.gguf"))


class Qwen3MoeQuantizedTests:
    """Experts stored in Q8_0, as a real MoE file stores them quantised: the engine dequantises
    them (llama.cpp quantises its activations to 8 bits against Q8_0 weights, so the two lie
    0.011-0.021 apart here, not 2e-3), and a slice file keeps them in their stored encoding."""

    def test_quantised_experts_load_slice_and_agree_with_llama_cpp(self, tmp_path: Path) -> None:
        from gguf import GGMLQuantizationType, GGUFReader

        path = tiny_model(
            "qwen3moe",
            sdist_models(tmp_path / "sdist"),
            tmp_path / "q8.gguf",
            n_layer=N_LAYERS,
            expert_type=GGMLQuantizationType.Q8_0,
        )
        reference = Reference(path)
        try:
            config, weights = load_moe(path)
            off = float(
                np.abs(
                    _first_logits(MoeModel(config, weights, n_rows=1, n_ctx=64), reference.prompts[0])
                    - reference.greedy[0][1]
                ).max()
            )
            assert off < 0.05, f"logits {off:.4f} off llama.cpp's"
        finally:
            reference.llama.close()
        write_expert_slice(path, 2, 4, 4, tmp_path / "slice.gguf")
        assert {t.tensor_type for t in GGUFReader(str(tmp_path / "slice.gguf")).tensors} == {GGMLQuantizationType.Q8_0}
        _, bank = load_expert_slice(tmp_path / "slice.gguf", 2, 4, 4)
        whole = weights.layers[2].experts
        assert torch.equal(bank.gate, whole.gate[4:8]) and torch.equal(bank.down, whole.down[4:8])


class MixtralGoldenTests:
    """Mixtral's layout (`llama` blocks with routed experts: no q/k norms, llama's pairwise
    RoPE, the expert width in feed_forward_length) on Mistral's vocabulary: logits 0.6-1.5e-3
    off llama.cpp's; rotating NEOX halves instead of pairs would put them 0.011-0.038 off."""

    def test_its_logits_and_greedy_tokens_are_llama_cpps(self, tmp_path: Path) -> None:
        path = tiny_model("mixtral", sdist_models(tmp_path / "sdist"), tmp_path / "mixtral.gguf", n_layer=N_LAYERS)
        reference = Reference(path)
        try:
            config, weights = load_moe(path)
            assert (config.arch, config.qk_norm, config.rope_neox, config.n_experts) == ("llama", False, False, 8)
            assert weights.layers[0].q_norm is None
            for index, prompt_ids in enumerate(reference.prompts):
                off = float(
                    np.abs(
                        _first_logits(MoeModel(config, weights, n_rows=1, n_ctx=64), prompt_ids)
                        - reference.greedy[index][1]
                    ).max()
                )
                assert off < LOGITS_ATOL, f"prompt {index}: logits {off:.5f} off llama.cpp's"
                reference.assert_agrees(
                    index, MoeModel(config, weights, n_rows=1, n_ctx=64).generate(prompt_ids, N_TOKENS)
                )
            neox = MoeModel(replace(config, rope_neox=True), weights, n_rows=1, n_ctx=64)  # the wrong RoPE form shows
            assert float(np.abs(_first_logits(neox, reference.prompts[2]) - reference.greedy[2][1]).max()) > LOGITS_ATOL
        finally:
            reference.llama.close()
