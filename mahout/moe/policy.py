"""Load-adaptive, latency-aware dispatch: when a coordinator sends a routed expert to a remote worker.

The coordinator computes experts itself when it is quiet (the fastest path per token). A
background `LoadMonitor` probes the coordinator's own inference slots every
`probe_interval_s`; busy >= `saturation_threshold` (default 2) means *under load*. The
probe is time-bounded: if it does not answer within `probe_timeout_s` the monitor keeps the
last known state, and dispatch, which only ever reads the monitor's latest snapshot, never
waits on it.

Two steps decide each layer's call:

1. `dispatch_eligible`: may a worker be used at all (alive, not blamed, proven or in its
   first-try grace window, and the coordinator under load or recently so; see its
   docstring). A worker's `last_serve_ms` is the wall-clock time (epoch milliseconds) of the
   last expert batch it really computed for us; 0 means never, so `last_serve_ms > 0` is
   "proven".
2. `choose_workers`: of the eligible ones, which to engage for *this* call, weighed by time.

**Step 2 deliberately changes seed 004's Layer 1.** The seed says "a proven worker, under
load: dispatch", to favour aggregate throughput over per-token latency. That holds only if
a remote batch adds capacity. Here it does not: two volunteers behind NAT made the
coordinator 2.5 to 5 times slower than it is alone (bench/moe.py --netsim): each layer's
call waits for its remote batch, a 30-40 ms round trip through the gateway's expert relay,
while the coordinator's own experts for that call take a few ms. Passes are serialized
under the runner's model lock, so a waiting pass is time in which no request advances.
Being "under load" therefore does not make a slow worker worth its wait, and the seed's
own goal (throughput) is what the new rule serves.

The comparison, for one call with `N` routed experts, the coordinator's running cost per
expert `c` (at this call's size) and so `L = c * N` to compute everything here: remote
batches are sent first and the coordinator computes the rest *while they are in flight*,
then recomputes the sampled share of each remote answer (its check). Engaging a set `S` of
workers (worker `i` taking `n_i` experts, expected round trip `R_i`, check share `s_i`)
takes, expected,

    T(S) = max(L - c * sum(n_i), max(R_i)) + sum(s_i * c * n_i)

and `S` is engaged only when `T(S) < L`. So a worker's round trip is compared with the
local time of the *whole call*, not only of its own experts: the coordinator's work on the
rest hides it. A worker whose round trip plus its checks costs more than the call computed
here is not engaged, however proven and however loaded the coordinator. (If a coordinator
ever ran several passes at once, a wait could be filled with another pass's work and the
comparison would become CPU time saved; this one does not.)

Estimates are running averages (`Estimate`, weight `ESTIMATE_WEIGHT`) per size class (the
call's routed rows, rounded to a power of two): the coordinator's seconds per expert
computed here (its own experts, fallbacks and checks all count), and per worker the round
trip of its batches. A worker never measured is engaged (its first try is its measurement;
a worker given a fresh start after a failure is measured afresh). A skipped one is sent a
*shadow probe* every `latency_probe_s`, so its estimate stays fresh and a home link that got
faster is used again: a copy of rows whose experts the coordinator computes itself in that
call, sent on the side; the call never waits for it. Its answer, when it comes, is timed and
compared with the coordinator's own result: every probe is a full check (a mismatch blames
the worker; a match counts as a passed check, so a volunteer on probation still earns its
passes, only slower while it is not worth engaging). What the rule still costs: each
worker's first try, and a probe's packing and sending. Engaged batches are checked at the
worker's share as before; with `check_share` 1 a worker can never win (every batch is
computed twice) and serves probes only.

Local experts are timed with the coordinator's clock around their call. On a GPU that times
the kernels' launch more than their run (CUDA is asynchronous), so the local estimate is low
there and volunteers are engaged less, never more: the safe side.

`DispatchPolicy(latency_aware=False)` restores seed 004's rule as first written (every
eligible worker engaged); bench/moe.py measures both in one run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from mahout.link import Heartbeat

__all__ = [
    "DispatchPolicy",
    "Estimate",
    "LoadMonitor",
    "LoadState",
    "Offer",
    "WorkerState",
    "choose_workers",
    "dispatch_eligible",
    "size_class",
]

ESTIMATE_WEIGHT = 0.3  # a new measurement's weight in a running average


@dataclass(frozen=True)
class DispatchPolicy:
    saturation_threshold: int = 2  # busy slots at which the coordinator is under load
    idle_timeout_s: float = 30.0  # after load ends, proven workers stay engaged this long
    grace_s: float = 5.0  # a newly connected worker gets a first try within this window
    probe_interval_s: float = 2.0
    probe_timeout_s: float = 0.5
    dispatch_timeout_s: float = 5.0  # a remote batch slower than this is computed locally
    retry_dead_s: float = 30.0  # a failed worker still in the dispatch map is tried again after this
    # A share of remote batches is recomputed here and compared: a worker whose values differ
    # by more than float32's reordering (seen: 1e-4 relative) is blamed and never used again.
    check_share: float = 0.05
    check_rtol: float = 1e-3
    check_atol: float = 1e-3
    # Latency-aware dispatch (module docstring): engage a worker only while it saves time.
    latency_aware: bool = True  # False: seed 004's Layer 1 as first written (bench/moe.py compares both)
    latency_probe_s: float = 5.0  # a worker skipped as too slow is sent one batch this often, to measure it again


@dataclass(frozen=True)
class LoadState:
    """The monitor's latest snapshot (immutable: readers never see half an update)."""

    busy: int = 0
    under_load: bool = False
    last_load_at: float | None = None  # monotonic time the coordinator was last seen under load
    probed_at: float | None = None
    probe_timeouts: int = 0


