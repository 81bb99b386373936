"""Django's SQLite backend, with a process's write transactions queued on one lock.

SQLite lets one writer in at a time; the others poll its busy handler, sleeping 1, 2, 5,
10 … up to 100 ms between tries, so under a burst (25 customers admitted at once, while
25 streams push their batches) a short transaction can wait many times its own length.
Here every transaction a thread of this process begins (`BEGIN IMMEDIATE`, as
`transaction_mode` sets) first takes one lock, held until its commit or rollback: the
writers of a process queue in order instead of sleeping. Other processes (Celery, a second
`manage.py`) still meet SQLite's own lock. PostgreSQL needs none of this.
"""

from __future__ import annotations

import threading

from django.db import OperationalError
from django.db.backends.sqlite3 import base

WRITER = threading.Lock()


class DatabaseWrapper(base.DatabaseWrapper):
    _holds_writer = False

    def _start_transaction_under_autocommit(self) -> None:
        timeout = float(self.settings_dict.get("OPTIONS", {}).get("timeout", 30))
        if not WRITER.acquire(timeout=timeout):
            raise OperationalError("database is locked (another transaction of this process held it too long)")
        self._holds_writer = True
        try:
            super()._start_transaction_under_autocommit()  # type: ignore[misc]  # private: not in django-stubs
        except BaseException:
            self._release_writer()
            raise

    def _release_writer(self) -> None:
        if self._holds_writer:
            self._holds_writer = False
            WRITER.release()

    def _commit(self) -> None:
        try:
            super()._commit()  # type: ignore[misc]  # private: not in django-stubs
        finally:
            self._release_writer()

    def _rollback(self) -> None:
        try:
            super()._rollback()  # type: ignore[misc]  # private: not in django-stubs
        finally:
            self._release_writer()

    def _close(self) -> None:
        try:
            super()._close()  # type: ignore[misc]  # private: not in django-stubs
        finally:
            self._release_writer()
