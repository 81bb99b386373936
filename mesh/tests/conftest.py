"""Fixtures of the mesh tests."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_django import Settings


@pytest.fixture
def local_swarm(settings: Settings) -> None:
    """Workers on loopback are accepted (the operator's MOE_ALLOW_PRIVATE_WORKERS), as every
    worker of these tests listens on 127.0.0.1."""
    settings.MOE_ALLOW_PRIVATE_WORKERS = True