def size_class(rows: int) -> int:
    """A call's size class: its routed rows rounded up to a power of two (1, 2, 3-4, 5-8, ...
    are classes 0, 1, 2, 3, ...). Times are compared within a class: a prefill's call is not
    a decode step's."""
    return max(rows - 1, 0).bit_length()


class Estimate:
    """A running average of a duration per size class; read from the nearest class measured
    (the larger on a tie: the costlier guess), or None when nothing was measured yet."""

    def __init__(self, weight: float = ESTIMATE_WEIGHT) -> None:
        self.weight = weight
        self._seconds: dict[int, float] = {}
        self._lock = threading.Lock()  # remote batches finish on the dispatch pool's threads

    def add(self, size: int, seconds: float) -> None:
        with self._lock:
            old = self._seconds.get(size)
            self._seconds[size] = seconds if old is None else old + self.weight * (seconds - old)

    def get(self, size: int) -> float | None:
        with self._lock:
            if not self._seconds:
                return None
            nearest = min(self._seconds, key=lambda known: (abs(known - size), -known))
            return self._seconds[nearest]


@dataclass
class WorkerState:
    """What the coordinator knows of one remote worker of its dispatch map."""

    key: str
    layer: int
    first: int
    count: int
    connected_at: float  # monotonic
    last_serve_ms: int = 0  # epoch ms of the last batch it computed; 0 = never served
    served: int = 0  # batches computed
    checks_passed: int = 0  # of those, recomputed here and found equal
    alive: bool = True
    died_at: float | None = None  # monotonic time it failed a batch
    blamed: str = ""  # why its answers are not trusted (a recomputed batch disagreed): never used again
    round_trip: Estimate = field(default_factory=Estimate)  # seconds for its batch, by size class
    sent_at: float | None = None  # monotonic time it was last sent a batch

    def holds(self, layer: int, expert: int) -> bool:
        return layer == self.layer and self.first <= expert < self.first + self.count

    @property
    def proven(self) -> bool:
        return self.last_serve_ms > 0


def dispatch_eligible(worker: WorkerState, *, now: float, load: LoadState, policy: DispatchPolicy) -> bool:
    """May the coordinator send experts to `worker` now?

    * a dead worker (its link broke, or it failed a batch) or a blamed one: never;
    * never served (connected but not proven): only within `grace_s` of connecting, its one
      first try; outside it, it is not recruited, under load least of all (it would replace
      the fast local path with a slow fallback);
    * proven, under load: yes, however long it has been idle (aggregate throughput first);
    * proven, quiet: only within `idle_timeout_s` of the last time the coordinator was
      under load; after that the coordinator serves locally and the worker ages out.
    """
    if not worker.alive or worker.blamed:
        return False
    if not worker.proven:
        return now - worker.connected_at < policy.grace_s
    if load.under_load:
        return True
    return load.last_load_at is not None and now - load.last_load_at < policy.idle_timeout_s


