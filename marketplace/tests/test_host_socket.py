"""The token batch's two doors, HTTP and the host's WebSocket, against a real daphne gateway:
the same batches give the same text and the same bill."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from catalog.models import CatalogModel
from conftest import make_customer, make_host, wait_until
from hosts.models import Host
from mahout.api import HostApiError, JobGoneError
from mahout.presence import Presence
from marketplace.models import Job, Request
from testkit.evidence import drawn
from testkit.personas import Customer, present
from testkit.requests import submit_request

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]

BATCHES = ["Hello", ", wor", "ld! ", "", "Good to see you."]


def queued(customer: Customer, catalog: CatalogModel) -> Request:
    return submit_request(customer, catalog, stream=True, max_tokens=50, seed=1, prompt_tokens=5)


def claimed(http: httpx.Client, fingerprint: str) -> int:
    answer = http.post("/hosts/api/claim", json={"fingerprint": fingerprint, "wait": 10})
    assert answer.status_code == 200, answer.text
    return answer.json()["job"]["id"]


class HostSocketTests:
    def test_http_and_the_socket_give_identical_text_and_billing(self, gateway, catalog) -> None:
        customer, serving = make_customer(), present(make_host(name="two-doors"))
        headers = {"Authorization": f"Bearer {serving.token}"}
        socket = Presence(gateway.url, serving.token, out=lambda line: None).start()
        try:
            wait_until(socket.connected.is_set, timeout=20, what="the host socket to open")
            with httpx.Client(base_url=gateway.url, headers=headers, timeout=30) as http:
                by_http = queued(customer, catalog)
                job = claimed(http, serving.fingerprint)
                for seq, text in enumerate(BATCHES):
                    assert http.post(f"/hosts/api/jobs/{job}/tokens", json={"seq": seq, "text": text}).json()[
                        "accepted"
                    ]
                assert http.post(f"/hosts/api/jobs/{job}/tokens", json={"seq": 1, "text": ", wor"}).json() == {
                    "accepted": False,
                    "next_seq": len(BATCHES),
                }
                http.post(
                    f"/hosts/api/jobs/{job}/complete", json={"finish_reason": "stop", "tokens": drawn(job)}
                ).raise_for_status()

                by_socket = queued(customer, catalog)
                job = claimed(http, serving.fingerprint)
                for seq, text in enumerate(BATCHES):
                    assert socket.push_tokens(job, seq=seq, text=text) == {"accepted": True, "next_seq": seq + 1}
                assert socket.push_tokens(job, seq=1, text=", wor") == {"accepted": False, "next_seq": len(BATCHES)}
                with pytest.raises(JobGoneError):  # the first job ended: its late batch is refused
                    socket.push_tokens(Job.objects.get(request=by_http).pk, seq=len(BATCHES), text="late")
                texts = [Request.objects.get(pk=row.pk).delivered_text for row in (by_http, by_socket)]
                http.post(
                    f"/hosts/api/jobs/{job}/complete", json={"finish_reason": "stop", "tokens": drawn(job)}
                ).raise_for_status()
        finally:
            socket.stop()
        assert texts == ["".join(BATCHES)] * 2
        rows = [Request.objects.get(pk=row.pk) for row in (by_http, by_socket)]
        assert [(r.status, r.completion_tokens, r.cost_ucents) for r in rows[1:]] == [
            (rows[0].status, rows[0].completion_tokens, rows[0].cost_ucents)
        ]
        assert rows[0].status == "completed" and rows[0].cost_ucents > 0
        earned = [Job.objects.get(request=r).earned_ucents for r in rows]
        assert earned[0] == earned[1] > 0

    def test_a_batch_from_the_future_and_a_stranger_are_refused_on_the_socket(self, gateway, catalog) -> None:
        customer, serving, stranger = (
            make_customer(),
            present(make_host(name="owner")),
            present(make_host(name="stranger", fingerprint="e" * 64)),
        )
        with httpx.Client(
            base_url=gateway.url, headers={"Authorization": f"Bearer {serving.token}"}, timeout=30
        ) as http:
            queued(customer, catalog)
            job = claimed(http, serving.fingerprint)
        sockets = [Presence(gateway.url, host.token, out=lambda line: None).start() for host in (serving, stranger)]
        try:
            for socket in sockets:
                wait_until(socket.connected.is_set, timeout=20, what="the host socket to open")
            with pytest.raises(JobGoneError, match="Expected batch 0, got 3"):
                sockets[0].push_tokens(job, seq=3, text="x")
            with pytest.raises(Exception, match="not yours") as refused:
                sockets[1].push_tokens(job, seq=0, text="x")
            assert refused.value.status == 403
        finally:
            for socket in sockets:
                socket.stop()


class SocketClaimTests:
    """Job offers on the host's socket: the claim long-poll as one frame."""

    def test_a_claim_on_the_socket_gets_the_job_then_its_batches_settle(self, gateway, catalog) -> None:
        customer, serving = make_customer(), present(make_host(name="socket-claims"))
        socket = Presence(gateway.url, serving.token, out=lambda line: None).start()
        try:
            wait_until(socket.connected.is_set, timeout=20, what="the host socket to open")
            assert (
                socket.claim(fingerprint=serving.fingerprint, wait=0.3) is None
            )  # nothing queued: null after the wait
            request = queued(customer, catalog)
            job = socket.claim(fingerprint=serving.fingerprint, wait=10)
            assert isinstance(job, dict) and job["id"] == Job.objects.get(request=request).pk
            assert customer.secret not in json.dumps(job)  # nothing about the customer travels
            for seq, text in enumerate(BATCHES):
                assert socket.push_tokens(job["id"], seq=seq, text=text)["accepted"]
            with httpx.Client(
                base_url=gateway.url, headers={"Authorization": f"Bearer {serving.token}"}, timeout=30
            ) as http:
                http.post(
                    f"/hosts/api/jobs/{job['id']}/complete", json={"finish_reason": "stop", "tokens": drawn(job["id"])}
                ).raise_for_status()
        finally:
            socket.stop()
        row = Request.objects.get(pk=request.pk)
        assert (row.status, row.delivered_text) == ("completed", "".join(BATCHES))

    def test_a_job_offered_while_the_claim_waits_arrives_at_once(self, gateway, catalog) -> None:
        customer, serving = make_customer(), present(make_host(name="socket-waits"))
        socket = Presence(gateway.url, serving.token, out=lambda line: None).start()
        answers: list = []
        try:
            wait_until(socket.connected.is_set, timeout=20, what="the host socket to open")
            waiter = threading.Thread(
                target=lambda: answers.append(socket.claim(fingerprint=serving.fingerprint, wait=20))
            )
            waiter.start()
            time.sleep(0.5)  # the claim is waiting on the gateway
            request = queued(customer, catalog)
            waiter.join(timeout=10)
            assert not waiter.is_alive(), "the offer did not reach the waiting claim"
        finally:
            socket.stop()
        assert answers[0]["id"] == Job.objects.get(request=request).pk

    def test_refusals_and_bad_frames_come_back_as_errors(self, gateway, catalog) -> None:
        serving = present(make_host(name="socket-refused"))
        socket = Presence(gateway.url, serving.token, out=lambda line: None).start()
        try:
            wait_until(socket.connected.is_set, timeout=20, what="the host socket to open")
            with pytest.raises(HostApiError) as unqualified:
                socket.claim(fingerprint="0" * 64, wait=1)
            assert (unqualified.value.status, unqualified.value.code) == (403, "not_qualified")
            with pytest.raises(HostApiError) as too_long:
                socket.claim(fingerprint=serving.fingerprint, wait=10_000)
            assert (too_long.value.status, too_long.value.code) == (400, "invalid_value")
            Host.objects.filter(pk=serving.host.pk).update(paused=True)  # paused since the socket opened
            with pytest.raises(HostApiError) as paused:
                socket.claim(fingerprint=serving.fingerprint, wait=1)
            assert paused.value.code == "host_paused"
        finally:
            socket.stop()
