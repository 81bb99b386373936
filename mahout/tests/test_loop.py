"""The host loop against a fake gateway over real HTTP, with a fake runner."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Generator
from pathlib import Path

import pytest

from mahout.api import HostApi, ServerUnavailable
from mahout.home import set_paused
from mahout.loop import HostLoop, JobRecord, JobState, LoopState

MODEL = "gemma-3-270m"


class FakeRunner:
    """Yields fixed pieces (optionally slowly), then raises ``error`` if given."""

    def __init__(self, pieces: list[str], delay: float = 0.0, error: Exception | None = None) -> None:
        self.pieces, self.delay, self.error = pieces, delay, error
        self.pulled = 0
        self.closed = False
        self.finish_reason = "stop"
        self.completion_tokens = 0

    def stream(self, job: dict) -> Generator[str, None, None]:
        try:
            for piece in self.pieces:
                time.sleep(self.delay)
                self.pulled += 1
                yield piece
            if self.error is not None:
                raise self.error
            self.finish_reason, self.completion_tokens = "length", len(self.pieces)
        finally:
            self.closed = True


def make_loop(api: HostApi, runner: FakeRunner, home: Path, lines: list[str]) -> HostLoop:
    return HostLoop(
        api,
        {MODEL: runner},
        fingerprint="f" * 64,
        home=home,
        claim_wait=0.2,
        heartbeat_interval=0.02,
        pause_poll=0.01,
        error_backoff=0.01,
        out=lines.append,
    )


def pieces(count: int) -> list[str]:
    return [f"w{i} " for i in range(count)]


class HostLoopTests:
    def test_it_streams_pieces_in_ordered_batches_and_completes(self, gateway, api, tmp_path):
        lines: list[str] = []
        runner = FakeRunner(pieces(20), delay=0.01)
        gateway.state.add_job("job-1")
        handled = make_loop(api, runner, tmp_path, lines).run(max_jobs=1)
        assert handled == 1
        assert gateway.state.text["job-1"] == "".join(pieces(20))
        seqs = [seq for _, seq, _, _ in gateway.state.pushes]
        assert seqs == list(range(len(seqs)))
        assert 1 < len(seqs) < 20  # batched, not one push per piece
        assert gateway.state.completions["job-1"]["completion_tokens"] == 20
        assert gateway.state.completions["job-1"]["finish_reason"] == "length"
        assert "mahout: claimed job job-1 (gemma-3-270m)" in lines
        assert any(line.startswith("mahout: completed job-1: 20 tokens in") for line in lines)

    def test_it_reports_the_sampled_token_ids_and_seed_for_audits(self, gateway, api, tmp_path):
        runner = FakeRunner(pieces(3))
        runner.token_ids, runner.seed = [7, 8, 9], 2**62 + 1  # type: ignore[attr-defined]
        gateway.state.add_job("job-1")
        make_loop(api, runner, tmp_path, []).run(max_jobs=1)
        assert gateway.state.completions["job-1"]["tokens"] == [7, 8, 9]
        assert gateway.state.completions["job-1"]["seed"] == 2**62 + 1

    def test_it_reports_progress_until_the_first_piece_and_not_after(self, gateway, api, tmp_path, monkeypatch):
        stages: list[str] = []
        heard = threading.Condition()
        send = api.progress

        def progress(job_id: object, *, stage: str) -> dict:
            answer = send(job_id, stage=stage)
            with heard:
                stages.append(stage)
                heard.notify_all()
            return answer

        monkeypatch.setattr(api, "progress", progress)
        after_first: dict[str, object] = {}

        class LongPrefill(FakeRunner):
            """No piece until the gateway has heard of the prefill twice; then the reporter must stop."""

            def stream(self, job: dict) -> Generator[str, None, None]:
                with heard:
                    after_first["prefill_heard"] = heard.wait_for(lambda: stages.count("prefill") >= 2, timeout=10)
                yield "w0 "
                reporters = [t for t in threading.enumerate() if t.name == "mahout-progress-job-1"]
                for reporter in reporters:
                    reporter.join(10)  # a report under way may land; none starts after the first piece
                after_first["reporting"] = any(reporter.is_alive() for reporter in reporters)
                after_first["reports"] = len(gateway.state.progress)
                yield from pieces(10)[1:]

        gateway.state.add_job("job-1")
        loop = make_loop(api, LongPrefill([]), tmp_path, [])
        loop.progress_interval = 0.05
        loop.run(max_jobs=1)
        assert gateway.state.text["job-1"] == "".join(pieces(10))
        assert after_first["prefill_heard"] is True and after_first["reporting"] is False
        assert len(gateway.state.progress) == after_first["reports"], "nothing after the first piece"
        assert stages[-1] == "prefill" and set(stages) <= {"loading", "prefill"}

    def test_a_job_that_starts_at_once_sends_no_progress(self, gateway, api, tmp_path):
        gateway.state.add_job("job-1")
        make_loop(api, FakeRunner(pieces(3)), tmp_path, []).run(max_jobs=1)
        assert "job-1" in gateway.state.completions and gateway.state.progress == []

    def test_it_resends_a_batch_under_the_same_seq_when_the_answer_is_lost(self, gateway, api, tmp_path):
        gateway.state.lose_push_answers = 1
        gateway.state.add_job("job-1")
        make_loop(api, FakeRunner(pieces(5)), tmp_path, []).run(max_jobs=1)
        first, retry = gateway.state.pushes[0], gateway.state.pushes[1]
        assert (first[1], first[3]) == (0, 503)
        assert (retry[1], retry[2], retry[3]) == (0, first[2], 200)
        assert gateway.state.text["job-1"] == "".join(pieces(5))  # the server deduped the resend
        assert "job-1" in gateway.state.completions

    def test_it_stops_generating_when_the_server_answers_409(self, gateway, api, tmp_path):
        lines: list[str] = []
        runner = FakeRunner(pieces(200), delay=0.005)
        gateway.state.cancel_after_batches["job-1"] = 1
        gateway.state.add_job("job-1")
        make_loop(api, runner, tmp_path, lines).run(max_jobs=1)
        assert gateway.state.pushes[-1][3] == 409
        assert runner.closed and runner.pulled < 200
        assert "job-1" not in gateway.state.completions and "job-1" not in gateway.state.failures
        assert any(line.startswith("mahout: stopped job-1: no longer ours") for line in lines)

    def test_it_does_not_claim_while_the_pause_flag_is_set(self, gateway, api, tmp_path):
        lines: list[str] = []
        gateway.state.add_job("job-1")
        loop = make_loop(api, FakeRunner(pieces(2)), tmp_path, lines)
        set_paused(tmp_path, True)
        assert loop.run(once=True) == 0
        assert gateway.state.claims == 0 and len(gateway.state.queue) == 1
        loop.heartbeat()
        assert gateway.state.heartbeats[-1]["paused"] is True
        set_paused(tmp_path, False)
        assert loop.run(once=True) == 1
        assert "job-1" in gateway.state.completions
        assert lines[:2] == ["mahout: paused: pause flag set", "mahout: resumed, claiming work"]

    def test_it_honours_a_pause_from_the_server(self, gateway, api, tmp_path):
        gateway.state.server_paused = True
        gateway.state.add_job("job-1")
        loop = make_loop(api, FakeRunner(pieces(2)), tmp_path, [])
        loop.heartbeat()
        assert loop.pause_reason() == "paused by the server"
        assert loop.step() == 0 and gateway.state.claims == 0

    def test_in_maintenance_it_says_why_once_waits_and_serves_again_when_resumed(
        self, gateway, api, tmp_path, monkeypatch
    ):
        import mahout.loop

        monkeypatch.setattr(mahout.loop, "MAINTENANCE_POLL_SECONDS", 0.01)
        lines: list[str] = []
        gateway.state.maintenance = "7 jobs dropped or failed in the last hour."
        gateway.state.add_job("job-1")
        loop = make_loop(api, FakeRunner(pieces(2)), tmp_path, lines)
        assert loop.step() == 0 and loop.step() == 0
        assert lines.count("mahout: This host is in maintenance: 7 jobs dropped or failed in the last hour.") == 1
        gateway.state.maintenance = ""
        assert loop.run(once=True) == 1 and "job-1" in gateway.state.completions

    def test_it_reports_active_jobs_and_models_in_heartbeats(self, gateway, api, tmp_path):
        gateway.state.add_job("job-1")
        make_loop(api, FakeRunner(pieces(10), delay=0.03), tmp_path, []).run(max_jobs=1)
        beats = gateway.state.heartbeats
        assert any(beat["active_jobs"] == ["job-1"] for beat in beats)
        assert beats[0]["models_loaded"] == [MODEL] and beats[0]["fingerprint"] == "f" * 64

    def test_it_finishes_the_current_job_on_first_sigterm(self, gateway, api, tmp_path):
        lines: list[str] = []
        gateway.state.add_job("job-1")
        gateway.state.add_job("job-2")

        def terminate_once_claimed() -> None:
            gateway.state.claimed.wait(5)
            time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=terminate_once_claimed, daemon=True).start()
        loop = make_loop(api, FakeRunner(pieces(10), delay=0.03), tmp_path, lines)
        assert loop.run(max_jobs=5) == 1
        assert gateway.state.text["job-1"] == "".join(pieces(10))
        assert "job-1" in gateway.state.completions
        assert [job["id"] for job in gateway.state.queue] == ["job-2"]
        assert "mahout: SIGTERM received, finishing the current job then exiting" in lines
        assert loop.state is LoopState.STOPPED

    def test_waiting_for_work_it_exits_at_once_on_the_first_signal(self, gateway, api, tmp_path):
        lines: list[str] = []
        loop = HostLoop(
            api,
            {MODEL: FakeRunner(pieces(2))},
            fingerprint="f" * 64,
            home=tmp_path,
            claim_wait=5.0,
            heartbeat_interval=0.05,
            out=lines.append,
        )

        def terminate_while_claiming() -> None:
            deadline = time.monotonic() + 5
            while gateway.state.claims == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.1)  # inside the claim's long-poll: the queue is empty
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=terminate_while_claiming, daemon=True).start()
        started = time.monotonic()
        with pytest.raises(SystemExit) as exit_info:
            loop.run()
        assert exit_info.value.code == 0 and time.monotonic() - started < 3, "it sat out the 5 s long-poll"
        assert "mahout: SIGTERM received while waiting for work, exiting" in lines
        gateway.state.add_job("job-1")  # nothing was taken on the way out
        assert [job["id"] for job in gateway.state.queue] == ["job-1"]

    def test_it_exits_at_once_on_a_second_signal(self, gateway, api, tmp_path):
        class TerminatedTwice(FakeRunner):
            """Signals itself while generating (the handlers run on this, the main, thread):
            SIGTERM before piece 2, again before piece 4."""

            def stream(self, job: dict) -> Generator[str, None, None]:
                try:
                    for index, piece in enumerate(self.pieces):
                        if index in (2, 4):
                            os.kill(os.getpid(), signal.SIGTERM)
                        self.pulled += 1
                        yield piece
                finally:
                    self.closed = True

        gateway.state.add_job("job-1")
        runner = TerminatedTwice(pieces(100))
        lines: list[str] = []
        with pytest.raises(SystemExit) as exit_info:
            make_loop(api, runner, tmp_path, lines).run(max_jobs=1)
        assert exit_info.value.code == 1 and "mahout: second signal, exiting now" in lines
        assert runner.pulled <= 5 and runner.closed, "it stopped within the piece that got the second signal"
        assert "job-1" not in gateway.state.completions

    def test_it_reports_a_runner_error_as_a_job_failure(self, gateway, api, tmp_path):
        gateway.state.add_job("job-1")
        error = ValueError("prompt is 5000 tokens; the context window is 4096 tokens")
        make_loop(api, FakeRunner(pieces(3), error=error), tmp_path, []).run(max_jobs=1)
        assert gateway.state.failures["job-1"] == f"ValueError: {error}"
        assert "job-1" not in gateway.state.completions
        assert gateway.state.causes["job-1"] == "host", "an error the runner cannot pin on the request is the host's"

    def test_it_reports_a_request_it_cannot_run_as_the_requests_fault(self, gateway, api, tmp_path):
        from mahout.runners import job_number
        from mahout.runners.llama import ContextOverflowError
        from scorer.errors import RequestRejected

        gateway.state.add_job("job-1")
        make_loop(api, FakeRunner([], error=ContextOverflowError("prompt is 5000 tokens")), tmp_path, []).run(
            max_jobs=1
        )
        assert gateway.state.causes["job-1"] == "request"
        for bad in (float("nan"), float("inf"), -0.5, 2.5, "warm"):
            with pytest.raises(RequestRejected):
                job_number({"temperature": bad}, "temperature", 1.0)
        assert (
            job_number({"temperature": None}, "temperature", 1.0) == 1.0
            and job_number({"top_p": 0.9}, "top_p", 1.0) == 0.9
        )

    def test_it_fails_a_job_for_a_model_it_does_not_serve(self, gateway, api, tmp_path):
        gateway.state.add_job("job-1", model="llama-70b")
        make_loop(api, FakeRunner(pieces(3)), tmp_path, []).run(max_jobs=1)
        assert gateway.state.failures["job-1"] == "model 'llama-70b' is not loaded on this host"

    def test_a_claim_refused_for_want_of_a_heartbeat_sends_one_and_claims_again(self, gateway, api, tmp_path):
        gateway.state.unheard = True
        gateway.state.add_job("job-1")
        loop = make_loop(api, FakeRunner(pieces(2)), tmp_path, [])
        beats = len(gateway.state.heartbeats)
        assert loop.run(max_jobs=1) == 1
        assert gateway.state.claims == 2 and len(gateway.state.heartbeats) > beats
        assert gateway.state.status["job-1"] == "completed"

    def test_it_returns_after_one_empty_claim_when_once(self, gateway, api, tmp_path):
        assert make_loop(api, FakeRunner([]), tmp_path, []).run(once=True) == 0
        assert gateway.state.claims == 1


class OutageApi:
    """The real client, but the gateway is unreachable for the first `claims` claims (its
    heartbeats fail meanwhile too), as after a router's restart."""

    def __init__(self, api: HostApi, claims: int) -> None:
        self.api, self.down = api, claims

    def claim(self, **kwargs: object) -> dict | None:
        if self.down:
            self.down -= 1
            raise ServerUnavailable("POST /claim failed after 5 attempts: ConnectError: [Errno 111] Connection refused")
        return self.api.claim(**kwargs)

    def heartbeat(self, **kwargs: object) -> dict:
        if self.down:
            raise ServerUnavailable(
                "POST /heartbeat failed after 5 attempts: ConnectError: [Errno 111] Connection refused"
            )
        return self.api.heartbeat(**kwargs)

    def __getattr__(self, name: str) -> object:
        return getattr(self.api, name)


