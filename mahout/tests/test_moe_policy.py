"""The load-adaptive dispatch rules and the bounded self-probe."""

from __future__ import annotations

import threading
from dataclasses import replace

import torch

from mahout.moe.coordinator import Coordinator, WorkerSpec
from mahout.moe.policy import (
    DispatchPolicy,
    Estimate,
    LoadMonitor,
    LoadState,
    Offer,
    WorkerState,
    choose_workers,
    dispatch_eligible,
    size_class,
)

# check_share 0: these tests tell who computed a batch by its value (a worker's x * 3, the
# coordinator's own x * 2), which a random check would correct; ExpertCheckTests checks.
POLICY = DispatchPolicy(saturation_threshold=2, idle_timeout_s=30.0, grace_s=5.0, probe_timeout_s=0.2, check_share=0.0)
QUIET = LoadState(busy=0, under_load=False, last_load_at=None)


def _worker(*, connected_at: float = 0.0, last_serve_ms: int = 0, alive: bool = True) -> WorkerState:
    return WorkerState("w", 0, 0, 4, connected_at=connected_at, last_serve_ms=last_serve_ms, alive=alive)


def _under_load(at: float) -> LoadState:
    return LoadState(busy=2, under_load=True, last_load_at=at)


class SaturationTests:
    def test_it_is_under_load_at_the_threshold_and_not_below(self) -> None:
        monitor = LoadMonitor(lambda: 0, POLICY, clock=lambda: 10.0)
        assert monitor.observe(1).under_load is False
        assert monitor.observe(2).under_load is True
        assert monitor.observe(3).under_load is True

    def test_the_default_threshold_is_two(self) -> None:
        assert DispatchPolicy().saturation_threshold == 2

    def test_it_remembers_when_it_was_last_under_load(self) -> None:
        now = [10.0]
        monitor = LoadMonitor(lambda: 0, POLICY, clock=lambda: now[0])
        monitor.state = monitor.observe(2)
        now[0] = 20.0
        monitor.state = monitor.observe(0)
        assert monitor.state.last_load_at == 10.0 and not monitor.state.under_load


class DispatchEligibleTests:
    def test_under_load_a_proven_worker_is_used_past_the_idle_timeout(self) -> None:
        proven = _worker(last_serve_ms=1_700_000_000_000)
        assert dispatch_eligible(proven, now=1000.0, load=_under_load(1000.0), policy=POLICY)

    def test_quiet_a_proven_worker_ages_out_after_the_idle_timeout(self) -> None:
        proven = _worker(last_serve_ms=1_700_000_000_000)
        after_load = LoadState(busy=0, under_load=False, last_load_at=100.0)
        assert dispatch_eligible(proven, now=110.0, load=after_load, policy=POLICY)
        assert not dispatch_eligible(proven, now=131.0, load=after_load, policy=POLICY)
        assert not dispatch_eligible(proven, now=131.0, load=QUIET, policy=POLICY)

    def test_a_connected_but_never_served_worker_is_not_recruited_under_load(self) -> None:
        idle_phone = _worker(connected_at=0.0, last_serve_ms=0)
        assert not dispatch_eligible(idle_phone, now=60.0, load=_under_load(60.0), policy=POLICY)

    def test_a_new_worker_gets_a_first_try_within_the_grace_window(self) -> None:
        new = _worker(connected_at=100.0)
        assert dispatch_eligible(new, now=101.0, load=_under_load(101.0), policy=POLICY)
        assert dispatch_eligible(new, now=104.9, load=QUIET, policy=POLICY)
        assert not dispatch_eligible(new, now=105.1, load=_under_load(105.1), policy=POLICY)

    def test_a_dead_worker_is_never_used(self) -> None:
        dead = _worker(connected_at=100.0, last_serve_ms=5, alive=False)
        assert not dispatch_eligible(dead, now=101.0, load=_under_load(101.0), policy=POLICY)


