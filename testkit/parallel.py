"""The suite split over several processes (pytest-xdist, `make test PYTEST_ARGS="-n 2"`; CI
does this): each worker gets a Redis database of its own, as pytest-django already gives it a
test database of its own.

A pytest plugin (`-p testkit.parallel`, in pyproject's addopts): pytest imports it before
Django reads its settings, so the worker's settings, and every gateway, Celery or mahout
process its tests start (they inherit the environment), see the worker's database. Without
it the workers' gateways would share channel groups, Celery queues and claim slots.
"""
from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit


def worker_redis_url(url: str, worker: str) -> str:
    """`url` with its database index moved past the first run's: `gw0` of `.../0` gets
    database 1, `gw1` database 2 (Redis has 16 by default)."""
    parts = urlsplit(url)
    base = int(parts.path.strip("/") or 0)
    index = base + 1 + int(worker.removeprefix("gw"))
    return urlunsplit(parts._replace(path=f"/{index}"))


_worker, _url = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("REDIS_URL")
if _worker and _url:
    os.environ["REDIS_URL"] = worker_redis_url(_url, _worker)
