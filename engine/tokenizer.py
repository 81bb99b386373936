"""Tokenize and detokenize with llama.cpp's vocabulary reader (the engine is the transformer;
text <-> ids is borrowed so that both sides of the golden tests see the same ids)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["Tokenizer"]


class Tokenizer:
    def __init__(self, model_path: str | Path) -> None:
        from llama_cpp import Llama

        self.llama = Llama(model_path=str(model_path), vocab_only=True, verbose=False)  # the vocabulary only
        self.eos_id: int = self.llama.token_eos()
        self.bos_id: int = self.llama.token_bos()

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        return self.llama.tokenize(text.encode("utf-8"), add_bos=add_bos)

    def decode(self, token_ids: list[int]) -> str:
        return self.llama.detokenize(token_ids).decode("utf-8", errors="replace")
