"""The host loop: ``can_work → claim → run → report``, up to ``slots`` jobs at once.

Roles are kept apart: :class:`~mahout.api.HostApi` speaks HTTP, runners produce text or
vectors, :class:`~mahout.loader.ModelLoader` decides which models are in memory (a job for
a cold model loads it, unloading the least recently used), and this module decides what
to do next. A background thread sends heartbeats carrying the host's catalog. Generated
text goes through :class:`~mahout.pusher.BatchPusher` (ordered ~50 ms batches, seq from
0, sent off the generating thread); a 409 on a push means the job is no longer ours and
generation stops at once. An embeddings job pushes nothing: its vectors travel with
"complete".

An outage (the gateway unreachable, or answering 5xx past every retry) is said as it
happens, and its end too: "reconnected" once the gateway answers again, so the last line an
owner reads after one is not an error that no longer holds.

A host with several slots (one model load serving several sequences, see
:mod:`mahout.runners.batched`) claims again while a slot is free: each generation job then
runs on a thread of its own, and a runner that streams one job at a time is never given two
(its own gate). Audits and ring checks run on the loop's thread, between claims.

Signals: the first SIGTERM/SIGINT only sets a flag (so an in-flight HTTP call is never cut
mid-way); the current jobs finish, then the loop exits. The second exits at once.
"""

from __future__ import annotations

import contextlib
import enum
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from mahout import __version__
from mahout.api import HostApi, HostApiError, ServerUnavailable
from mahout.idle import IdleDetector
from mahout.loader import ModelLoader, UnknownModel
from mahout.owner import OwnerGuard
from mahout.progress import ProgressReporter
from mahout.pusher import FLUSH_INTERVAL_SECONDS, BatchPusher
from mahout.runners import Embedder, Runner
from mahout.schedule import Schedule
from mahout.scoring import audit_score, declined
from protocol.jobs import AUDIT, EMBEDDINGS, RING_CHECK
from protocol.timing import CLAIM_WAIT_SECONDS, HEARTBEAT_INTERVAL_SECONDS, PROGRESS_INTERVAL_SECONDS
from scorer.errors import RequestRejected

MAINTENANCE_POLL_SECONDS = 10.0  # how often a host in maintenance asks again
PAUSE_POLL_SECONDS = 1.0
ERROR_BACKOFF_SECONDS = 5.0
SLOTS = 1  # jobs a loop runs at once unless told more (`mahout run --slots`)


class LoopState(enum.Enum):
    """Where the loop is; readable in heartbeats, logs and tests."""

    CAN_WORK = "can_work"
    CLAIM = "claim"
    RUN = "run"
    REPORT = "report"
    STOPPED = "stopped"


class JobState(enum.Enum):
    """Life of one claimed job on this host."""

    CLAIMED = "claimed"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    LOST = "lost"  # the server took it back (409/403) or could not be reached


_TRANSITIONS = {
    JobState.CLAIMED: {JobState.RUNNING, JobState.FAILED},
    JobState.RUNNING: {JobState.COMPLETED, JobState.FAILED, JobState.LOST},
}


@dataclass
class JobRecord:
    """One claimed job and what became of it."""

    job: dict
    state: JobState = JobState.CLAIMED
    started: float = field(default_factory=time.monotonic)
    detail: str = ""
    finish_reason: str = ""
    completion_tokens: int = 0
    embeddings: list[list[float]] | None = None
    prompt_tokens: int = 0
    prompt_read: int | None = None  # of them, those read (the rest reused from held KV), when the runner tells
    token_ids: list[int] | None = None  # every token sampled, when the runner reports them (for audits)
    seed: int | None = None  # the seed they were sampled with
    cause: str = "host"  # whose fault a failure is: "request" when the job's own content cannot be run

    @property
    def id(self) -> object:
        return self.job["id"]

    def advance(self, new: JobState, detail: str = "") -> None:
        """Move to ``new``; an illegal transition is a bug, so it raises."""
        if new not in _TRANSITIONS.get(self.state, set()):
            raise RuntimeError(f"job {self.id}: illegal transition {self.state.value} -> {new.value}")
        self.state, self.detail = new, detail