class FirstHeartbeatTests:
    def test_the_first_claim_waits_for_the_first_heartbeat(self, gateway, api, tmp_path):
        """A claim from a host the gateway has not heard from is refused (409 heartbeat_required)."""
        calls: list[str] = []

        class Recording:
            def heartbeat(self, **kwargs: object) -> dict:
                time.sleep(0.2)  # a slow answer: the claim must not overtake it
                answer = api.heartbeat(**kwargs)
                calls.append("heartbeat")
                return answer

            def claim(self, **kwargs: object) -> dict | None:
                calls.append("claim")
                return api.claim(**kwargs)

            def __getattr__(self, name: str) -> object:
                return getattr(api, name)

        loop = make_loop(Recording(), FakeRunner([]), tmp_path, [])  # type: ignore[arg-type]
        loop.heartbeat_interval = 60.0
        loop.run(once=True)
        assert calls[:2] == ["heartbeat", "claim"], calls


class OutageTests:
    def test_it_says_reconnected_once_when_the_gateway_answers_again(self, gateway, api, tmp_path):
        lines: list[str] = []
        gateway.state.add_job("job-1")
        loop = make_loop(OutageApi(api, claims=3), FakeRunner(pieces(2)), tmp_path, lines)  # type: ignore[arg-type]
        assert loop.run(max_jobs=1) == 1
        reconnected = [index for index, line in enumerate(lines) if line.startswith("mahout: reconnected")]
        failed = [index for index, line in enumerate(lines) if "unavailable" in line or "heartbeat failed" in line]
        assert len(reconnected) == 1 and len(failed) >= 3 and reconnected[0] > max(failed), lines
        assert lines[reconnected[0]].startswith("mahout: reconnected: the gateway answers again (unreachable for ")
        assert lines[-1].startswith("mahout: completed job-1")

    def test_without_an_outage_it_says_nothing_of_reconnecting(self, gateway, api, tmp_path):
        lines: list[str] = []
        gateway.state.add_job("job-1")
        assert make_loop(api, FakeRunner(pieces(2)), tmp_path, lines).run(max_jobs=1) == 1
        assert not [line for line in lines if "reconnected" in line]


