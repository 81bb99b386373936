"""HostApi: timeouts, bounded retries with backoff, typed 4xx errors."""

from __future__ import annotations

import json

import httpx
import pytest

from mahout.api import BOOT_ID, HostApi, HostApiError, JobGoneError, ServerUnavailable
from mahout.tests.fake_gateway import TOKEN


def scripted(answers: list, seen: list[httpx.Request]) -> httpx.MockTransport:
    """A transport that answers with ``answers`` in order (an exception is raised instead)."""

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    return httpx.MockTransport(handle)


def make_api(answers: list, seen: list, sleeps: list, **kwargs) -> HostApi:
    return HostApi("http://gw.test/", TOKEN, transport=scripted(answers, seen), sleep=sleeps.append, **kwargs)


class HostApiTests:
    def test_it_retries_a_503_then_returns_the_200_answer(self):
        seen, sleeps = [], []
        api = make_api([httpx.Response(503), httpx.Response(200, json={"status": "ok", "paused": False})], seen, sleeps)
        answer = api.heartbeat(fingerprint="f", paused=False, active_jobs=[], models_loaded=[], version="0")
        assert answer == {"status": "ok", "paused": False}
        assert len(seen) == 2 and len(sleeps) == 1 and 0.25 <= sleeps[0] <= 0.5

    def test_it_gives_up_after_a_bounded_number_of_retries_with_growing_waits(self):
        seen, sleeps = [], []
        api = make_api([httpx.Response(502)] * 10, seen, sleeps, retries=3, backoff=1.0, backoff_cap=3.0)
        with pytest.raises(ServerUnavailable, match="after 4 attempts: HTTP 502"):
            api.fail("job-1", reason="boom")
        assert len(seen) == 4
        assert [0.5 <= sleeps[0] <= 1.0, 1.0 <= sleeps[1] <= 2.0, 1.5 <= sleeps[2] <= 3.0] == [True] * 3

    def test_a_completion_carries_its_token_ids_and_seed_when_given(self):
        seen, sleeps = [], []
        api = make_api([httpx.Response(200, json={"earned_ucents": 7})] * 2, seen, sleeps)
        api.complete("job-1", finish_reason="stop", completion_tokens=3, tokens=[5, 6, 1], seed=42)
        api.complete("job-2", finish_reason="stop", completion_tokens=3)
        bodies = [json.loads(request.content) for request in seen]
        assert bodies[0] == {"finish_reason": "stop", "completion_tokens": 3, "tokens": [5, 6, 1], "seed": 42}
        assert bodies[1] == {"finish_reason": "stop", "completion_tokens": 3}

    def test_it_retries_connection_errors(self):
        seen, sleeps = [], []
        api = make_api([httpx.ConnectError("refused"), httpx.Response(200, json={"earned_ucents": 7})], seen, sleeps)
        assert api.complete("job-1", finish_reason="stop", completion_tokens=3) == {"earned_ucents": 7}
        assert len(seen) == 2

    def test_it_resends_the_same_token_batch_on_retry(self):
        seen, sleeps = [], []
        api = make_api(
            [httpx.Response(500), httpx.Response(200, json={"accepted": False, "next_seq": 4})], seen, sleeps
        )
        assert api.push_tokens("job-1", seq=3, text="ab") == {"accepted": False, "next_seq": 4}
        assert seen[0].content == seen[1].content == b'{"seq":3,"text":"ab"}'
        assert seen[0].url.path == "/hosts/api/jobs/job-1/tokens"

    def test_it_raises_the_servers_error_on_4xx_without_retrying(self):
        seen, sleeps = [], []
        error = {"error": {"message": "not qualified", "type": "permission_error", "code": "not_qualified"}}
        api = make_api([httpx.Response(403, json=error)], seen, sleeps)
        with pytest.raises(HostApiError) as info:
            api.claim(fingerprint="f", wait=1)
        assert (info.value.status, info.value.message, info.value.type, info.value.code) == (
            403,
            "not qualified",
            "permission_error",
            "not_qualified",
        )
        assert len(seen) == 1 and sleeps == []

    def test_it_raises_job_gone_on_409(self):
        api = make_api([httpx.Response(409, json={"error": {"message": "cancelled"}})], [], [])
        with pytest.raises(JobGoneError, match="HTTP 409: cancelled"):
            api.push_tokens("job-1", seq=0, text="x")

    def test_it_sets_a_timeout_on_every_call_and_a_longer_one_for_claims(self):
        seen = []
        api = make_api([httpx.Response(200, json={}), httpx.Response(204)], seen, [], timeout=7.0)
        api.me()
        assert api.claim(fingerprint="f", wait=20) is None
        assert seen[0].extensions["timeout"]["read"] == 7.0
        assert seen[0].extensions["timeout"]["connect"] == 5.0
        assert seen[1].extensions["timeout"]["read"] == 30.0

    def test_it_sends_the_host_token(self):
        seen = []
        make_api([httpx.Response(200, json={"total": 1})], seen, []).earnings()
        assert seen[0].headers["Authorization"] == f"Bearer {TOKEN}"

    def test_its_heartbeats_and_claims_carry_this_process_boot_id(self):
        seen = []
        api = make_api([httpx.Response(200, json={}), httpx.Response(204)], seen, [])
        api.heartbeat(fingerprint="f", paused=False, active_jobs=[], models_loaded=[], version="0")
        api.claim(fingerprint="f", wait=1)
        assert [json.loads(request.content)["boot"] for request in seen] == [BOOT_ID, BOOT_ID]
        assert len(BOOT_ID) == 16 and BOOT_ID.isalnum()

    def test_it_returns_a_claimed_job(self, api, gateway):
        gateway.state.add_job("job-9")
        job = api.claim(fingerprint="f", wait=1)
        assert job["id"] == "job-9" and job["kind"] == "chat"
        assert gateway.state.status["job-9"] == "running"