class SelfProbeTests:
    def test_a_stuck_probe_does_not_block_and_keeps_the_last_state(self) -> None:
        release, finished = threading.Event(), threading.Event()
        answers = iter([3])

        def probe() -> int:
            value = next(answers, None)
            if value is None:
                release.wait(10)
                finished.set()
                return 0
            return value

        monitor = LoadMonitor(probe, POLICY)
        assert monitor.tick().under_load
        state = monitor.tick()  # this probe hangs
        assert not finished.is_set(), "the tick returned while its probe was still stuck"
        assert state.under_load and state.busy == 3 and state.probe_timeouts == 1
        assert monitor.tick().probe_timeouts == 2  # still stuck: no second probe piles up
        release.set()

    def test_dispatch_goes_on_while_the_probe_is_stuck(self) -> None:
        probing, release, finished = threading.Event(), threading.Event(), threading.Event()

        def probe() -> int:
            probing.set()
            release.wait(30)
            finished.set()
            return 0

        # A probe timeout longer than the test: anything that waited on the probe would
        # return only once the probe had finished.
        monitor = LoadMonitor(probe, DispatchPolicy(probe_interval_s=0.05, probe_timeout_s=30.0))
        monitor.start()
        coordinator = Coordinator(lambda layer, inputs: {e: x * 2 for e, x in inputs.items()}, monitor=monitor)
        try:
            assert probing.wait(10), "the monitor's first probe is under way"
            out = coordinator(0, {1: torch.ones(2, 3)})
            assert not finished.is_set(), "dispatch answered while the probe was still stuck"
            assert torch.equal(out[1], torch.full((2, 3), 2.0))
        finally:
            release.set()
            monitor.stop()
            coordinator.close()


class _Recorder:
    """A transport that computes x * 3 and records which worker was asked."""

    def __init__(self, calls: list[str], key: str) -> None:
        self.calls, self.key = calls, key

    def request(self, header: dict, rows: torch.Tensor, timeout: float) -> tuple[dict, torch.Tensor]:
        self.calls.append(self.key)
        return {
            "type": "result",
            "id": header["id"],
            "experts": header["experts"],
            "counts": header["counts"],
        }, rows * 3

    def close(self) -> None:
        pass


class CoordinatorPlanTests:
    def _coordinator(self, now: list[float], under_load: bool) -> tuple[Coordinator, list[str]]:
        monitor = LoadMonitor(lambda: 0, POLICY, clock=lambda: now[0])
        monitor.state = LoadState(
            busy=2 if under_load else 0, under_load=under_load, last_load_at=now[0] if under_load else None
        )
        coordinator = Coordinator(
            lambda layer, inputs: {e: x * 2 for e, x in inputs.items()},
            monitor=monitor,
            clock=lambda: now[0],
            wall_ms=lambda: 1234,
        )
        calls: list[str] = []
        for key, proven in (("proven", True), ("never", False)):
            state = coordinator.attach(WorkerSpec(key, 0, 0, 4, ("127.0.0.1", 1)), _Recorder(calls, key))
            state.last_serve_ms = 999 if proven else 0
        return coordinator, calls

    def test_under_load_it_sends_to_the_proven_worker_not_the_idle_one(self) -> None:
        now = [100.0]
        coordinator, calls = self._coordinator(now, under_load=True)
        now[0] = 200.0  # both connected long ago: past the grace window and the idle timeout
        coordinator.monitor.state = LoadState(busy=3, under_load=True, last_load_at=200.0)
        out = coordinator(0, {1: torch.ones(1, 2), 2: torch.ones(1, 2)})
        assert calls == ["proven"] and torch.equal(out[1], torch.full((1, 2), 3.0))
        assert coordinator.workers["proven"].last_serve_ms == 1234

    def test_quiet_it_computes_everything_locally(self) -> None:
        now = [100.0]
        coordinator, calls = self._coordinator(now, under_load=False)
        now[0] = 200.0
        out = coordinator(0, {1: torch.ones(1, 2)})
        assert calls == [] and torch.equal(out[1], torch.full((1, 2), 2.0))