class JobRecordTests:
    def test_it_refuses_an_illegal_transition(self):
        record = JobRecord({"id": "job-1"})
        record.advance(JobState.RUNNING)
        record.advance(JobState.COMPLETED)
        with pytest.raises(RuntimeError, match="completed -> running"):
            record.advance(JobState.RUNNING)


class JobStream:
    """One job's stream from a runner serving several at once: its ending is its own."""

    def __init__(self, runner: SlotRunner, job: dict) -> None:
        self.runner, self.job = runner, job
        self.finish_reason, self.completion_tokens, self.token_ids, self.seed = "", 0, None, None
        self._pieces = iter(pieces(6))

    def __iter__(self) -> JobStream:
        return self

    def __next__(self) -> str:
        try:
            time.sleep(0.03)
            return next(self._pieces)
        except StopIteration:
            number = int(str(self.job["id"]).rsplit("-", 1)[1])
            self.finish_reason, self.completion_tokens, self.token_ids = "length", 6, [number] * 6
            raise

    def close(self) -> None:
        with self.runner.lock:
            self.runner.running -= 1


class SlotRunner:
    """Counts how many of its streams are open at once; ``slots`` None: a runner that
    streams one job at a time (it says no slots)."""

    def __init__(self, slots: int | None) -> None:
        if slots is not None:
            self.slots = slots
        self.lock = threading.Lock()
        self.running = self.most = 0
        self.finish_reason, self.completion_tokens = "stop", 0

    def stream(self, job: dict) -> JobStream:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        return JobStream(self, job)


