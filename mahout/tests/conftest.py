"""Shared fixtures: a fake gateway on loopback and a host API client pointed at it; for the
ring's tests, the shipped model's path and torch held to one thread."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mahout.api import HostApi
from mahout.tests.fake_farm import FarmGateway
from mahout.tests.fake_gateway import TOKEN, FakeGateway


@pytest.fixture
def gateway() -> Iterator[FakeGateway]:
    with FakeGateway() as fake:
        yield fake


@pytest.fixture
def farm() -> Iterator[FarmGateway]:
    """The fake gateway extended with embeddings jobs and model listings; a module that
    wants `api` pointed at it overrides `gateway` with ``def gateway(farm): return farm``."""
    with FarmGateway() as fake:
        yield fake


@pytest.fixture
def api(gateway: FakeGateway) -> Iterator[HostApi]:
    client = HostApi(gateway.url, TOKEN, timeout=5.0, sleep=lambda _s: None)
    yield client
    client.close()


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Torch on one thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    import torch  # not at import: most of mahout's tests never touch torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model_path() -> Path:
    from engine.gguf_loader import default_model_path

    return default_model_path()
