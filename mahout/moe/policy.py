"""Load-adaptive dispatch: when a coordinator sends a routed expert to a remote worker.

The coordinator computes experts itself when it is quiet (the fastest path per token). A
background `LoadMonitor` probes the coordinator's own inference slots every
`probe_interval_s`; busy >= `saturation_threshold` (default 2) means *under load*. The
probe is time-bounded: if it does not answer within `probe_timeout_s` the monitor keeps the
last known state, and dispatch, which only ever reads the monitor's latest snapshot, never
waits on it.

`dispatch_eligible` is the whole rule for one worker (see its docstring). A worker's
`last_serve_ms` is the wall-clock time (epoch milliseconds) of the last expert batch it
really computed for us; 0 means never, so `last_serve_ms > 0` is "proven".
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from mahout.link import Heartbeat

__all__ = ["DispatchPolicy", "LoadMonitor", "LoadState", "WorkerState", "dispatch_eligible"]


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


@dataclass(frozen=True)
class LoadState:
    """The monitor's latest snapshot (immutable: readers never see half an update)."""

    busy: int = 0
    under_load: bool = False
    last_load_at: float | None = None  # monotonic time the coordinator was last seen under load
    probed_at: float | None = None
    probe_timeouts: int = 0


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


class LoadMonitor:
    """Probes busy slots in the background; `state` is the latest `LoadState` snapshot.

    `probe()` returns the number of busy inference slots. Each probe runs on its own daemon
    thread and is waited for at most `probe_timeout_s`; a stuck probe is left to finish on
    its own (no second probe starts meanwhile) and counted in `probe_timeouts`.
    """

    def __init__(self, probe: Callable[[], int], policy: DispatchPolicy, *, clock: Callable[[], float] = time.monotonic) -> None:
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