@dataclass(frozen=True)
class Offer:
    """An eligible worker as one call sees it."""

    key: str
    experts: tuple[int, ...]  # of this call's experts, those it holds
    round_trip: float | None  # expected seconds for its batch at this call's size; None: never measured
    check_share: float  # share of its answers recomputed here
    probe_due: bool = False  # skipped for longer than `latency_probe_s`: send it a shadow probe to measure it


def choose_workers(
    offers: Sequence[Offer],
    *,
    experts: int,
    per_expert: float | None,
) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """(engaged, probes): which workers take which of this call's `experts` (the rest are
    computed here), and which skipped workers are sent a copy of experts computed here.

    `per_expert`: the coordinator's expected seconds per expert computed here at this call's
    size (None: not measured yet, so nothing is worth engaging but a measurement). The
    measured offers are added fastest first while the expected call time `T(S)` (module
    docstring) falls; the best set is engaged only if it beats computing everything here.
    Offers never measured are engaged first (their first try: a replica of a faster worker is
    not crowded out, or it would never be proven). An expert two offers hold goes to the
    first engaged. A probe due is a shadow: the
    worker's experts that are computed here anyway, whose answer the call never waits for.
    """
    first_tries = {e: offer.key for offer in offers if offer.round_trip is None for e in offer.experts}
    taken: dict[int, str] = dict(first_tries)  # a replica's first try is not crowded out by a faster holder
    best: dict[int, str] = dict(first_tries)
    if per_expert is not None:
        best_time, slowest, checks = per_expert * (experts - len(first_tries)), 0.0, 0.0
        measured = sorted(((o.round_trip, o) for o in offers if o.round_trip is not None), key=lambda pair: pair[0])
        for round_trip, offer in measured:
            mine = [e for e in offer.experts if e not in taken]
            if not mine:
                continue
            taken.update(dict.fromkeys(mine, offer.key))
            slowest = max(slowest, round_trip)
            checks += offer.check_share * per_expert * len(mine)
            expected = max(per_expert * (experts - len(taken)), slowest) + checks
            if expected < best_time:
                best_time, best = expected, dict(taken)
    plan: dict[str, list[int]] = {}
    for expert, key in sorted(best.items()):
        plan.setdefault(key, []).append(expert)
    probes = {
        offer.key: here
        for offer in offers
        if offer.probe_due and offer.key not in plan
        if (here := [e for e in offer.experts if e not in best])
    }
    return plan, probes


class LoadMonitor:
    """Probes busy slots in the background; `state` is the latest `LoadState` snapshot.

    `probe()` returns the number of busy inference slots. Each probe runs on its own daemon
    thread and is waited for at most `probe_timeout_s`; a stuck probe is left to finish on
    its own (no second probe starts meanwhile) and counted in `probe_timeouts`.
    """

    def __init__(
        self, probe: Callable[[], int], policy: DispatchPolicy, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.probe = probe
        self.policy = policy
        self.clock = clock
        self.state = LoadState()
        self._stuck: threading.Thread | None = None
        self._heartbeat: Heartbeat | None = None

    def tick(self) -> LoadState:
        """Probe once (bounded) and publish the new state."""
        if self._stuck is not None and self._stuck.is_alive():
            self.state = replace(self.state, probe_timeouts=self.state.probe_timeouts + 1)
            return self.state
        answer: list[int] = []
        thread = threading.Thread(target=lambda: answer.append(int(self.probe())), name="moe-self-probe", daemon=True)
        thread.start()
        thread.join(self.policy.probe_timeout_s)
        if not answer:
            self._stuck = thread if thread.is_alive() else None
            self.state = replace(self.state, probe_timeouts=self.state.probe_timeouts + 1)
            return self.state
        self._stuck = None
        self.state = self.observe(answer[0])
        return self.state

    def observe(self, busy: int) -> LoadState:
        """The state after seeing `busy` slots now."""
        now = self.clock()
        under = busy >= self.policy.saturation_threshold
        last_load = now if under else self.state.last_load_at
        return replace(self.state, busy=busy, under_load=under, last_load_at=last_load, probed_at=now)

    def start(self) -> None:
        self._heartbeat = Heartbeat(self.tick, self.policy.probe_interval_s, name="moe-load-monitor").start()

    def stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop(timeout=self.policy.probe_interval_s + self.policy.probe_timeout_s + 1)
