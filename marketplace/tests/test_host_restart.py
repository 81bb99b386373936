"""A restarted host's old jobs end at its new start (issue 33): mahout draws a boot id each time
its process starts and sends it with its heartbeats, its claims and its socket's handshake; the
gateway ends the host's attempts of an earlier boot at once (continued or requeued as for any
death), so they no longer fill its claim slots. Clients that send no boot id keep today's rules."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from catalog.models import CatalogModel
from conftest import ROOT, make_customer, make_host, stack_env, wait_until
from mahout.api import BOOT_ID
from mahout.presence import Presence
from marketplace import services
from marketplace.models import Job, Request
from marketplace.tests.test_services import submit
from testkit.personas import Customer, ServingHost, present
from testkit.requests import submit_request

FIRST_BOOT = "a-process-that-was-killed"


class BootSeenTests:
    pytestmark = pytest.mark.django_db

    def test_a_new_boot_ends_the_earlier_boots_attempts_and_only_those(
        self, customer, serving_host, catalog, settings
    ) -> None:
        settings.CONTINUATION_GRACE_SECONDS = 0
        request = submit(customer, catalog)
        job = services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint, boot=FIRST_BOOT)
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="Hel")
        assert services.host_boot_seen(host_id=serving_host.host.pk, boot=FIRST_BOOT) == 0, "the same process"
        assert services.host_boot_seen(host_id=serving_host.host.pk, boot="") == 0, "an older client says nothing"
        assert services.host_boot_seen(host_id=serving_host.host.pk, boot="its-next-start") == 1
        ended = Job.objects.get(pk=job.pk)
        assert (ended.status, ended.fail_reason) == ("failed", "its host restarted")
        request.refresh_from_db()
        assert request.resumed and Job.objects.filter(request=request, attempt=2, status="queued").exists()

    def test_attempts_claimed_without_a_boot_id_are_never_ended_by_one(self, customer, serving_host, catalog) -> None:
        submit(customer, catalog)
        job = services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
        assert services.host_boot_seen(host_id=serving_host.host.pk, boot="a-new-client") == 0
        assert Job.objects.get(pk=job.pk).status == "running"


def queued(customer: Customer, catalog: CatalogModel) -> Request:
    return submit_request(customer, catalog, stream=True, max_tokens=50, seed=1, prompt_tokens=5)


MAHOUT_PROCESS = """
import json, sys, time
from mahout.api import HostApi
api = HostApi(sys.argv[1], sys.argv[2], retries=0)
api.heartbeat(fingerprint=sys.argv[3], paused=False, active_jobs=[], models_loaded=[], version="0.7.0")
if sys.argv[4] == "claim":
    job = api.claim(fingerprint=sys.argv[3], wait=10)
    api.push_tokens(job["id"], seq=0, text="Hel")
    print(json.dumps(job["id"]), flush=True)
    time.sleep(600)
"""


def mahout_process(gateway_url: str, serving: ServingHost, act: str) -> subprocess.Popen:
    """A process speaking mahout's own HTTP client (`mahout.api.HostApi`), with its own boot id."""
    return subprocess.Popen(
        [sys.executable, "-c", MAHOUT_PROCESS, gateway_url, serving.token, serving.fingerprint, act],
        cwd=ROOT,
        env=stack_env(),
        stdout=subprocess.PIPE,
        text=True,
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.e2e
class RestartTests:
    def test_a_killed_http_host_restarted_ends_its_old_job_at_its_first_heartbeat(self, gateway, catalog) -> None:
        customer, serving = make_customer(), present(make_host(name="restarted"))
        request = queued(customer, catalog)
        first = mahout_process(gateway.url, serving, "claim")
        try:
            job_id = json.loads(first.stdout.readline())
        finally:
            first.kill()
            first.wait()
        assert Job.objects.get(pk=job_id).status == "running", "an HTTP-only host's death is not seen by itself"
        second = mahout_process(gateway.url, serving, "heartbeat")
        assert second.wait(timeout=60) == 0
        ended = Job.objects.get(pk=job_id)
        assert (ended.status, ended.fail_reason) == ("failed", "its host restarted")
        request.refresh_from_db()
        assert (request.status, request.resumed) == ("running", True)
        assert Job.objects.filter(request=request, attempt=2, status="queued").exists()

    def test_a_socket_handshake_with_a_new_boot_ends_the_earlier_boots_job(self, gateway, catalog) -> None:
        customer, serving = make_customer(), present(make_host(name="restarted-socket"))
        headers = {"Authorization": f"Bearer {serving.token}"}
        queued(customer, catalog)
        with httpx.Client(base_url=gateway.url, headers=headers, timeout=30) as http:
            claim = {"fingerprint": serving.fingerprint, "wait": 10, "boot": FIRST_BOOT}
            job_id = http.post("/hosts/api/claim", json=claim).json()["job"]["id"]
            assert Job.objects.get(pk=job_id).boot == FIRST_BOOT
            refused = http.post("/hosts/api/claim", json={**claim, "boot": "not a boot id!"})
            assert (refused.status_code, refused.json()["error"]["param"]) == (400, "boot")
        socket = Presence(gateway.url, serving.token, out=lambda line: None).start()  # this process's own boot id
        try:
            wait_until(socket.connected.is_set, timeout=20, what="the host socket to open")
            job = Job.objects.get(pk=job_id)
            assert (job.status, job.fail_reason) == ("failed", "its host restarted")
            assert Job.objects.filter(request=job.request, status="queued", requeue=1).exists(), (
                "requeued: it had sent nothing"
            )
        finally:
            socket.stop()
        assert BOOT_ID != FIRST_BOOT

    def test_a_claim_with_a_new_boot_ends_the_old_job_and_may_take_it_again(self, gateway, catalog) -> None:
        customer, serving = make_customer(), present(make_host(name="restarted-claim"))
        request = queued(customer, catalog)
        with httpx.Client(
            base_url=gateway.url, headers={"Authorization": f"Bearer {serving.token}"}, timeout=30
        ) as http:
            claim = {"fingerprint": serving.fingerprint, "wait": 10}
            old = http.post("/hosts/api/claim", json={**claim, "boot": FIRST_BOOT}).json()["job"]["id"]
            again = http.post(
                "/hosts/api/claim", json={**claim, "boot": "its-next-start"}
            )  # after the dead host's grace
            assert again.status_code == 200, again.text
        assert Job.objects.get(pk=old).fail_reason == "its host restarted"
        taken = Job.objects.get(pk=again.json()["job"]["id"])
        assert (taken.request_id, taken.requeue, taken.boot, taken.status) == (
            request.pk,
            1,
            "its-next-start",
            "running",
        )

    def test_a_malformed_boot_id_refuses_the_socket_at_its_handshake(self, gateway, catalog) -> None:
        from websockets.exceptions import InvalidStatus
        from websockets.sync.client import connect

        serving = make_host(name="bad-boot")
        url = gateway.url.replace("http://", "ws://") + "/hosts/ws"
        with (
            pytest.raises(InvalidStatus),
            connect(
                url,
                additional_headers={"Authorization": f"Bearer {serving.token}", "X-Mahout-Boot": "not a boot id!"},
                open_timeout=10,
            ),
        ):
            pass
        with connect(
            url,
            additional_headers={"Authorization": f"Bearer {serving.token}", "X-Mahout-Boot": "fine-1"},
            open_timeout=10,
        ):
            pass
