"""The coordinator's expert dispatch: for each layer's routed experts, compute locally or
send them to remote expert workers, whichever `mahout.moe.policy` allows.

`Coordinator` is an `engine.moe.ExpertCompute`: the model calls it once per layer with the
rows each chosen expert must process. Experts held by an engaged worker are grouped into
one request per worker and sent concurrently while the rest are computed here. Which
eligible workers are engaged is weighed by time (`mahout.moe.policy.choose_workers`): the
coordinator times its own experts and each worker's round trips as it goes, and sends a
skipped worker a shadow probe now and then (a copy of experts it computes itself, never
waited for, its answer timed and checked). A worker
that breaks, times out or answers badly is marked dead and its experts are computed
locally in the same call, so a dying worker never corrupts an answer. The local result is
the reference: a remote worker runs the same float32 expert on the same rows. An answer with
a non-finite value is a failed batch; a random share of good-looking answers
(`DispatchPolicy.check_share`, or the worker's own `WorkerSpec.check_share`: the control plane
asks for more of a volunteer on probation) is recomputed here, and a worker whose values
disagree is blamed: its answer is replaced by the local one and it is never sent rows again.
The checks a worker passed are counted (`WorkerState.checks_passed`) and reported, which is
how a volunteer leaves probation.

Workers are reached through a `Transport` (a direct TCP link here; the relay provides
another), attached from the control plane's dispatch map (`sync`). A direct link passes the
handshake with the worker's own secret (the dispatch map carries it): rows go only to a
listener that proved it holds it, and an answer is read only up to the size of the rows sent.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from engine.moe import ExpertCompute
from mahout.link import FrameCaps, Link, LinkClosed, dial
from mahout.moe.policy import (
    DispatchPolicy,
    Estimate,
    LoadMonitor,
    Offer,
    WorkerState,
    choose_workers,
    dispatch_eligible,
    size_class,
)
from mahout.moe.worker import pack_rows, unpack_rows

logger = logging.getLogger(__name__)

__all__ = ["Coordinator", "DispatchStats", "TcpTransport", "Transport", "WorkerFailed", "WorkerSpec"]


class WorkerFailed(RuntimeError):
    """A remote worker could not compute a batch (broken link, timeout, error frame)."""


class Transport(Protocol):
    def request(self, header: dict, rows: torch.Tensor, timeout: float) -> tuple[dict, torch.Tensor | None]: ...

    def close(self) -> None: ...


ANSWER_HEADER_BYTES = 64 * 1024  # a result or error frame's header


class TcpTransport:
    """A direct framed TCP link to a worker (`mahout.link`), admitted with the worker's
    `secret`, opened on first use and kept open, one request at a time; a link that breaks
    is dropped and dialled again next time."""

    def __init__(self, address: tuple[str, int], secret: str, *, connect_timeout: float = 2.0) -> None:
        self.address = address
        self.secret = secret
        self.connect_timeout = connect_timeout
        self._link: Link | None = None
        self._lock = threading.Lock()

    def request(self, header: dict, rows: torch.Tensor, timeout: float) -> tuple[dict, torch.Tensor | None]:
        """Send one compute frame; the answer may be no larger than the rows sent."""
        with self._lock:
            try:
                if not self.secret:
                    raise LinkClosed("no secret for this worker in the dispatch map")
                if self._link is None:
                    self._link = dial(
                        self.address,
                        secret=self.secret,
                        hello={"role": "coordinator"},
                        caps=FrameCaps(ANSWER_HEADER_BYTES, 0),
                        timeout=self.connect_timeout,
                    )
                self._link.sock.settimeout(timeout)
                self._link.send(header, rows)
                return self._link.recv(FrameCaps(ANSWER_HEADER_BYTES, rows.nbytes))
            except (LinkClosed, OSError) as exc:
                self._drop()
                raise WorkerFailed(f"worker {self.address[0]}:{self.address[1]}: {exc}") from exc

    def _drop(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None

    def close(self) -> None:
        with self._lock:
            self._drop()


@dataclass(frozen=True)
class WorkerSpec:
    """One entry of the dispatch map: a worker's slice, how to reach it, and the secret its
    link is admitted with (through the relay as well: the sealed link runs end to end)."""

    key: str
    layer: int
    first: int
    count: int
    address: tuple[str, int] | None  # None: reachable only through the relay
    secret: str = field(default="", repr=False)
    check_share: float | None = None  # share of its batches to recompute; None: the policy's

    def same_worker(self, other: WorkerSpec) -> bool:
        """The same worker reached the same way (its check share may change: probation ends)."""
        return replace(self, check_share=other.check_share) == other

    @property
    def relay(self) -> bool:
        return self.address is None


def direct_transport(spec: WorkerSpec) -> Transport:
    if spec.address is None:
        raise WorkerFailed(f"worker {spec.key} is reachable only through a relay, and none is configured")
    return TcpTransport(spec.address, spec.secret)


@dataclass
class DispatchStats:
    local_experts: int = 0
    remote_experts: int = 0
    engaged_experts: int = (
        0  # of remote_experts, those sent to a worker already measured (its round trip won, not a first try)
    )
    fallbacks: int = 0  # expert batches recomputed locally after a worker failed
    checks: int = 0  # remote batches recomputed locally to check them (shadow probes included)
    probes: int = 0  # experts sent to a skipped worker as a shadow probe (computed here too; answer only compared)
    mismatches: int = 0  # checked batches whose values disagreed (their workers are blamed)
    first_remote_at: float | None = None  # monotonic time of the first successful remote batch


class Coordinator:
    def __init__(
        self,
        local: ExpertCompute,
        *,
        monitor: LoadMonitor,
        policy: DispatchPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_ms: Callable[[], int] = lambda: int(time.time() * 1000),
        transport_for: Callable[[WorkerSpec], Transport] | None = None,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self.local = local
        self.monitor = monitor
        self.policy = policy or monitor.policy
        self.clock = clock
        self.wall_ms = wall_ms
        self.transport_for = transport_for or direct_transport
        self.draw = draw
        self.workers: dict[str, WorkerState] = {}
        self.stats = DispatchStats()
        self.local_cost = Estimate()  # seconds per expert computed here, by size class
        self._transports: dict[str, Transport] = {}
        self._specs: dict[str, WorkerSpec] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="moe-dispatch")
        self._shadows: set[Future] = set()  # shadow probes in flight

    # --- the dispatch map -------------------------------------------------------------

    def attach(self, spec: WorkerSpec, transport: Transport | None = None) -> WorkerState:
        """Add a worker (a new one starts its grace window now). Re-attaching the same worker
        keeps its record; one that failed is given a fresh start only after `retry_dead_s`."""
        with self._lock:
            known = self.workers.get(spec.key)
            if known is not None and self._specs[spec.key].same_worker(spec):
                self._specs[spec.key] = spec
                if known.blamed:
                    return known
                if known.alive or known.died_at is None or self.clock() - known.died_at < self.policy.retry_dead_s:
                    return known
            state = WorkerState(spec.key, spec.layer, spec.first, spec.count, connected_at=self.clock())
            if known is not None:
                state.last_serve_ms, state.served, state.checks_passed = (
                    known.last_serve_ms,
                    known.served,
                    known.checks_passed,
                )
                self._transports.pop(spec.key).close()
            self.workers[spec.key] = state
            self._specs[spec.key] = spec
            self._transports[spec.key] = transport or self.transport_for(spec)
            return state

    def detach(self, key: str) -> None:
        with self._lock:
            self.workers.pop(key, None)
            self._specs.pop(key, None)
            transport = self._transports.pop(key, None)
        if transport is not None:
            transport.close()

    def sync(self, specs: Iterable[WorkerSpec]) -> None:
        """Make the dispatch map exactly `specs` (the control plane's view)."""
        wanted = {spec.key: spec for spec in specs}
        for key in set(self.workers) - set(wanted):
            self.detach(key)
        for spec in wanted.values():
            self.attach(spec)

    def eligible(self) -> list[WorkerState]:
        now, load = self.clock(), self.monitor.state
        return [w for w in list(self.workers.values()) if dispatch_eligible(w, now=now, load=load, policy=self.policy)]

    # --- ExpertCompute ----------------------------------------------------------------

    def plan(
        self, layer: int, experts: Iterable[int], *, size: int = 0
    ) -> tuple[dict[str | None, list[int]], dict[str, list[int]]]:
        """(plan, probes): which worker computes each expert (None: locally), and the shadow
        probes to send (experts computed here, also sent to a skipped worker to measure it).
        Latency-aware (the default): what `choose_workers` picks for a call of size class
        `size`; otherwise (seed 004's rule as first written) the least used eligible holder of
        each expert, and no probes."""
        experts, eligible = list(experts), self.eligible()
        if self.policy.latency_aware:
            chosen, probes = choose_workers(
                [self._offer(w, layer, experts, size) for w in eligible],
                experts=len(experts),
                per_expert=self.local_cost.get(size),
            )
            engaged: dict[str | None, list[int]] = dict(chosen.items())
            remote = {e for mine in chosen.values() for e in mine}
            local = [e for e in experts if e not in remote]
            return ({**engaged, None: local} if local else engaged), probes
        plan: dict[str | None, list[int]] = {}
        for expert in experts:
            holders = [w for w in eligible if w.holds(layer, expert)]
            key = min(holders, key=lambda w: w.served).key if holders else None
            plan.setdefault(key, []).append(expert)
        return plan, {}

    def _offer(self, worker: WorkerState, layer: int, experts: list[int], size: int) -> Offer:
        """An eligible worker as `choose_workers` weighs it for this call."""
        skipped = worker.sent_at is not None and self.clock() - worker.sent_at >= self.policy.latency_probe_s
        return Offer(
            worker.key,
            tuple(e for e in experts if worker.holds(layer, e)),
            worker.round_trip.get(size),
            self._check_share(worker.key),
            probe_due=skipped,
        )

    def __call__(self, layer: int, inputs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        size = size_class(sum(x.shape[0] for x in inputs.values()))
        plan, probes = self.plan(layer, sorted(inputs), size=size)
        sent: dict[str, Future] = {
            key: self._send(key, self._remote, key, layer, {e: inputs[e] for e in experts}, size)
            for key, experts in plan.items()
            if key is not None
        }
        local = plan.get(None, [])
        outputs = self._here(layer, {e: inputs[e] for e in local}, size) if local else {}
        self.stats.local_experts += len(local)
        for key, experts in probes.items():
            self._shadow(key, layer, {e: inputs[e] for e in experts}, {e: outputs[e] for e in experts}, size)
        for key, future in sent.items():
            experts = plan[key]
            try:
                remote = future.result()
            except WorkerFailed:
                outputs.update(self._here(layer, {e: inputs[e] for e in experts}, size))
                self.stats.fallbacks += 1
                self.stats.local_experts += len(experts)
                continue
            outputs.update(
                remote if self.draw() >= self._check_share(key) else self._checked(key, layer, inputs, remote, size)
            )
        return outputs

    def _send(self, key: str, work: Callable[..., object], *args: object) -> Future:
        """Run `work` for worker `key` on the dispatch pool; the worker counts as sent to from
        now (not probed again before `latency_probe_s`)."""
        state = self.workers.get(key)
        if state is not None:
            state.sent_at = self.clock()
        return self._pool.submit(work, *args)

    def _shadow(
        self, key: str, layer: int, inputs: dict[int, torch.Tensor], reference: dict[int, torch.Tensor], size: int
    ) -> None:
        """Send a skipped worker experts computed here, without anyone waiting for it."""
        future = self._send(key, self._probe, key, layer, inputs, reference, size)
        self._shadows.add(future)
        future.add_done_callback(self._shadows.discard)

    def _probe(
        self, key: str, layer: int, inputs: dict[int, torch.Tensor], reference: dict[int, torch.Tensor], size: int
    ) -> None:
        """A shadow probe: time the worker (`_remote` does) and check its answer against ours."""
        try:
            self._compare(key, layer, self._remote(key, layer, inputs, size, probe=True), reference)
        except WorkerFailed:
            pass  # `_remote` marked it dead: retried only after `retry_dead_s`, as for any failed batch

    def settle(self, timeout: float | None = None) -> None:
        """Wait for the shadow probes in flight (their measurements and checks)."""
        wait(list(self._shadows), timeout=timeout)

    def _here(self, layer: int, inputs: dict[int, torch.Tensor], size: int) -> dict[int, torch.Tensor]:
        """Compute experts locally, timing them: the cost a worker's round trip is weighed against."""
        started = self.clock()
        outputs = self.local(layer, inputs)
        self.local_cost.add(size, (self.clock() - started) / len(inputs))
        return outputs

    def _check_share(self, key: str) -> float:
        """The share of this worker's batches to recompute: its own (probation), else the policy's."""
        spec = self._specs.get(key)
        share = spec.check_share if spec is not None else None
        return self.policy.check_share if share is None else share

    def _checked(
        self, key: str, layer: int, inputs: dict[int, torch.Tensor], remote: dict[int, torch.Tensor], size: int
    ) -> dict[int, torch.Tensor]:
        """Recompute a remote batch here; on a disagreement blame its worker and keep ours."""
        return self._compare(key, layer, remote, self._here(layer, {e: inputs[e] for e in remote}, size))

    def _compare(
        self, key: str, layer: int, remote: dict[int, torch.Tensor], reference: dict[int, torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        """Check a remote answer against the local one: the remote if equal (a pass counted),
        else the local one, with the worker blamed."""
        with self._lock:
            self.stats.checks += 1
        rtol, atol = self.policy.check_rtol, self.policy.check_atol
        wrong = [e for e in sorted(remote) if not torch.allclose(remote[e], reference[e], rtol=rtol, atol=atol)]
        state = self.workers.get(key)
        if not wrong:
            if state is not None:
                with self._lock:
                    state.checks_passed += 1
            return remote
        gap = max(float((remote[e] - reference[e]).abs().max()) for e in wrong)
        with self._lock:
            self.stats.mismatches += 1
        if state is not None:
            state.blamed = f"layer {layer} experts {wrong}: values off by up to {gap:.3g}"
        logger.warning(
            "expert worker %s blamed: layer %s experts %s differ from the local recompute by up to %.3g",
            key,
            layer,
            wrong,
            gap,
        )
        return reference

    def _remote(
        self, key: str, layer: int, inputs: dict[int, torch.Tensor], size: int, *, probe: bool = False
    ) -> dict[int, torch.Tensor]:
        state, transport = self.workers.get(key), self._transports.get(key)
        if state is None or transport is None:
            raise WorkerFailed(f"worker {key} left the dispatch map")
        started = self.clock()
        experts, counts, rows = pack_rows(inputs)
        request_id = next(self._ids)
        header = {"type": "compute", "id": request_id, "layer": layer, "experts": experts, "counts": counts}
        try:  # the wire carries CPU tensors: a model on a GPU sends its rows from, and takes the answer to, the CPU
            answer, out = transport.request(header, rows.cpu(), self.policy.dispatch_timeout_s)
            if answer.get("type") != "result" or answer.get("id") != request_id or out is None:
                raise WorkerFailed(f"worker {key} answered {answer.get('type')}: {answer.get('message', '')}")
            outputs = unpack_rows(answer["experts"], answer["counts"], out.to(rows.device))
            if sorted(outputs) != experts or any(outputs[e].shape != inputs[e].shape for e in experts):
                raise WorkerFailed(f"worker {key} answered for other experts or shapes")
            if not all(bool(torch.isfinite(outputs[e]).all()) for e in experts):
                raise WorkerFailed(f"worker {key} answered non-finite values")
        except WorkerFailed:
            state.alive, state.died_at = False, self.clock()
            raise
        except (ValueError, KeyError) as exc:
            state.alive, state.died_at = False, self.clock()
            raise WorkerFailed(f"worker {key} sent a malformed answer: {exc}") from exc
        state.round_trip.add(size, self.clock() - started)
        with self._lock:  # batches to different workers finish on different threads
            state.last_serve_ms = self.wall_ms()
            first_try, state.served = state.served == 0, state.served + 1
            if probe:
                self.stats.probes += len(experts)
                return outputs
            self.stats.remote_experts += len(experts)
            if not first_try:
                self.stats.engaged_experts += len(experts)
            if self.stats.first_remote_at is None:
                self.stats.first_remote_at = self.clock()
        return outputs

    def close(self) -> None:
        for key in list(self.workers):
            self.detach(key)
        self._pool.shutdown(wait=False)
