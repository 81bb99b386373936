"""Shared fixtures: the shipped model, loaded once per session, on one CPU thread."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.generate import build_stages
from engine.gguf_loader import default_model_path, open_gguf, read_config
from engine.model import Config, Stage
from engine.tokenizer import Tokenizer


@pytest.fixture(scope="session", autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def config(model_path: Path) -> Config:
    return read_config(open_gguf(model_path))


@pytest.fixture(scope="session")
def full_stage(model_path: Path) -> Stage:
    """One stage over every layer: the single-process reference. Tests that use it write
    their requests from position 0, so rows left behind by other tests never leak in."""
    (stage,) = build_stages(model_path, [(0, 18)], n_rows=4, n_ctx=768)
    return stage


@pytest.fixture(scope="session")
def tokenizer(model_path: Path) -> Tokenizer:
    return Tokenizer(model_path)
