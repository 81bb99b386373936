"""Shared personas and the end-to-end stack.

Personas: a customer who pays, a host who serves, an outsider who must be
refused. The stack starts real processes on loopback: a daphne gateway on the
test database and mahout hosts running the shipped model.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from pytest_django import DjangoDbBlocker

from testkit.personas import Customer, ServingHost, make_customer, make_host
from testkit.stack import ROOT, Gateway, Mahout, free_port, stack_env, wait_until

if TYPE_CHECKING:
    from catalog.models import CatalogModel

# Every mahout a test starts serves one job at a time unless the test says `--slots` (measuring
# the best number at each start would cost every such test seconds; tests of slots name theirs).
os.environ.setdefault("MAHOUT_SLOTS", "1")

__all__ = [  # tests import these from here
    "ROOT",
    "Customer",
    "Gateway",
    "Mahout",
    "ServingHost",
    "free_port",
    "make_customer",
    "make_host",
    "stack_env",
    "wait_until",
]


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix: None) -> None:
    """Close connections after each pooled ORM call so none outlive the test database,
    and give each run its own SQLite file (the gateway processes it starts share it)."""
    from django.conf import settings

    default = settings.DATABASES["default"]
    default["CONN_MAX_AGE"] = 0
    if default["ENGINE"] == "core.sqlite":  # a file per test run: parallel runs must not share one
        default.setdefault("TEST", {})["NAME"] = str(settings.VAR_DIR / f"test-{os.getpid()}.sqlite3")


@pytest.fixture(scope="session", autouse=True)
def _flush_retries_a_deadlock() -> None:
    """The end-to-end gateway outlives each test and keeps settling what the test left (a
    killed host's jobs, a watchdog's sweep) while the test database is flushed; PostgreSQL may
    then break the deadlock between its transaction and the flush's TRUNCATE by cancelling the
    flush. The flush is tried again then, a few times, instead of leaving the rows to the
    next test."""
    from django.core.management.base import CommandError
    from django.test import TransactionTestCase

    teardown = TransactionTestCase._fixture_teardown
    if getattr(teardown, "retries_a_deadlock", False):
        return

    def patient_teardown(self: TransactionTestCase) -> None:
        for attempt in range(5):
            try:
                return teardown(self)
            except CommandError:
                if attempt == 4:
                    raise
                time.sleep(1 + attempt)

    patient_teardown.retries_a_deadlock = True  # type: ignore[attr-defined]
    TransactionTestCase._fixture_teardown = patient_teardown  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    """The served-model list is cached; each test starts from the database's truth."""
    from django.core.cache import cache

    cache.clear()
    yield


@pytest.fixture(autouse=True)
def _audits_only_where_asked(request: pytest.FixtureRequest, settings) -> None:  # noqa: ANN001 (pytest-django's)
    """Audits (`marketplace.trust.audits`) hold a host's share in escrow and fail a host that
    reports no tokens, as the suite's synthetic hosts do: they stay on only in the tests
    marked `audits` (`testkit.stack.stack_env` does the same for child processes)."""
    settings.AUDIT_ENABLED = request.node.get_closest_marker("audits") is not None
    settings.AUDIT_PASS_RECHECK_RATE = 0.0  # a scorer's pass decides, but in the tests of the re-check
    settings.AUDIT_SCORER_OWNER_MIN_AGE_DAYS = 0.0  # a trusted host's owner scores without a history, but in the
    settings.AUDIT_SCORER_OWNER_MIN_PASSED_AUDITS = 0  # tests of that history (test_audits_by_hosts.py)


@pytest.fixture(autouse=True)
def _synthetic_hosts_unversioned(settings) -> None:  # noqa: ANN001 (pytest-django's)
    """The suite's synthetic hosts heartbeat with no version, or "sim" (refused in production:
    `hosts.selectors.client_too_old`; `testkit.stack.stack_env` lets child processes' in too)."""
    settings.MAHOUT_UNVERSIONED_ALLOWED = True


@pytest.fixture
def catalog(db: None) -> CatalogModel:
    from catalog.models import CatalogModel
    from catalog.seed import catalog_seed

    catalog_seed(CatalogModel)
    return CatalogModel.objects.get(name="gemma-3-270m")


