"""On the embedded default, this process's write transactions queue on one lock (in order)
instead of polling SQLite's busy handler; the lock is given back however a transaction ends."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, transaction

from core.sqlite import base as sqlite_backend
from hosts.models import Host
from testkit.personas import make_host

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "sqlite", reason="the embedded default's backend"),
]


class WriterLockTests:
    def test_a_second_writer_waits_its_turn_then_commits(self) -> None:
        host = make_host(name="a", qualified=False).host
        order: list[str] = []
        holding = threading.Event()

        def first() -> None:
            with transaction.atomic():
                Host.objects.filter(pk=host.pk).update(name="first")
                holding.set()
                time.sleep(0.3)
                order.append("first committed")
            connection.close()

        def second() -> None:
            holding.wait()
            with transaction.atomic():
                order.append("second began")
                Host.objects.filter(pk=host.pk).update(name="second")
            connection.close()

        threads = [threading.Thread(target=first), threading.Thread(target=second)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
        assert order == ["first committed", "second began"]
        assert Host.objects.get(pk=host.pk).name == "second"
        assert not sqlite_backend.WRITER.locked()

    def test_the_lock_is_given_back_on_rollback(self) -> None:
        with pytest.raises(RuntimeError), transaction.atomic():
            assert sqlite_backend.WRITER.locked()
            raise RuntimeError("boom")
        assert not sqlite_backend.WRITER.locked()
        with transaction.atomic():  # and the next transaction gets it
            make_host(name="after", qualified=False)
        assert not sqlite_backend.WRITER.locked()