def slots_loop(api: HostApi, runner: SlotRunner, home: Path, lines: list[str], slots: int) -> HostLoop:
    return HostLoop(
        api,
        {MODEL: runner},
        fingerprint="f" * 64,
        home=home,
        claim_wait=0.2,
        heartbeat_interval=0.02,
        pause_poll=0.01,
        error_backoff=0.01,
        out=lines.append,
        slots=slots,
    )


class SlotsTests:
    def test_a_host_with_slots_runs_that_many_jobs_at_once_each_reported_with_its_own_ending(
        self, gateway, api, tmp_path
    ):
        for number in range(1, 6):
            gateway.state.add_job(f"job-{number}")
        runner, lines = SlotRunner(slots=3), []
        loop = slots_loop(api, runner, tmp_path, lines, slots=3)
        assert loop.run(max_jobs=5) == 5
        assert runner.most == 3, "three streams at once, never more"
        for number in range(1, 6):
            assert gateway.state.text[f"job-{number}"] == "".join(pieces(6))
            done = gateway.state.completions[f"job-{number}"]
            assert (done["finish_reason"], done["completion_tokens"], done["tokens"]) == ("length", 6, [number] * 6)
        assert any(beat["catalog"]["slots"] == 3 and len(beat["active_jobs"]) == 3 for beat in gateway.state.heartbeats)
        assert runner.running == 0 and not loop.active_ids()

    def test_a_runner_that_streams_one_job_at_a_time_is_never_given_two(self, gateway, api, tmp_path):
        for number in range(1, 4):
            gateway.state.add_job(f"job-{number}")
        runner = SlotRunner(slots=None)
        assert slots_loop(api, runner, tmp_path, [], slots=2).run(max_jobs=3) == 3
        assert runner.most == 1
        assert sorted(gateway.state.completions) == ["job-1", "job-2", "job-3"]

    def test_on_sigterm_every_running_job_finishes_before_it_exits(self, gateway, api, tmp_path):
        for number in range(1, 5):
            gateway.state.add_job(f"job-{number}")
        lines: list[str] = []
        loop = slots_loop(api, SlotRunner(slots=2), tmp_path, lines, slots=2)

        def terminate_once_two_run() -> None:
            deadline = time.monotonic() + 5
            while len(loop.active_ids()) < 2 and time.monotonic() < deadline:
                time.sleep(0.005)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=terminate_once_two_run, daemon=True).start()
        handled = loop.run(max_jobs=10)
        assert handled >= 2 and len(gateway.state.completions) == handled, "every job it started finished"
        assert all(gateway.state.text[job] == "".join(pieces(6)) for job in gateway.state.completions)
        assert len(gateway.state.queue) == 4 - handled
        assert "mahout: SIGTERM received, finishing the current jobs then exiting" in lines

    def test_a_runner_whose_step_loop_failed_is_unloaded_and_the_next_job_loads_it_again(self, gateway, api, tmp_path):
        from mahout.loader import ModelLoader

        class Broken(SlotRunner):
            def stream(self, job: dict) -> JobStream:
                self.broken = True
                raise RuntimeError("llama_decode returned -3")

        made: list[SlotRunner] = []

        def load(name: str) -> SlotRunner:
            made.append(Broken(slots=2) if not made else SlotRunner(slots=2))
            return made[-1]

        models = ModelLoader(load, {MODEL: 10.0}, 100, out=lambda _line: None)
        for number in (1, 2):
            gateway.state.add_job(f"job-{number}")
        lines: list[str] = []
        loop = HostLoop(
            api,
            models,
            fingerprint="f" * 64,
            home=tmp_path,
            claim_wait=0.2,
            heartbeat_interval=0.02,
            pause_poll=0.01,
            error_backoff=0.01,
            out=lines.append,
            slots=1,
        )
        assert loop.run(max_jobs=2) == 2
        assert len(made) == 2 and "job-2" in gateway.state.completions and "job-1" not in gateway.state.completions
        assert f"mahout: unloaded {MODEL}: its runner failed; the next job loads it again" in lines
