"""llama.cpp's JSON-schema-to-grammar converter, run where it cannot hang the process that asks.

Gateway and hosts turn a customer's `response_format` schema into a sampling grammar with the
same converter (llama-cpp-python's). It loops forever on a quarter of the short patterns RE2
accepts — any `pattern` with a literal `]` or `}` outside a class, such as `^}$` (measured: 492
of 1,999 generated patterns) — and a big enough schema can take its memory. So it runs in a
child process with a time bound and a memory bound: a schema it cannot convert in time is the
request's fault, and the stuck child is replaced. Answers (the grammar, or why not) are cached
by the schema's text, so a schema sent again costs nothing and a flood of one bad schema costs
one timeout.

One child per `GrammarFence`, started on first use (about a second: it imports llama-cpp);
conversions take turns in it (each takes milliseconds within `protocol.schema_limits`). The
gateway's (`marketplace.lifecycle.grammar_check`) asks only whether a schema converts; a host
(`scorer.llama.grammar_for`) samples with the grammar it returns.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections import OrderedDict
from typing import Any

__all__ = ["FenceUnavailable", "GrammarFence", "Unconvertible"]


class Unconvertible(ValueError):
    """The converter cannot turn this schema into a grammar (in time, in memory, at all): the
    request's fault. The message says why, for the customer."""


class FenceUnavailable(RuntimeError):
    """The converter's child process could not start: nobody's fault, try again later."""


def _serve(connection: Any, memory_mb: int) -> None:  # the child
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (memory_mb * 2**20, memory_mb * 2**20))
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    connection.send("ready")
    while True:
        schema = connection.recv()
        try:
            connection.send((True, json_schema_to_gbnf(schema)))
        except MemoryError:
            connection.send((False, f"its grammar needs more than {memory_mb} MB"))
        except RecursionError:
            connection.send((False, "it nests too deep for a sampling grammar"))
        except Exception as exc:  # noqa: BLE001 (the converter raises whatever it meets: its message is the answer)
            connection.send((False, f"it cannot be made into a sampling grammar ({type(exc).__name__}: {exc})"[:300]))


class GrammarFence:
    """`convert(schema_json, seconds=...)` → the GBNF grammar, or Unconvertible / FenceUnavailable."""

    def __init__(self, *, memory_mb: int, start_seconds: float = 60.0, cache_size: int = 512) -> None:
        self.memory_mb = memory_mb
        self.start_seconds = start_seconds  # the time bound is for converting, not for importing llama-cpp
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._child: Any = None
        self._connection: Any = None
        self._verdicts: OrderedDict[str, tuple[bool, str]] = OrderedDict()

    def convert(self, schema: str, *, seconds: float) -> str:
        with self._lock:
            verdict = self._verdicts.get(schema)
            if verdict is None:
                verdict = self._verdicts[schema] = self._convert(schema, seconds)
                if len(self._verdicts) > self.cache_size:
                    self._verdicts.popitem(last=False)
            self._verdicts.move_to_end(schema)
        converted, text = verdict
        if not converted:
            raise Unconvertible(text)
        return text

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _convert(self, schema: str, seconds: float) -> tuple[bool, str]:
        if self._child is None or not self._child.is_alive():
            self._start()
        try:
            self._connection.send(schema)
            if self._connection.poll(seconds):
                return self._connection.recv()
        except (EOFError, OSError):  # the child died (its memory bound): replaced next time
            self._stop()
            return False, f"its grammar needs more than {self.memory_mb} MB"
        self._stop()
        return False, f"llama.cpp's converter cannot turn it into a sampling grammar within {seconds:g} s"

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")  # (not fork: the processes that ask run threads)
        self._connection, theirs = context.Pipe()
        self._child = context.Process(
            target=_serve, args=(theirs, self.memory_mb), daemon=True, name="elephant-grammar-fence"
        )
        self._child.start()
        theirs.close()
        if not self._connection.poll(self.start_seconds) or self._connection.recv() != "ready":
            self._stop()
            raise FenceUnavailable("the grammar converter's process did not start")

    def _stop(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.join(timeout=5)
        self._child = self._connection = None
