"""A model's chat template rendered as untrusted input: in Jinja2's immutable sandbox, in a child
process, under a time bound, an output bound and a memory bound.

A template comes from a model's file, so it is code nobody here wrote. The sandbox keeps it from
Python's internals, but not from running for ever (`{% for i in range(99999) %}{% for j in
range(99999) %}…`) or from building a string of gigabytes (`'x' * 10**10`, a string doubled in a
loop). Those bounds cannot be kept from inside the interpreter that renders (a loop that calls
nothing is never interrupted, one C call allocates at once), so the rendering happens in a small
pool of worker processes (`python -m protocol.template_sandbox`): each has its address space
capped (`WORKER_MEMORY_BYTES`), stops writing past `output_cap` characters, and is killed when a
rendering outlives `RENDER_SECONDS`. Whatever goes wrong is `TemplateRefused`, a message a
customer (a 400) or an operator (`catalog_add`) can read, never an error of the gateway.

The environment is Hugging Face's `apply_chat_template`'s (blocks trimmed, `loopcontrols`,
`raise_exception`, `tojson`) plus the clock both it and llama.cpp's server give a template:
`strftime_now(format)` and llama.cpp's `date_string` ("%d %b %Y"), read from the instant the
caller fixes (`now`, UTC) so that rendering the same job twice gives the same text. A worker
answers one JSON line per JSON line; a round trip costs a fraction of a millisecond. No Django.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

RENDER_SECONDS = 5.0  # a chat renders in milliseconds; past this the worker is killed and the rendering refused
WORKER_MEMORY_BYTES = 1 << 30  # each worker's address space (a Python with Jinja2 uses a few tens of MB)
OUTPUT_FLOOR = 1 << 20  # characters any rendering may write, on top of OUTPUT_PER_INPUT per character it is given
OUTPUT_PER_INPUT = 4
WORKERS = 8  # renderings at once per process; more wait for a worker
IDLE_KEPT = 4  # idle workers kept per process


class TemplateRefused(ValueError):
    """The model's template cannot render this conversation (it raised, it is broken, or it ran
    past its bounds); the message says why in words a customer can act on."""


def render_bounded(template: str, renders: list[dict], *, now: datetime | None = None) -> list[str]:
    """Each of `renders` ({"messages": [...], "variables": {...}}) rendered by `template`, in a
    worker under the bounds above, at the instant `now` (default: this one). Raises
    TemplateRefused: the template does not compile, raises, or passes a bound."""
    instant = (now or datetime.now(UTC)).timestamp()
    request = {"template": template, "renders": renders, "now": instant}
    line = json.dumps(request).encode() + b"\n"  # ASCII: a lone surrogate in a message travels too
    answer = _POOL.ask(line)
    if "refused" in answer:
        raise TemplateRefused(str(answer["refused"]))
    return [str(text) for text in answer["texts"]]


# -- the parent's side: a pool of workers -----------------------------------------------------


class _Worker:
    """One worker process and its pipes; asked one request at a time."""

    def __init__(self) -> None:
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
        self.process = subprocess.Popen(  # noqa: S603 (this interpreter, this module)
            [sys.executable, "-m", "protocol.template_sandbox"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=environment,
            close_fds=True,
        )

    def ask(self, line: bytes, deadline: float) -> dict | None:
        """The worker's answer, or None when it did not answer whole before `deadline` (or died)."""
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            self.process.stdin.write(line)
            self.process.stdin.flush()
        except OSError:
            return None
        descriptor = self.process.stdout.fileno()
        chunks: list[bytes] = []
        while not chunks or not chunks[-1].endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([descriptor], [], [], left)[0]:
                return None
            chunk = os.read(descriptor, 1 << 20)  # (the buffered reader is never used: select sees the pipe itself)
            if not chunk:
                return None
            chunks.append(chunk)
        return json.loads(b"".join(chunks))

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


