"""llama.cpp's JSON-schema-to-grammar converter, run where it cannot hang a gateway process.

The gateway checks that every customer schema converts (`structured.schema_problem`), with the
converter every host runs (llama-cpp-python's). That converter loops forever on a quarter of
the short patterns RE2 accepts — any `pattern` with a literal `]` or `}` outside a class, such
as `^}$` (measured: 492 of 1,999 generated patterns). So it runs in a child process with a time
bound (`GRAMMAR_CHECK_SECONDS`) and a memory bound (`GRAMMAR_CHECK_MEMORY_MB`): a schema it
cannot convert in time is the customer's 400, and the child is replaced. Verdicts are cached by
the schema's text, so a schema sent again costs nothing, and a flood of one bad schema costs
one timeout.

One child per gateway process, started on first use (about a second: it imports llama-cpp);
conversions take turns in it (each takes milliseconds within `protocol.schema_limits`).
"""
from __future__ import annotations

import multiprocessing
import threading
from collections import OrderedDict
from typing import Any

from django.conf import settings

from core.errors import ApiError

_CACHE_SIZE = 512
_START_SECONDS = 60.0


def _serve(connection: Any, memory_mb: int) -> None:  # the child
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (memory_mb * 2**20, memory_mb * 2**20))
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    connection.send("ready")
    while True:
        schema = connection.recv()
        try:
            json_schema_to_gbnf(schema)
            connection.send(None)
        except MemoryError:
            connection.send(f"its grammar needs more than {memory_mb} MB")
        except RecursionError:
            connection.send("it nests too deep for a sampling grammar")
        except Exception as exc:  # noqa: BLE001 (the converter raises whatever it meets: its message is the answer)
            connection.send(f"it cannot be made into a sampling grammar ({type(exc).__name__}: {exc})"[:300])


class GrammarChecker:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._child: Any = None
        self._connection: Any = None
        self._verdicts: OrderedDict[str, str | None] = OrderedDict()

    def problem(self, schema: str) -> str | None:
        """Why the converter cannot turn `schema` (JSON text) into a grammar in time, or None."""
        with self._lock:
            if schema in self._verdicts:
                self._verdicts.move_to_end(schema)
                return self._verdicts[schema]
            verdict = self._convert(schema)
            self._verdicts[schema] = verdict
            if len(self._verdicts) > _CACHE_SIZE:
                self._verdicts.popitem(last=False)
            return verdict

    def _convert(self, schema: str) -> str | None:
        seconds = settings.GRAMMAR_CHECK_SECONDS
        if self._child is None or not self._child.is_alive():
            self._start()
        try:
            self._connection.send(schema)
            if self._connection.poll(seconds):
                return self._connection.recv()
        except (EOFError, OSError):  # the child died (its memory bound): replaced next time
            self._stop()
            return f"its grammar needs more than {settings.GRAMMAR_CHECK_MEMORY_MB} MB"
        self._stop()
        return f"llama.cpp's converter cannot turn it into a sampling grammar within {seconds:g} s"

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")  # (not fork: a gateway process runs threads)
        self._connection, theirs = context.Pipe()
        self._child = context.Process(target=_serve, args=(theirs, settings.GRAMMAR_CHECK_MEMORY_MB), daemon=True,
                                      name="elephant-grammar-check")
        self._child.start()
        theirs.close()
        # the time bound is for converting, not for starting (importing llama-cpp takes about a second)
        if not self._connection.poll(_START_SECONDS) or self._connection.recv() != "ready":
            self._stop()
            raise ApiError(503, "The gateway cannot check response_format schemas right now; try again shortly.",
                           code="grammar_check_unavailable", type="server_error")

    def _stop(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.join(timeout=5)
        self._child = self._connection = None


_CHECKER = GrammarChecker()


def grammar_problem(schema: str) -> str | None:
    """This process' checker (see the module)."""
    return _CHECKER.problem(schema)
