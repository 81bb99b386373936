"""A customer whose stream drops re-attaches from the last offset it saw and gets the rest
exactly once; nothing is billed twice."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from billing import selectors as ledger
from conftest import make_customer, make_host, wait_until
from marketplace.models import Request
from testkit.evidence import drawn
from testkit.personas import present

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]

BATCHES = ["Hello ", "there, ", "how are ", "you?"]


def events(response: httpx.Response) -> Iterator[str]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]


class StreamResumeTests:
    def test_a_dropped_stream_resumes_from_its_offset_exactly_once(self, gateway, catalog) -> None:
        customer, serving = make_customer(), present(make_host(name="resumer"))
        key = {"Authorization": f"Bearer {customer.secret}"}
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            host = {"Authorization": f"Bearer {serving.token}"}
            body = {
                "model": "gemma-3-270m",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 50,
                "stream": True,
            }
            received, offset = "", 0
            with http.stream("POST", "/v1/chat/completions", json=body, headers=key) as stream:
                lines = events(stream)
                public_id = json.loads(next(lines))["id"]
                job = http.post(
                    "/hosts/api/claim", json={"fingerprint": serving.fingerprint, "wait": 10}, headers=host
                ).json()["job"]["id"]
                for seq, text in enumerate(BATCHES[:2]):
                    http.post(
                        f"/hosts/api/jobs/{job}/tokens", json={"seq": seq, "text": text}, headers=host
                    ).raise_for_status()
                while received != "".join(BATCHES[:2]):
                    chunk = json.loads(next(lines))
                    received += chunk["choices"][0]["delta"].get("content", "")
                    offset = chunk["x_elephant"]["offset"]
            # the connection dropped; the host goes on and finishes
            for seq, text in enumerate(BATCHES[2:], start=2):
                http.post(
                    f"/hosts/api/jobs/{job}/tokens", json={"seq": seq, "text": text}, headers=host
                ).raise_for_status()
            http.post(
                f"/hosts/api/jobs/{job}/complete", json={"finish_reason": "stop", "tokens": drawn(job)}, headers=host
            ).raise_for_status()

            rest, done = "", False
            with http.stream(
                "GET", f"/v1/chat/completions/{public_id}?stream=true&starting_after={offset}", headers=key
            ) as resumed:
                assert resumed.status_code == 200
                for data in events(resumed):
                    if data == "[DONE]":
                        done = True
                        break
                    rest += json.loads(data)["choices"][0]["delta"].get("content", "")
            # the stream that handed everything over forgets the text as it closes
            wait_until(
                lambda: Request.objects.filter(public_id=public_id, output_forgotten=True).exists(),
                timeout=10,
                what="the handed-over text to be deleted",
            )
            again = http.get(f"/v1/chat/completions/{public_id}?stream=true&starting_after=0", headers=key)
            stranger = http.get(
                f"/v1/chat/completions/{public_id}?stream=true",
                headers={"Authorization": f"Bearer {make_customer().secret}"},
            )
        assert done and received + rest == "".join(BATCHES)
        assert (again.status_code, again.json()["error"]["code"]) == (410, "output_gone")
        assert stranger.status_code == 404
        row = Request.objects.get(public_id=public_id)
        assert row.status == "completed" and row.cost_ucents > 0
        assert ledger.reconcile_report() == []

    def test_a_whole_answer_is_forgotten_once_it_is_answered(self, gateway, catalog) -> None:
        """A non-streamed answer hands over like a stream: its text and parameters are deleted as
        soon as the body is made, not left for the watchdog's retention."""
        import threading

        customer, serving = make_customer(), present(make_host(name="whole"))
        key = {"Authorization": f"Bearer {customer.secret}"}
        body = {
            "model": "gemma-3-270m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 50,
            "stop": ["never said"],
        }
        answered: dict = {}
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            asking = threading.Thread(
                target=lambda: answered.update(response=http.post("/v1/chat/completions", json=body, headers=key))
            )
            asking.start()
            host = {"Authorization": f"Bearer {serving.token}"}
            job = http.post(
                "/hosts/api/claim", json={"fingerprint": serving.fingerprint, "wait": 10}, headers=host
            ).json()["job"]["id"]
            for seq, text in enumerate(BATCHES):
                http.post(
                    f"/hosts/api/jobs/{job}/tokens", json={"seq": seq, "text": text}, headers=host
                ).raise_for_status()
            http.post(
                f"/hosts/api/jobs/{job}/complete", json={"finish_reason": "stop", "tokens": drawn(job)}, headers=host
            ).raise_for_status()
            asking.join(timeout=30)
            response = answered["response"]
            assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == "".join(
                BATCHES
            )
            public_id = response.json()["id"]
            wait_until(
                lambda: Request.objects.filter(public_id=public_id, output_forgotten=True).exists(),
                timeout=10,
                what="the answered text to be deleted",
            )
            again = http.get(f"/v1/chat/completions/{public_id}?stream=true&starting_after=0", headers=key)
        assert (again.status_code, again.json()["error"]["code"]) == (410, "output_gone")
        assert "stop" not in Request.objects.get(public_id=public_id).params, "the customer's stop strings went too"