class MoeImportTests:
    def test_the_host_side_never_imports_django(self) -> None:
        import subprocess
        import sys
        from pathlib import Path

        code = (
            "import sys, mahout.moe.policy, mahout.moe.coordinator, mahout.moe.worker, mahout.moe.runner, "
            "mahout.moe.control, mahout.moe.relay, mahout.moe.cli; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'rest_framework', 'channels')); "
            "assert not bad, bad"
        )
        root = Path(__file__).resolve().parents[2]
        result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr


class _Broken:
    def request(self, header: dict, rows: torch.Tensor, timeout: float) -> tuple[dict, torch.Tensor]:
        from mahout.moe.coordinator import WorkerFailed

        raise WorkerFailed("link broke")

    def close(self) -> None:
        pass


class DeadWorkerTests:
    def test_a_failed_worker_is_computed_locally_and_retried_only_after_the_retry_window(self) -> None:
        now = [100.0]
        monitor = LoadMonitor(lambda: 0, POLICY, clock=lambda: now[0])
        monitor.state = LoadState(busy=2, under_load=True, last_load_at=100.0)
        coordinator = Coordinator(
            lambda layer, inputs: {e: x * 2 for e, x in inputs.items()}, monitor=monitor, clock=lambda: now[0]
        )
        spec = WorkerSpec("w", 0, 0, 4, ("127.0.0.1", 1))
        coordinator.attach(spec, _Broken())
        out = coordinator(0, {1: torch.ones(1, 2)})
        assert torch.equal(out[1], torch.full((1, 2), 2.0)) and coordinator.stats.fallbacks == 1
        coordinator.sync([spec])  # still in the control plane's map: not retried at once
        assert not coordinator.workers["w"].alive
        now[0] += POLICY.retry_dead_s + 1
        coordinator.sync([spec])
        assert coordinator.workers["w"].alive
        coordinator.close()


class _Answers:
    """A worker's transport answering `answer(rows)`: an honest one, a poisoned one."""

    def __init__(self, answer) -> None:
        self.answer, self.calls = answer, 0

    def request(self, header: dict, rows: torch.Tensor, timeout: float) -> tuple[dict, torch.Tensor]:
        self.calls += 1
        return {
            "type": "result",
            "id": header["id"],
            "experts": header["experts"],
            "counts": header["counts"],
        }, self.answer(rows)

    def close(self) -> None:
        pass


class _Clock:
    """A fake monotonic clock: the test moves `now`, and a thread `spend`s time only on its own
    reading, so a remote batch in flight and the coordinator's own experts are timed apart as
    they would be in parallel. `advance` moves every thread to the new `now`."""

    def __init__(self, now: float) -> None:
        self.now = now
        self._spent: dict[int, float] = {}

    def __call__(self) -> float:
        return self.now + self._spent.get(threading.get_ident(), 0.0)

    def spend(self, seconds: float) -> None:
        ident = threading.get_ident()
        self._spent[ident] = self._spent.get(ident, 0.0) + seconds

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self._spent.clear()


