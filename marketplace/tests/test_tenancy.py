"""Tenants cannot cross: a customer's request is not found with another customer's key, a
host's running job is refused to another host, a credential of the wrong kind is no
credential, and nothing answers without one. The same crossings run against a live gateway
in config/tests/test_schema_fuzz.py; the mesh's (rings, expert workers) in mesh/tests."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from django.test import Client

from conftest import Customer, ServingHost, make_customer
from marketplace.models import Job, Request
from marketplace.tests.test_services import claimed

pytestmark = pytest.mark.django_db(transaction=True)


@dataclass
class Crossing:
    owner: Customer
    other: Customer
    host: ServingHost
    other_host: ServingHost
    request: Request
    job: Job

    def secrets(self) -> dict[str, str | None]:
        return {
            "owner": self.owner.secret,
            "other customer": self.other.secret,
            "host": self.host.token,
            "other host": self.other_host.token,
            "anonymous": None,
        }


@pytest.fixture
def crossing(customer, serving_host, outsider, catalog) -> Crossing:
    """`customer`'s chat request, running on `serving_host`; `outsider` is another qualified host."""
    request, job = claimed(customer, serving_host, catalog)
    return Crossing(
        owner=customer, other=make_customer(), host=serving_host, other_host=outsider, request=request, job=job
    )


def call(method: str, path: str, secret: str | None, body: dict | None = None):
    auth = {"HTTP_AUTHORIZATION": f"Bearer {secret}"} if secret else {}
    if method == "GET":
        return Client().get(path, **auth)
    return Client().post(path, data=json.dumps(body or {}), content_type="application/json", **auth)


class CustomerTenancyTests:
    def test_it_shows_a_request_to_its_owner_only(self, crossing) -> None:
        public_id = crossing.request.public_id
        paths = {
            "generation": f"/v1/generation?id={public_id}",
            # the owner's own request is found: the offset asked for is past what was delivered
            "chat resume": f"/v1/chat/completions/{public_id}?stream=true&starting_after=999",
            "completion resume": f"/v1/completions/{public_id}?stream=true&starting_after=999",
        }
        answered = {
            who: {name: call("GET", path, secret).status_code for name, path in paths.items()}
            for who, secret in crossing.secrets().items()
        }
        assert answered == {
            "owner": {"generation": 200, "chat resume": 400, "completion resume": 400},
            "other customer": dict.fromkeys(paths, 404),
            "host": dict.fromkeys(paths, 401),
            "other host": dict.fromkeys(paths, 401),
            "anonymous": dict.fromkeys(paths, 401),
        }

    def test_another_customers_refusal_says_nothing_of_the_request(self, crossing) -> None:
        refused = call("GET", f"/v1/generation?id={crossing.request.public_id}", crossing.other.secret).json()
        unknown = call("GET", "/v1/generation?id=chatcmpl-nosuchrequest", crossing.other.secret).json()
        assert refused["error"]["code"] == unknown["error"]["code"] == "not_found"
        assert set(refused) == {"error"}

    def test_usage_pages_are_the_accounts_own(self, crossing) -> None:
        public_id = crossing.request.public_id
        assert [row["id"] for row in call("GET", "/v1/usage", crossing.owner.secret).json()["data"]] == [public_id]
        assert call("GET", "/v1/usage", crossing.other.secret).json()["data"] == []
        cursor = call("GET", f"/v1/usage?after={public_id}", crossing.other.secret)
        assert (cursor.status_code, cursor.json()["error"]["code"]) == (400, "invalid_cursor")