class HostLoop:
    """Claims and runs jobs for the models of ``models`` until told to stop.

    ``models`` is a :class:`ModelLoader`, or a dict of runners already loaded (kept
    loaded). ``installed`` lists the models installed on this machine for the heartbeat's
    catalog (default: the loader's models).
    """

    def __init__(
        self,
        api: HostApi,
        models: ModelLoader | dict[str, Runner | Embedder],
        *,
        fingerprint: str,
        home: Path,
        installed: list[str] | None = None,
        idle: IdleDetector | None = None,
        schedule: Schedule | None = None,
        claim_wait: float = CLAIM_WAIT_SECONDS,
        heartbeat_interval: float = HEARTBEAT_INTERVAL_SECONDS,
        flush_interval: float = FLUSH_INTERVAL_SECONDS,
        progress_interval: float = PROGRESS_INTERVAL_SECONDS,
        pause_poll: float = PAUSE_POLL_SECONDS,
        error_backoff: float = ERROR_BACKOFF_SECONDS,
        out: Callable[[str], None] = print,
        slots: int = SLOTS,
    ) -> None:
        self.api, self.fingerprint, self.home = api, fingerprint, home
        self.slots = max(1, int(slots))
        self.models = models if isinstance(models, ModelLoader) else ModelLoader.fixed(dict(models), out=out)
        self.installed = sorted(installed) if installed is not None else self.models.qualified
        self.idle = idle
        self.schedule = schedule
        self.claim_wait, self.heartbeat_interval = claim_wait, heartbeat_interval
        self.flush_interval, self.pause_poll, self.error_backoff = flush_interval, pause_poll, error_backoff
        self.progress_interval = progress_interval
        self.out = out
        self.state = LoopState.CAN_WORK
        self._active: dict[object, JobRecord] = {}
        self._room = threading.Condition()  # guards _active and _gates; notified when a job ends
        self._workers: set[threading.Thread] = set()  # jobs running beside the loop (slots > 1)
        self._gates: dict[str, threading.BoundedSemaphore] = {}  # per model: the streams its runner takes at once
        self._stop = threading.Event()
        self.upgrade_required: str | None = None  # the gateway refused this version: the loop stops
        self._signals = 0
        self._waiting = False  # in a claim's long-poll, holding no job
        self._server_paused = False
        self._pause_reason: str | None = None
        self._maintenance_said = ""  # the last maintenance reason printed, so it is printed once
        self._warming: set[str] = set()  # models loading because the gateway asked (deliberate redundancy)
        self._unreachable_since: float | None = None  # when an outage began (claims and heartbeats both see it)
        self._outage_lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------

    def run(self, *, max_jobs: int | None = None, once: bool = False) -> int:
        """Loop until stopped; ``once`` makes one pass, ``max_jobs`` bounds jobs handled.

        Returns the number of jobs handled (completed, failed or lost).
        """
        handled = 0
        with self._signal_handlers(), self._heartbeats():
            try:
                while not self._stop.is_set():
                    handled += self.step()
                    if once or (max_jobs is not None and handled >= max_jobs):
                        break
            finally:
                self._finish_workers()
        self.state = LoopState.STOPPED
        return handled

    @property
    def waiting_for_work(self) -> bool:
        """In a claim's long-poll, holding no job: stopping now leaves nothing unfinished."""
        return self._waiting and not self.active_ids()

    def active_ids(self) -> list[object]:
        """The jobs this host is running now."""
        with self._room:
            return list(self._active)

    def request_stop(self) -> None:
        """Finish the current jobs (if any), then leave :meth:`run`."""
        self._stop.set()
        with self._room:
            self._room.notify_all()

    def step(self) -> int:
        """One ``can_work → claim → run → report`` pass; 1 if a job was handled (or, with
        several slots, started beside the loop), else 0."""
        self.state = LoopState.CAN_WORK
        if self._paused():
            self._stop.wait(self.pause_poll)
            return 0
        if not self._slot_free():
            return 0
        self.state = LoopState.CLAIM
        job = self._claim()
        if job is None:
            return 0
        if self.slots > 1 and job.get("kind") not in (AUDIT, RING_CHECK):
            self._handle_beside(job)
        else:
            self._handle(job)
        return 1

    def _slot_free(self) -> bool:
        """Whether a slot is free, waiting up to ``pause_poll`` for a running job to end."""
        with self._room:
            return (
                self._room.wait_for(
                    lambda: len(self._active) < self.slots or self._stop.is_set(), timeout=self.pause_poll
                )
                and len(self._active) < self.slots
            )

    def _handle_beside(self, job: dict) -> None:
        """Run a claimed job on a thread of its own, so the loop claims again while a slot is free."""
        record = JobRecord(job)
        with self._room:
            self._active[record.id] = record
        worker = threading.Thread(target=self._handle, args=(job, record), name=f"mahout-job-{record.id}", daemon=True)
        self._workers.add(worker)
        worker.start()

    def _finish_workers(self) -> None:
        """Wait for the jobs running beside the loop (leaving :meth:`run` finishes them), but not
        after a second signal: that one exits at once."""
        for worker in list(self._workers):
            while worker.is_alive() and self._signals < 2:
                worker.join(timeout=0.5)
        self._workers.clear()

    # -- can_work ----------------------------------------------------------------------

    def local_pause_reason(self) -> str | None:
        """Why this machine must not claim (pause flag, serving hours, owner activity), or ``None``."""
        return OwnerGuard(self.home, self.schedule, self.idle).reason()

    def pause_reason(self) -> str | None:
        """Why the host must not claim now (local reasons or the server's word), or ``None``."""
        return self.local_pause_reason() or ("paused by the server" if self._server_paused else None)

    def _paused(self) -> bool:
        """Check the pause reason, printing a line only when it changes."""
        reason = self.pause_reason()
        if reason != self._pause_reason:
            self.out(f"mahout: paused: {reason}" if reason else "mahout: resumed, claiming work")
            self._pause_reason = reason
            self.heartbeat()  # let the gateway know now, not at the next beat
        return reason is not None

    # -- claim -------------------------------------------------------------------------

    def _claim(self) -> dict | None:
        """Long-poll for a job; on an unreachable server wait ``error_backoff`` and return None."""
        problem = None
        try:
            self._waiting = True  # a signal now finds no job to finish (`_on_signal`)
            try:
                job = self.api.claim(fingerprint=self.fingerprint, wait=self.claim_wait)
            finally:
                self._waiting = False
            self._reachable()
            self._maintenance_said = ""
            return job
        except ServerUnavailable as exc:
            problem = str(exc)
        except HostApiError as exc:
            self._reachable()
            if exc.code == "host_maintenance":  # rested by the gateway: wait for the owner or an operator
                if exc.message != self._maintenance_said:
                    self.out(f"mahout: {exc.message}")
                    self._maintenance_said = exc.message
                self._stop.wait(MAINTENANCE_POLL_SECONDS)
                return None
            if exc.code == "too_many_claims":  # more long-polls than the gateway allows this host: one returns soon
                self._stop.wait(self.error_backoff)
                return None
            if (
                exc.code == "heartbeat_required"
            ):  # the gateway has not heard from us lately (or ever): say so, claim again
                self.heartbeat()
                return None
            if exc.code != "host_paused":
                raise
            # The server still has us paused (our resume has not reached it yet): tell it now.
            self.heartbeat()
            self._stop.wait(self.pause_poll)
            return None
        self._unreachable()
        self.out(f"mahout: server unavailable ({problem}); retrying in {self.error_backoff:.0f} s")
        self._stop.wait(self.error_backoff)
        return None

    def _unreachable(self) -> None:
        with self._outage_lock:
            if self._unreachable_since is None:
                self._unreachable_since = time.monotonic()

    def _reachable(self) -> None:
        """The gateway answered: after an outage, say so once."""
        with self._outage_lock:
            since, self._unreachable_since = self._unreachable_since, None
        if since is not None:
            self.out(
                f"mahout: reconnected: the gateway answers again (unreachable for {time.monotonic() - since:.0f} s)"
            )

    # -- run and report ----------------------------------------------------------------

    def _handle(self, job: dict, record: JobRecord | None = None) -> None:
        """Run a claimed job to a final state and report it (an audit: score it and report the verdict)."""
        if job.get("kind") == AUDIT:
            self._score(job)
            return
        if job.get("kind") == RING_CHECK:
            self._ring_check(job)
            return
        record = record or JobRecord(job)
        with self._room:
            self._active[record.id] = record
        self.out(f"mahout: claimed job {record.id} ({job.get('model')})")
        try:
            self.state = LoopState.RUN
            self._run(record)
            self.state = LoopState.REPORT
            self._report(record)
        finally:
            with self._room:
                self._active.pop(record.id, None)
                self._room.notify_all()
            self._workers.discard(threading.current_thread())

    def _score(self, audit: dict) -> None:
        """Read another host's answer under the model this host serves (`mahout.scoring`) and
        report the verdict; a model that cannot be loaded here declines it (another scorer is asked)."""
        model = str(audit.get("model"))
        self.out(f"mahout: scoring audit {audit.get('id')} ({model})")
        self.state = LoopState.RUN
        try:
            with self.models.acquire(model) as runner:
                verdict = audit_score(audit, runner)
        except Exception as exc:  # noqa: BLE001 - not loadable here: declined, never left hanging
            verdict = declined(f"could not load {model}: {type(exc).__name__}: {exc}")
        self.state = LoopState.REPORT
        try:
            answer = self.api.audit_verdict(audit.get("id"), dict(verdict))
        except (HostApiError, ServerUnavailable) as exc:
            self.out(f"mahout: could not report audit {audit.get('id')}: {exc}")
            return
        counts = f"{verdict.get('checked', 0)} tokens checked, {verdict.get('misses', 0)} missed"
        self.out(
            f"mahout: scored audit {audit.get('id')}: {verdict['verdict']} ({counts}; audit {answer.get('status')})"
        )

    def _ring_check(self, inquiry: dict) -> None:
        """Find which of a ring's hosts made its audit fail (`mahout.ring.checking`), with the
        model's file on this machine, and report it; a check it cannot run here is declined."""
        from mahout.catalog import ModelUnavailable
        from mahout.ring.checking import ring_check
        from mahout.ring.model import ring_model

        model = str(inquiry.get("model"))
        self.out(f"mahout: checking ring inquiry {inquiry.get('id')} ({model})")
        self.state = LoopState.RUN
        try:
            verdict = ring_check(inquiry, self.api, model_path=ring_model(model, self.home).path)
        except ModelUnavailable as exc:
            verdict = {"verdict": "declined", "reasons": [str(exc)[:900]]}
        self.state = LoopState.REPORT
        try:
            answer = self.api.ring_check_verdict(inquiry["id"], verdict)
        except (HostApiError, ServerUnavailable) as exc:
            self.out(f"mahout: could not report ring inquiry {inquiry.get('id')}: {exc}")
            return
        self.out(
            f"mahout: checked ring inquiry {inquiry.get('id')}: {verdict['verdict']} {verdict.get('blamed', '')} "
            f"(inquiry {answer.get('status')})"
        )

    def _run(self, record: JobRecord) -> None:
        """Get the job's model (loading it if cold) and run the job; sets the record's final state.
        Until its first token the gateway hears progress (loading, then prefill)."""
        model = str(record.job.get("model"))
        with contextlib.ExitStack() as stack:
            progress = stack.enter_context(ProgressReporter(self.api, record.id, interval=self.progress_interval))
            try:
                runner = stack.enter_context(self.models.acquire(model))
            except UnknownModel:
                record.advance(JobState.FAILED, f"model {model!r} is not loaded on this host")
                return
            except Exception as exc:  # noqa: BLE001 - a model that cannot be loaded fails this job only
                record.advance(JobState.FAILED, f"could not load {model}: {type(exc).__name__}: {exc}")
                return
            progress.stage = "prefill"
            problem = _kind_problem(record.job, runner)
            if problem:
                record.advance(JobState.FAILED, f"model {model!r} {problem}")
            elif record.job.get("kind") == EMBEDDINGS:
                record.advance(JobState.RUNNING)
                with self._gate(model, runner):
                    self._embed(record, cast(Embedder, runner))  # (_kind_problem found its embed)
            else:
                record.advance(JobState.RUNNING)
                with self._gate(model, runner):
                    self._generate(record, cast(Runner, runner), progress)  # (_kind_problem found its stream)
        if getattr(runner, "broken", False) and self.models.unload(model):  # (the last of its jobs to end unloads it)
            self.out(f"mahout: unloaded {model}: its runner failed; the next job loads it again")

    def _gate(self, model: str, runner: object) -> threading.BoundedSemaphore:
        """The model's runner's own bound on streams at once: its ``slots`` (1 for a runner that
        streams one job at a time, whatever the loop's slots); the same after a reload."""
        with self._room:
            gate = self._gates.get(model)
            if gate is None:
                gate = self._gates[model] = threading.BoundedSemaphore(max(1, int(getattr(runner, "slots", 1))))
            return gate

    def _embed(self, record: JobRecord, runner: Embedder) -> None:
        """Compute one vector per input; sets the record's final state."""
        texts = record.job.get("input")
        try:
            if not isinstance(texts, list) or not all(isinstance(text, str) for text in texts):
                raise ValueError("an embeddings job's input must be a list of strings")
            if hasattr(runner, "embed_job"):  # its vectors and count are this job's own, however many run beside it
                record.embeddings, record.prompt_tokens = runner.embed_job(texts)
            else:
                record.embeddings = runner.embed(texts)
                record.prompt_tokens = runner.prompt_tokens
        except Exception as exc:  # noqa: BLE001 - any runner error becomes a job failure
            record.cause = "request" if isinstance(exc, RequestRejected) else "host"
            record.advance(JobState.FAILED, f"{type(exc).__name__}: {exc}")
        else:
            record.finish_reason = "stop"
            record.advance(JobState.COMPLETED)

    def _generate(self, record: JobRecord, runner: Runner, progress: ProgressReporter) -> None:
        """Stream the runner's text to the server; sets the record's final state."""
        # where the job's ending (finish_reason, completion_tokens) is read: its own stream, or a one-at-a-time runner
        ended: Any = runner
        try:
            with (
                BatchPusher(self.api, record.id, self.flush_interval) as pusher,
                contextlib.closing(runner.stream(record.job)) as pieces,
            ):
                ended = pieces if hasattr(pieces, "finish_reason") else runner
                for piece in pieces:
                    if piece:
                        progress.stop()
                    pusher.add(piece)
                pusher.flush(finish_reason=getattr(ended, "finish_reason", ""))
        except (HostApiError, ServerUnavailable) as exc:
            record.advance(JobState.LOST, str(exc))
        except Exception as exc:  # noqa: BLE001 - any runner error becomes a job failure
            record.cause = "request" if isinstance(exc, RequestRejected) else "host"
            record.advance(JobState.FAILED, f"{type(exc).__name__}: {exc}")
        else:
            record.finish_reason, record.completion_tokens = ended.finish_reason, ended.completion_tokens
            record.prompt_tokens = getattr(ended, "prompt_count", 0)  # what this model was fed (logged)
            record.prompt_read = getattr(ended, "prompt_read", None)
            record.token_ids, record.seed = getattr(ended, "token_ids", None), getattr(ended, "seed", None)
            record.advance(JobState.COMPLETED)

    def _report(self, record: JobRecord) -> None:
        """Tell the server how the job ended; report errors are printed, not fatal."""
        try:
            if record.state is JobState.COMPLETED:
                self._report_completed(record)
            elif record.state is JobState.FAILED:
                self.api.fail(record.id, reason=record.detail, cause=record.cause)
                self.out(f"mahout: failed {record.id}: {record.detail}")
            else:
                self.out(f"mahout: stopped {record.id}: no longer ours ({record.detail})")
        except (HostApiError, ServerUnavailable) as exc:
            self.out(f"mahout: could not report {record.id}: {exc}")

    def _report_completed(self, record: JobRecord) -> None:
        if record.embeddings is not None:
            answer = self.api.complete_embeddings(record.id, embeddings=record.embeddings)
            seconds = time.monotonic() - record.started
            self.out(
                f"mahout: completed {record.id}: {len(record.embeddings)} vector(s), {record.prompt_tokens} tokens "
                f"in {seconds:.1f} s (earned {answer.get('earned_ucents')} ucents)"
            )
            return
        tokens, reason = record.completion_tokens, record.finish_reason
        answer = self.api.complete(
            record.id,
            finish_reason=reason,
            completion_tokens=tokens,
            tokens=None if record.token_ids is None else list(record.token_ids),
            seed=record.seed,
        )
        seconds = time.monotonic() - record.started
        earned = answer.get("earned_ucents")
        prompt = f" after a {record.prompt_tokens}-token prompt" if record.prompt_tokens else ""
        read = f", read {record.prompt_read} prompt tokens" if record.prompt_read is not None else ""
        self.out(
            f"mahout: completed {record.id}: {tokens} tokens{prompt} "
            f"in {seconds:.1f} s ({reason}, earned {earned} ucents{read})"
        )

    # -- heartbeats --------------------------------------------------------------------

    def catalog(self) -> dict:
        """The host's catalog as the heartbeat carries it (warm-first routing reads it)."""
        loaded = sorted(self.models.loaded())
        return {
            "installed": self.installed,
            "qualified": self.models.qualified,
            "loaded": loaded,
            "slots": self.slots,
            "active_jobs": len(self.active_ids()),
            "memory_budget_mb": int(self.models.budget_mb),
        }

    def heartbeat(self) -> None:
        """Send one heartbeat carrying the local pause state and the catalog.

        The answer's ``paused`` echoes ours; a ``paused: true`` answer to an unpaused
        heartbeat is the server pausing this host, honoured until it says otherwise.
        """
        paused_here = self.local_pause_reason() is not None
        catalog = self.catalog()
        try:
            answer = self.api.heartbeat(
                fingerprint=self.fingerprint,
                paused=paused_here,
                active_jobs=self.active_ids(),
                models_loaded=catalog["loaded"],
                version=__version__,
                catalog=catalog,
            )
        except (HostApiError, ServerUnavailable) as exc:
            if isinstance(exc, ServerUnavailable):
                self._unreachable()
            else:
                self._reachable()
            if isinstance(exc, HostApiError) and exc.code == "upgrade_required":  # it will not serve this version again
                self.out(f"mahout: {exc.message}")
                self.upgrade_required = exc.message
                self._stop.set()
                return
            self.out(f"mahout: heartbeat failed: {exc}")
            return
        self._reachable()
        if not paused_here:
            self._server_paused = bool(answer.get("paused"))
        self._answer_asks(answer)

    def _answer_asks(self, answer: dict) -> None:
        """Deliberate redundancy: the gateway asks an idle host to keep a latency-critical
        model loaded (``load``: loaded in the background, the next heartbeat reports it) and
        to let it go once enough other hosts have it (``unload``; never while it serves a job)."""
        for name in answer.get("unload") or []:
            if name in self.models.qualified and self.models.unload(name):
                self.out(f"mahout: unloaded {name}: the gateway no longer needs it kept warm here")
        for name in answer.get("load") or []:
            if name in self.models.qualified and name not in self.models.loaded() and name not in self._warming:
                self._warming.add(name)
                threading.Thread(target=self._warm, args=(name,), name=f"mahout-warm-{name}", daemon=True).start()

    def _warm(self, name: str) -> None:
        try:
            with self.models.acquire(name):
                self.out(
                    f"mahout: loaded {name}: the gateway asked this machine to keep it warm (deliberate redundancy)"
                )
        except Exception as exc:  # noqa: BLE001 - no room (busy models) or a broken file: the ask lapses, another host is asked
            self.out(f"mahout: could not load {name} to keep it warm: {exc}")
        finally:
            self._warming.discard(name)

    @contextlib.contextmanager
    def _heartbeats(self) -> Iterator[None]:
        """Send one heartbeat, then one every ``heartbeat_interval`` seconds from a daemon thread.
        The first is sent before the first claim: the gateway refuses a claim from a host it has
        not heard from (409 ``heartbeat_required``, a "Conflict" line on its terminal)."""
        done = threading.Event()
        self.heartbeat()

        def beat() -> None:
            while not done.wait(self.heartbeat_interval):
                self.heartbeat()

        thread = threading.Thread(target=beat, name="mahout-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join(timeout=1.0)

    # -- signals -----------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: object) -> None:
        """First signal: finish the current job then stop; waiting for work, with none to
        finish, exit now (code 0) rather than sit out the claim's long-poll (up to
        CLAIM_WAIT_SECONDS): the gateway drops a claim whose socket closed, and fails over a
        job it handed out as the host left. Second signal: exit now (code 1)."""
        self._signals += 1
        if self._signals > 1:
            self.out("mahout: second signal, exiting now")
            raise SystemExit(1)
        name = signal.Signals(signum).name
        self.request_stop()
        if self.waiting_for_work:
            self.out(f"mahout: {name} received while waiting for work, exiting")
            raise SystemExit(0)
        self.out(
            f"mahout: {name} received, finishing the current "
            f"job{'s' if len(self.active_ids()) > 1 else ''} then exiting"
        )

    @contextlib.contextmanager
    def _signal_handlers(self) -> Iterator[None]:
        """Install the SIGTERM/SIGINT handlers for the duration of :meth:`run` (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _kind_problem(job: dict, runner: object) -> str:
    """Why ``runner`` cannot do ``job`` (an embeddings job needs ``embed``, text jobs ``stream``), or ""."""
    if job.get("kind") == EMBEDDINGS:
        return "" if hasattr(runner, "embed") else "does not compute embeddings"
    return "" if hasattr(runner, "stream") else "does not generate text"