@pytest.fixture
def customer(catalog: CatalogModel) -> Customer:
    return make_customer()


@pytest.fixture
def serving_host(catalog: CatalogModel) -> ServingHost:
    return make_host()


@pytest.fixture
def outsider(catalog: CatalogModel) -> ServingHost:
    return make_host(name="outsider")


@pytest.fixture
def var_dir(tmp_path: Path, settings) -> Path:  # noqa: ANN001 (pytest-django's settings fixture)
    """This test's own VAR_DIR (catalog_add's vocabulary copies land under it)."""
    settings.VAR_DIR = tmp_path / "var"
    settings.VAR_DIR.mkdir()
    return settings.VAR_DIR


@pytest.fixture(scope="session")
def family_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny real-vocabulary models of six chat families (`testkit.families`), built once per
    run; tests that need them skip, saying why, when the sdist cannot be fetched."""
    from testkit.families import SdistUnavailable, family_models

    try:
        return family_models(tmp_path_factory.mktemp("families"))
    except SdistUnavailable as error:
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def qwen3moe_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny real-vocabulary Qwen 3 mixture of experts (`testkit.families.MOE_FAMILIES`: three
    layers of 8 experts, 2 per token), built once per run; skips, saying why, without the sdist."""
    from testkit.families import SdistUnavailable, sdist_models, tiny_model

    folder = tmp_path_factory.mktemp("qwen3moe")
    try:
        return tiny_model("qwen3moe", sdist_models(folder / "sdist"), folder / "qwen3moe.gguf", n_layer=3)
    except SdistUnavailable as error:
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def mixtral_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Mixtral-style mixture of experts (`testkit.families.MOE_FAMILIES`: llama blocks
    of 8 experts, 2 per token, Mistral's vocabulary and template), built once per run; skips,
    saying why, without the sdist."""
    from testkit.families import SdistUnavailable, sdist_models, tiny_model

    folder = tmp_path_factory.mktemp("mixtral")
    try:
        return tiny_model("mixtral", sdist_models(folder / "sdist"), folder / "mixtral.gguf", n_layer=3)
    except SdistUnavailable as error:
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def e2e_dirs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("e2e")
    (base / "logs").mkdir()
    (base / "mahout-home").mkdir()
    return base


@pytest.fixture(scope="session")
def gateway(django_db_setup: None, django_db_blocker: DjangoDbBlocker, e2e_dirs: Path) -> Iterator[Gateway]:
    with django_db_blocker.unblock():
        env = stack_env(
            {  # the failover tests kill hosts on purpose: they must not be rested as unreliable
                "QUEUE_TIMEOUT_SECONDS": "4",
                "STALL_SECONDS": "20",
                "OUTPUT_RETENTION_SECONDS": "0",
                "HOST_MAX_FAILURES_PER_HOUR": "100000",
                "RING_ALLOW_PRIVATE_STAGES": "1",  # the ring tests' stages are strangers listening on loopback
            }
        )
    gw = Gateway(env, e2e_dirs / "logs")
    yield gw
    gw.stop()


@pytest.fixture
def start_mahout(gateway: Gateway, e2e_dirs: Path, transactional_db: None) -> Iterator[Callable[..., Mahout]]:
    """Start a mahout host for a token and wait until it has qualified."""
    started: list[Mahout] = []

    def start(token: str, *, extra: list[str] | None = None, wait_qualified: bool = True) -> Mahout:
        from hosts.models import Host

        host = Mahout(
            server=gateway.url,
            token=token,
            home=e2e_dirs / "mahout-home",
            env=stack_env(),
            log_dir=e2e_dirs / "logs",
            extra=extra,
        )
        started.append(host)
        if wait_qualified:

            def ready() -> bool:
                assert host.proc.poll() is None, f"mahout exited:\n{host.output()}"
                row = Host.objects.filter(token_prefix=token[:12]).first()
                return bool(row and row.last_heartbeat_at and row.qualifications.exists())

            wait_until(ready, timeout=180, what="mahout to benchmark and register", interval=0.3)
            time.sleep(0.3)  # its first long-poll is on the way
        return host

    yield start
    for host in started:
        host.stop()