class HostTenancyTests:
    CALLS = {
        "tokens": {"seq": 0, "text": "stolen"},
        "progress": {"stage": "prefill"},
        "complete": {"finish_reason": "stop"},
        "fail": {"reason": "stolen"},
    }

    def test_a_running_job_is_refused_to_everyone_but_its_host(self, crossing) -> None:
        answered = {
            who: {
                name: call("POST", f"/hosts/api/jobs/{crossing.job.pk}/{name}", secret, body).status_code
                for name, body in self.CALLS.items()
            }
            for who, secret in crossing.secrets().items()
            if who != "host"
        }
        assert answered == {
            "other host": dict.fromkeys(self.CALLS, 403),
            "owner": dict.fromkeys(self.CALLS, 401),
            "other customer": dict.fromkeys(self.CALLS, 401),
            "anonymous": dict.fromkeys(self.CALLS, 401),
        }
        job = Job.objects.get(pk=crossing.job.pk)
        assert (job.status, job.next_seq, Request.objects.get(pk=crossing.request.pk).delivered_text) == (
            "running",
            0,
            "",
        )
        assert (
            call(
                "POST", f"/hosts/api/jobs/{crossing.job.pk}/tokens", crossing.host.token, self.CALLS["tokens"]
            ).status_code
            == 200
        )

    def test_another_hosts_job_and_no_job_are_refused_alike(self, crossing) -> None:
        """A host learns nothing from a job id: another's and one that does not exist get the same answer."""
        theirs = call("POST", f"/hosts/api/jobs/{crossing.job.pk}/progress", crossing.other_host.token).json()
        none = call("POST", f"/hosts/api/jobs/{crossing.job.pk + 1000}/progress", crossing.other_host.token).json()
        assert theirs == none and theirs["error"]["code"] == "not_your_job"


class KeyScopeTests:
    """A key reads its own requests only, unless it was made account-wide (issue 30): a capped
    key shipped inside a client must not list or resume what the account's other keys asked."""

    @pytest.fixture
    def keys(self, crossing) -> dict[str, str]:
        from accounts.services import api_key_create

        user = crossing.owner.user
        return {
            "maker": crossing.owner.secret,
            "capped sibling": api_key_create(user=user, name="client", spend_cap_ucents=1_000_000).secret,
            "account-wide": api_key_create(user=user, name="dashboard", account_wide=True).secret,
        }

    def test_only_the_maker_and_an_account_wide_key_find_the_request(self, crossing, keys) -> None:
        public_id = crossing.request.public_id
        paths = {
            "generation": f"/v1/generation?id={public_id}",
            "resume": f"/v1/chat/completions/{public_id}?stream=true&starting_after=999",
        }
        answered = {
            who: {name: call("GET", path, secret).status_code for name, path in paths.items()}
            for who, secret in keys.items()
        }
        assert answered == {
            "maker": {"generation": 200, "resume": 400},  # (found: the offset is past the text)
            "capped sibling": {"generation": 404, "resume": 404},
            "account-wide": {"generation": 200, "resume": 400},
        }
        said = call("GET", paths["generation"], keys["capped sibling"]).json()["error"]["message"]
        assert "its own requests" in said

    def test_usage_lists_a_keys_own_requests_unless_it_is_account_wide(self, crossing, keys) -> None:
        def listed(secret: str) -> set[str]:
            return {row["id"] for row in call("GET", "/v1/usage", secret).json()["data"]}

        def csv_ids(secret: str) -> set[str]:
            lines = b"".join(call("GET", "/v1/usage.csv", secret)).decode().splitlines()[1:]
            return {line.split(",")[0] for line in lines}

        mine = {crossing.request.public_id}
        assert listed(keys["maker"]) == csv_ids(keys["maker"]) == mine
        assert listed(keys["capped sibling"]) == csv_ids(keys["capped sibling"]) == set()
        assert listed(keys["account-wide"]) == csv_ids(keys["account-wide"]) == mine
        daily = call("GET", "/v1/usage", keys["capped sibling"]).json()["daily"]
        assert sum(day["requests"] for day in daily) == 0

    def test_a_new_key_reads_its_own_requests_and_the_page_says_so(self, crossing, keys) -> None:
        from accounts.models import ApiKey

        assert ApiKey.objects.get(name="client").account_wide is False
        client = Client()
        client.force_login(crossing.owner.user)
        page = client.get("/keys/").content.decode()
        assert "its own requests" in page and "every request of the account" in page
        client.post("/keys/", {"name": "wide", "account_wide": "on"})
        assert ApiKey.objects.get(name="wide").account_wide is True