class _Pool:
    """Workers started on first use and reused; one that fails or runs late is killed. A forked
    child starts a pool of its own (its parent's workers answer its parent)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._slots = threading.BoundedSemaphore(WORKERS)
        self._pid = os.getpid()

    def ask(self, line: bytes) -> dict:
        if self._pid != os.getpid():  # a forked child: none of these workers is its own
            with self._lock:
                self._idle, self._pid = [], os.getpid()
        with self._slots:
            worker = self._checkout()
            try:
                answer = worker.ask(line, time.monotonic() + RENDER_SECONDS)
            except BaseException:
                worker.kill()
                raise
            if answer is None:
                worker.kill()
                return {
                    "refused": f"this model's chat template did not finish rendering within {RENDER_SECONDS:g} s "
                    "(or used more memory than a template may)"
                }
            self._checkin(worker)
            return answer

    def _checkout(self) -> _Worker:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return _Worker()

    def _checkin(self, worker: _Worker) -> None:
        with self._lock:
            if len(self._idle) < IDLE_KEPT:
                self._idle.append(worker)
                return
        worker.kill()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        if self._pid == os.getpid():
            for worker in idle:
                worker.kill()


_POOL = _Pool()
atexit.register(_POOL.close)


# -- the worker's side: the sandbox -----------------------------------------------------------


class _Raised(Exception):
    """The template's own `raise_exception(message)`."""


def _raise_exception(message: str) -> None:
    raise _Raised(str(message))


def _tojson(value: Any, indent: int | None = None, separators: tuple | None = None, sort_keys: bool = False) -> str:
    """Hugging Face's `tojson`: JSON as written, non-ASCII kept, with its indent and separators."""
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compiled(template: str):  # -> jinja2.Template
    """A template compiled once per worker in an immutable sandbox (HF's environment: blocks
    trimmed, `loopcontrols`)."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    try:
        return environment.from_string(template)
    except TemplateError as error:
        raise TemplateRefused(f"this model's chat template does not compile: {error}") from None


class _TooLong(Exception):
    pass


def _render_one(template: Any, render: dict, *, now: float, cap: int) -> str:
    """One rendering, its output counted as it is written."""
    instant = datetime.fromtimestamp(now, UTC)

    def strftime_now(format: str) -> str:
        return instant.strftime(str(format))

    clock = {"strftime_now": strftime_now, "date_string": instant.strftime("%d %b %Y")}
    written: list[str] = []
    size = 0
    for chunk in template.generate(messages=render["messages"], **clock, **render["variables"]):
        size += len(chunk)
        if size > cap:
            raise _TooLong
        written.append(chunk)
    return "".join(written)


def _answer(line: bytes) -> dict:
    """What a worker answers a request: the texts, or why the template refused. Each rendering
    may write a floor of characters and a few per byte it was given (a template writes its
    markup around the texts, once or a few times each)."""
    request, cap = json.loads(line), OUTPUT_FLOOR + OUTPUT_PER_INPUT * len(line)
    try:
        template = _compiled(request["template"])
        return {"texts": [_render_one(template, render, now=request["now"], cap=cap) for render in request["renders"]]}
    except TemplateRefused as refused:  # (it does not compile)
        return {"refused": str(refused)}
    except _Raised as raised:
        return {"refused": f"this model's chat template refuses the conversation: {raised}"}
    except _TooLong:
        return {"refused": f"this model's chat template writes more than {cap:,} characters for this conversation"}
    except RecursionError:
        return {"refused": "this model's chat template recurses too deeply"}
    except MemoryError:
        return {"refused": "this model's chat template uses more memory than a template may"}
    except Exception as error:  # noqa: BLE001 (untrusted code: whatever it raises is its refusal)
        return {"refused": f"this model's chat template cannot render the conversation: {error}"}


def _memory_capped() -> None:
    try:
        import resource
    except ImportError:  # (not on Windows: the time bound still holds)
        return
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))


def main() -> None:
    """The worker: one JSON request a line on stdin, one JSON answer a line on stdout."""
    _memory_capped()
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    for line in source:
        try:
            answer = _answer(line)
        except MemoryError:
            answer = {"refused": "this model's chat template uses more memory than a template may"}
        sink.write(json.dumps(answer).encode() + b"\n")
        sink.flush()


if __name__ == "__main__":
    main()
