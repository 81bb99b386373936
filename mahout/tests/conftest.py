"""Shared fixtures: a fake gateway on loopback and a host API client pointed at it."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from mahout.api import HostApi
from mahout.tests.fake_gateway import TOKEN, FakeGateway


@pytest.fixture
def gateway() -> Iterator[FakeGateway]:
    with FakeGateway() as fake:
        yield fake


@pytest.fixture
def api(gateway: FakeGateway) -> Iterator[HostApi]:
    client = HostApi(gateway.url, TOKEN, timeout=5.0, sleep=lambda _s: None)
    yield client
    client.close()