def _timed_local(clock: _Clock, per_expert: float):  # type: ignore[no-untyped-def]
    """The coordinator's own experts (x * 2), taking `per_expert` fake seconds each."""

    def compute(layer: int, inputs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        clock.spend(per_expert * len(inputs))
        return {e: x * 2 for e, x in inputs.items()}

    return compute


class ExpertCheckTests:
    """Expert results are checked for values, not only shape (issue 29)."""

    def _coordinator(self, answer, *, draw: float) -> tuple[Coordinator, _Answers]:
        clock = _Clock(100.0)
        monitor = LoadMonitor(lambda: 0, POLICY, clock=clock)
        monitor.state = LoadState(busy=3, under_load=True, last_load_at=100.0)
        # Computing here takes 1 s an expert (fake), the worker's answer no time: it is always worth engaging.
        coordinator = Coordinator(
            _timed_local(clock, 1.0),
            monitor=monitor,
            policy=DispatchPolicy(check_share=0.05),
            clock=clock,
            draw=lambda: draw,
        )
        transport = _Answers(answer)
        coordinator.attach(WorkerSpec("w", 0, 0, 4, ("127.0.0.1", 1)), transport).last_serve_ms = 1
        return coordinator, transport

    def test_a_non_finite_answer_is_refused_and_computed_here(self) -> None:
        coordinator, _ = self._coordinator(lambda rows: torch.full_like(rows, float("nan")), draw=0.99)
        out = coordinator(0, {1: torch.ones(2, 3)})
        assert torch.equal(out[1], torch.full((2, 3), 2.0))
        assert coordinator.stats.fallbacks == 1 and not coordinator.workers["w"].alive

    def test_an_honest_worker_passes_its_checks(self) -> None:
        coordinator, transport = self._coordinator(lambda rows: rows * 2 * (1 + 1e-5), draw=0.0)
        for _ in range(3):
            assert torch.allclose(coordinator(0, {1: torch.ones(2, 3)})[1], torch.full((2, 3), 2.0), rtol=1e-4)
        assert coordinator.stats.checks == 3 and coordinator.stats.mismatches == 0
        assert transport.calls == 3 and not coordinator.workers["w"].blamed

    def test_a_poisoned_expert_is_caught_replaced_and_never_used_again(self) -> None:
        coordinator, transport = self._coordinator(lambda rows: rows * 2 + 0.5, draw=0.0)
        out = coordinator(0, {1: torch.ones(2, 3), 2: torch.ones(1, 3)})
        assert torch.equal(out[1], torch.full((2, 3), 2.0)) and torch.equal(out[2], torch.full((1, 3), 2.0))
        assert coordinator.stats.mismatches == 1
        assert "experts [1, 2]" in coordinator.workers["w"].blamed
        coordinator.attach(WorkerSpec("w", 0, 0, 4, ("127.0.0.1", 1)))  # the control plane's map still lists it
        coordinator(0, {1: torch.ones(2, 3)})
        assert transport.calls == 1, "a blamed worker was sent rows again"

    def test_unchecked_batches_are_the_sampled_share(self) -> None:
        coordinator, transport = self._coordinator(lambda rows: rows * 2 + 0.5, draw=0.5)
        out = coordinator(0, {1: torch.ones(2, 3)})
        assert torch.equal(out[1], torch.full((2, 3), 2.5)) and coordinator.stats.checks == 0

    def test_a_worker_on_probation_is_checked_at_its_own_share_and_its_passes_counted(self) -> None:
        coordinator, transport = self._coordinator(lambda rows: rows * 2, draw=0.5)  # above the policy's 5%
        coordinator.sync([WorkerSpec("w", 0, 0, 4, ("127.0.0.1", 1), check_share=0.6)])  # the control plane's probation
        assert coordinator._transports["w"] is transport, "a new share keeps the worker and its link"
        for _ in range(2):
            coordinator(0, {1: torch.ones(2, 3)})
        assert coordinator.stats.checks == 2 and coordinator.workers["w"].checks_passed == 2
        coordinator.sync([WorkerSpec("w", 0, 0, 4, ("127.0.0.1", 1))])  # probation over: the policy's share
        coordinator(0, {1: torch.ones(2, 3)})
        assert coordinator.stats.checks == 2 and coordinator.workers["w"].checks_passed == 2

    def test_a_poisoned_worker_on_probation_is_caught_on_its_first_checked_batch(self) -> None:
        coordinator, _ = self._coordinator(lambda rows: rows * 2 + 0.5, draw=0.5)
        coordinator.sync([WorkerSpec("w", 0, 0, 4, ("127.0.0.1", 1), check_share=1.0)])
        assert torch.equal(coordinator(0, {1: torch.ones(2, 3)})[1], torch.full((2, 3), 2.0))
        assert coordinator.workers["w"].blamed and coordinator.workers["w"].checks_passed == 0


class EstimateTests:
    def test_size_classes_are_powers_of_two(self) -> None:
        assert [size_class(rows) for rows in (1, 2, 3, 4, 5, 8, 9, 64)] == [0, 1, 2, 2, 3, 3, 4, 6]

    def test_a_running_average_read_from_the_nearest_class(self) -> None:
        estimate = Estimate(weight=0.5)
        assert estimate.get(3) is None
        estimate.add(2, 10.0)
        estimate.add(2, 20.0)
        assert estimate.get(2) == 15.0
        assert estimate.get(9) == 15.0  # nothing nearer
        estimate.add(4, 40.0)
        assert estimate.get(3) == 40.0  # a tie goes to the larger (costlier) class
        assert estimate.get(1) == 15.0


def _offer(
    key: str, experts: tuple[int, ...], round_trip: float | None, *, share: float = 0.0, probe: bool = False
) -> Offer:
    return Offer(key, experts, round_trip, share, probe_due=probe)


class ChooseWorkersTests:
    """The rule weighed in fake seconds: 4 experts in the call, 1 s each here, so 4 s alone."""

    def test_a_round_trip_hidden_behind_the_rest_of_the_call_is_worth_it(self) -> None:
        # 2 experts remote in 3 s while the other 2 take 2 s here: 3 s < 4 s, though 3 s > its own experts' 2 s.
        assert choose_workers([_offer("w", (0, 1), 3.0)], experts=4, per_expert=1.0) == ({"w": [0, 1]}, {})

    def test_a_round_trip_longer_than_the_whole_call_here_is_not(self) -> None:
        assert choose_workers([_offer("w", (0, 1), 4.5)], experts=4, per_expert=1.0) == ({}, {})
        assert choose_workers([_offer("w", (0, 1), 4.0)], experts=4, per_expert=1.0) == ({}, {})  # no gain: stay local

    def test_the_checks_a_worker_costs_count(self) -> None:
        assert choose_workers([_offer("w", (0, 1), 3.0, share=0.25)], experts=4, per_expert=1.0) == ({"w": [0, 1]}, {})
        assert choose_workers([_offer("w", (0, 1), 3.0, share=1.0)], experts=4, per_expert=1.0) == ({}, {})

    def test_fast_workers_are_engaged_and_a_slow_one_that_would_hold_them_up_is_not(self) -> None:
        offers = [_offer("slow", (2, 3), 3.5), _offer("fast", (0, 1), 0.5)]
        # fast alone: max(2, 0.5) = 2 s; with slow too: max(0, 3.5) = 3.5 s
        assert choose_workers(offers, experts=4, per_expert=1.0) == ({"fast": [0, 1]}, {})
        offers = [_offer("b", (2, 3), 1.0), _offer("a", (0, 1), 0.5)]
        assert choose_workers(offers, experts=4, per_expert=1.0) == ({"a": [0, 1], "b": [2, 3]}, {})

    def test_an_expert_two_workers_hold_goes_to_the_faster(self) -> None:
        offers = [_offer("replica", (0, 1), 1.0), _offer("quick", (0, 1), 0.5)]
        assert choose_workers(offers, experts=4, per_expert=1.0) == ({"quick": [0, 1]}, {})

    def test_a_worker_never_measured_is_engaged_and_a_skipped_one_due_is_probed_on_the_side(self) -> None:
        offers = [_offer("new", (0, 1), None), _offer("slow", (2, 3), 9.0, probe=True)]
        assert choose_workers(offers, experts=4, per_expert=1.0) == ({"new": [0, 1]}, {"slow": [2, 3]})

    def test_a_replicas_first_try_is_not_crowded_out_by_a_faster_holder(self) -> None:
        offers = [_offer("fast", (0, 1), 0.5), _offer("replica", (0, 1), None)]
        assert choose_workers(offers, experts=4, per_expert=1.0) == ({"replica": [0, 1]}, {})
        offers = [_offer("fast", (2, 3), 0.5), _offer("new", (0, 1), None)]
        assert choose_workers(offers, experts=4, per_expert=1.0) == ({"fast": [2, 3], "new": [0, 1]}, {})

    def test_a_probe_copies_only_experts_computed_here(self) -> None:
        offers = [_offer("fast", (0, 1), 0.5), _offer("slow", (0, 1, 2), 9.0, probe=True)]
        assert choose_workers(offers, experts=4, per_expert=1.0) == ({"fast": [0, 1]}, {"slow": [2]})
        offers = [_offer("fast", (0, 1), 0.5), _offer("replica", (0, 1), 9.0, probe=True)]
        assert choose_workers(offers, experts=4, per_expert=1.0) == ({"fast": [0, 1]}, {})  # nothing here to compare

    def test_before_the_coordinator_timed_itself_only_first_tries_are_sent(self) -> None:
        offers = [_offer("measured", (0, 1), 0.1), _offer("new", (2, 3), None)]
        assert choose_workers(offers, experts=4, per_expert=None) == ({"new": [2, 3]}, {})


class LatencyAwareCoordinatorTests:
    """A worker 50 ms away against experts that take 2 ms each here (fake clocks, no timing).
    Honest answers are equal to ours: who computed what is read from the stats and the link."""

    PER_EXPERT, ROUND_TRIP = 0.002, 0.05

    def _coordinator(self, *, latency_aware: bool = True, answer=lambda rows: rows * 2, share: float | None = None):  # type: ignore[no-untyped-def]
        clock = _Clock(100.0)
        policy = replace(POLICY, latency_aware=latency_aware, latency_probe_s=5.0)
        monitor = LoadMonitor(lambda: 0, policy, clock=clock)
        monitor.state = LoadState(busy=4, under_load=True, last_load_at=1e9)  # under load throughout
        coordinator = Coordinator(
            _timed_local(clock, self.PER_EXPERT), monitor=monitor, policy=policy, clock=clock, draw=lambda: 0.5
        )
        link = _Slow(clock, self.ROUND_TRIP, answer)
        coordinator.attach(WorkerSpec("w", 0, 0, 2, None, check_share=share), link)
        return coordinator, link, clock

    def _call(self, coordinator: Coordinator) -> dict[int, torch.Tensor]:
        out = coordinator(0, {e: torch.ones(2, 3) for e in range(4)})
        coordinator.settle(timeout=10)  # the shadow probe it sent, if any, has answered and been compared
        return out

    def test_a_slow_worker_is_measured_once_then_skipped_and_probed_on_the_side_every_so_often(self) -> None:
        coordinator, link, clock = self._coordinator()
        self._call(coordinator)  # its first try measures it
        assert link.calls == 1 and coordinator.workers["w"].proven
        for _ in range(5):
            self._call(coordinator)
        assert link.calls == 1 and coordinator.stats.remote_experts == 2
        clock.advance(6.0)
        out = self._call(coordinator)  # skipped for the probe interval: a shadow probe, the answer ours
        assert torch.equal(out[0], torch.full((2, 3), 2.0))
        self._call(coordinator)
        assert link.calls == 2 and coordinator.stats.probes == 2 and coordinator.stats.remote_experts == 2

    def test_only_batches_a_measured_worker_won_count_as_engaged(self) -> None:
        slow, _, clock = self._coordinator()  # measured by its first try, then only probed
        self._call(slow)
        clock.advance(6.0)
        self._call(slow)
        assert (slow.stats.remote_experts, slow.stats.engaged_experts, slow.stats.probes) == (2, 0, 2)
        engaged, _, _ = self._coordinator(latency_aware=False)  # seed 004's rule: every proven worker engaged
        for _ in range(3):
            self._call(engaged)
        assert (engaged.stats.remote_experts, engaged.stats.engaged_experts, engaged.stats.probes) == (6, 4, 0)

    def test_the_call_never_waits_for_a_shadow_probe(self) -> None:
        coordinator, link, clock = self._coordinator(answer=lambda rows: rows * 2)
        self._call(coordinator)
        clock.advance(6.0)
        link.hold = threading.Event()
        out = coordinator(0, {e: torch.ones(2, 3) for e in range(4)})  # its probe is stuck on the link
        assert torch.equal(out[0], torch.full((2, 3), 2.0))
        assert link.answered == 1, "the call waited for its probe's answer"
        link.hold.set()
        coordinator.settle(timeout=10)
        assert link.answered == 2 and coordinator.workers["w"].checks_passed == 1 and coordinator.stats.mismatches == 0

    def test_a_poisoned_skipped_worker_is_blamed_by_its_probe(self) -> None:
        coordinator, link, clock = self._coordinator(answer=lambda rows: rows * 2)
        self._call(coordinator)
        link.answer = lambda rows: rows * 2 + 0.5  # honest first, then cheating
        clock.advance(6.0)
        out = self._call(coordinator)
        assert torch.equal(out[0], torch.full((2, 3), 2.0)) and coordinator.stats.mismatches == 1
        assert coordinator.workers["w"].blamed
        clock.advance(6.0)
        self._call(coordinator)
        assert link.calls == 2, "a blamed worker was sent rows again"

    def test_a_probed_worker_whose_link_got_faster_is_engaged_again(self) -> None:
        coordinator, link, clock = self._coordinator()
        self._call(coordinator)
        link.round_trip = 0.001  # the home link got faster: below the 8 ms the call takes here
        probes = 0
        while coordinator.stats.remote_experts == 2:  # only its first try so far
            clock.advance(6.0)
            self._call(coordinator)  # a probe
            self._call(coordinator)  # engaged on its own merit, or not
            probes += 1
            assert probes < 10, "the estimate never caught up with the faster link"
        assert probes > 1, "one fast answer does not outweigh the slow history at once"

    def test_a_worker_given_a_fresh_start_after_a_failure_is_measured_afresh(self) -> None:
        coordinator, link, clock = self._coordinator()
        self._call(coordinator)  # measured slow
        clock.advance(6.0)
        link.broken = True
        out = self._call(coordinator)  # its probe fails: the worker is dead, the answer ours as always
        assert torch.equal(out[0], torch.full((2, 3), 2.0)) and not coordinator.workers["w"].alive
        clock.advance(POLICY.retry_dead_s + 1)
        link.broken = False
        coordinator.attach(WorkerSpec("w", 0, 0, 2, None), link)  # still in the control plane's map: a fresh start
        assert coordinator.workers["w"].alive and coordinator.workers["w"].proven
        self._call(coordinator)  # engaged at once, not probed after the interval: its old estimate is gone
        assert link.calls == 3 and coordinator.stats.remote_experts == 4

    def test_seed_004s_rule_as_first_written_engages_it_every_call(self) -> None:
        coordinator, link, _ = self._coordinator(latency_aware=False)
        for _ in range(4):
            self._call(coordinator)
        assert link.calls == 4 and coordinator.stats.remote_experts == 8

    def test_a_poisoned_worker_on_probation_is_caught_on_its_measuring_batch(self) -> None:
        coordinator, link, _ = self._coordinator(answer=lambda rows: rows * 2 + 0.5, share=1.0)
        out = self._call(coordinator)
        assert torch.equal(out[0], torch.full((2, 3), 2.0)) and coordinator.workers["w"].blamed

    def test_a_skipped_worker_on_probation_still_earns_its_passes_on_probes(self) -> None:
        coordinator, link, clock = self._coordinator(answer=lambda rows: rows * 2, share=0.6)
        for _ in range(3):
            self._call(coordinator)
            clock.advance(6.0)
        assert link.calls == 3 and coordinator.workers["w"].checks_passed == 3 and coordinator.stats.mismatches == 0


class _Slow:
    """A worker `round_trip` fake seconds away, answering `answer(rows)`."""

    def __init__(self, clock: _Clock, round_trip: float, answer) -> None:  # type: ignore[no-untyped-def]
        self.clock, self.round_trip, self.answer, self.calls, self.broken = clock, round_trip, answer, 0, False
        self.hold: threading.Event | None = None  # set: the answer waits for it
        self.answered = 0

    def request(self, header: dict, rows: torch.Tensor, timeout: float) -> tuple[dict, torch.Tensor]:
        from mahout.moe.coordinator import WorkerFailed

        self.calls += 1
        if self.hold is not None:
            self.hold.wait(10)
        if self.broken:
            raise WorkerFailed("link broke")
        self.clock.spend(self.round_trip)
        self.answered += 1
        return {
            "type": "result",
            "id": header["id"],
            "experts": header["experts"],
            "counts": header["counts"],
        }, self.answer(rows)

    def close(self) -> None:
        pass
