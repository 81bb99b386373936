"""Batches that arrive together share one trip to the database, and each still gets the
answer it would have had alone; an offer to a host with many waiting long-polls wakes one."""

from __future__ import annotations

import asyncio

import pytest
from django.db import OperationalError, connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from conftest import make_host
from core.errors import DomainError
from hosts.models import Host
from marketplace import services
from marketplace.hostdoor import claiming, pushing
from marketplace.models import Job, Request
from marketplace.tests.test_services import claimed, submit

BATCH = " five words in a batch"


def roomy(serving, slots: int = 16):
    """A trusted host with room for many jobs at once (a new host runs one per slot, at most
    HOST_PROBATION_MAX_JOBS)."""
    Host.objects.filter(pk=serving.host.pk).update(slots=slots, trusted_at=timezone.now())
    serving.host.refresh_from_db()
    return serving


@pytest.mark.django_db
class PushManyTests:
    def test_each_batch_of_a_trip_gets_its_own_answer(self, customer, serving_host, outsider, catalog) -> None:
        roomy(serving_host)
        first, job_a = claimed(customer, serving_host, catalog)
        second, job_b = claimed(customer, serving_host, catalog)
        host = serving_host.host
        results = services.job_push_many(
            [
                services.Push(host=host, job_id=job_a.pk, seq=0, text="Hel"),
                services.Push(host=host, job_id=job_b.pk, seq=0, text="Wor"),
                services.Push(host=host, job_id=job_a.pk, seq=0, text="Hel"),  # a retry behind its original
                services.Push(host=host, job_id=job_a.pk, seq=1, text="lo"),
                services.Push(host=host, job_id=job_b.pk, seq=5, text="?"),  # from the future
                services.Push(host=outsider.host, job_id=job_b.pk, seq=1, text="!"),  # not its job
            ]
        )
        assert results[:4] == [
            services.PushResult(True, 1),
            services.PushResult(True, 1),
            services.PushResult(False, 1),
            services.PushResult(True, 2),
        ]
        assert isinstance(results[4], services.SequenceGap)
        assert isinstance(results[5], services.HostRefused) and results[5].code == "not_your_job"
        assert [Request.objects.get(pk=r.pk).delivered_text for r in (first, second)] == ["Hello", "Wor"]

    def test_an_empty_batch_advances_seq_but_is_not_progress(self, customer, serving_host, catalog) -> None:
        _, job = claimed(customer, serving_host, catalog)
        assert Job.objects.get(pk=job.pk).first_token_at is None
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="")
        assert Job.objects.get(pk=job.pk).first_token_at is None  # a host cannot look alive on empty batches
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=1, text="Hi")
        moved = Job.objects.get(pk=job.pk)
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=2, text="")
        after = Job.objects.get(pk=job.pk)
        assert (after.next_seq, after.last_token_at, after.first_token_at) == (
            3,
            moved.last_token_at,
            moved.first_token_at,
        )

    def test_a_trip_of_many_jobs_is_one_statement_on_postgresql_and_one_transaction_on_sqlite(
        self, customer, catalog
    ) -> None:
        serving = roomy(make_host(name="many"))
        jobs = [claimed(customer, serving, catalog)[1] for _ in range(10)]
        with CaptureQueriesContext(connection) as queries:
            results = services.job_push_many(
                [services.Push(host=serving.host, job_id=job.pk, seq=0, text=BATCH) for job in jobs]
            )
        assert results == [services.PushResult(True, 1)] * 10
        statements = [q["sql"] for q in queries if q["sql"] not in ("BEGIN", "COMMIT") and "SAVEPOINT" not in q["sql"]]
        assert len(statements) == (1 if connection.vendor == "postgresql" else 3 * 10)
        assert {Request.objects.get(pk=job.request_id).delivered_text for job in jobs} == {BATCH}


@pytest.mark.django_db(transaction=True)
class PushWriterTests:
    def test_batches_pushed_at_once_share_a_trip_and_keep_their_answers(self, customer, catalog, monkeypatch) -> None:
        serving = roomy(make_host(name="writer"))
        jobs = [claimed(customer, serving, catalog)[1] for _ in range(12)]
        trips: list[int] = []
        many = services.job_push_many

        def counted(pushes: list) -> list:
            trips.append(len(pushes))
            return many(pushes)

        monkeypatch.setattr(services, "job_push_many", counted)

        async def push_all() -> list:
            return await asyncio.gather(
                *(pushing.push_tokens(host=serving.host, job_id=job.pk, seq=0, text=BATCH) for job in jobs),
                pushing.push_tokens(host=serving.host, job_id=jobs[0].pk, seq=9, text="?"),
                return_exceptions=True,
            )

        results = asyncio.run(push_all())
        assert results[:12] == [services.PushResult(True, 1)] * 12
        assert isinstance(results[12], services.SequenceGap)  # one refusal does not spoil its trip
        assert sum(trips) == 13 and len(trips) <= 2  # the first goes alone at once, the rest wait for it together
        assert {Request.objects.get(pk=job.request_id).delivered_text for job in jobs} == {BATCH}

    def test_a_batch_the_database_cannot_take_fails_alone_and_its_trip_mates_are_applied(
        self, customer, catalog, monkeypatch
    ) -> None:
        """One host's bad batch must not fail every host's batches of its trip (a seq past any
        integer column fails the whole statement on PostgreSQL, the whole transaction on SQLite;
        the doors refuse it first, so it is sent here directly)."""
        honest, cheat = roomy(make_host(name="honest")), roomy(make_host(name="cheat"))
        jobs = [claimed(customer, honest, catalog)[1] for _ in range(3)]
        own = claimed(customer, cheat, catalog)[1]
        trips: list[int] = []
        many = services.job_push_many

        def counted(pushes: list) -> list:
            trips.append(len(pushes))
            return many(pushes)

        monkeypatch.setattr(services, "job_push_many", counted)

        async def push_all() -> list:
            return await asyncio.gather(
                pushing.push_tokens(host=honest.host, job_id=jobs[0].pk, seq=0, text=BATCH),
                pushing.push_tokens(host=cheat.host, job_id=own.pk, seq=2**63, text="x"),
                *(pushing.push_tokens(host=honest.host, job_id=job.pk, seq=0, text=BATCH) for job in jobs[1:]),
                return_exceptions=True,
            )

        results = asyncio.run(push_all())
        assert trips[0] == 4, "all four shared the first trip"
        assert results[0] == results[2] == results[3] == services.PushResult(True, 1)
        assert isinstance(results[1], DomainError) and (results[1].status, results[1].code) == (400, "batch_unstorable")
        assert {Request.objects.get(pk=job.request_id).delivered_text for job in jobs} == {BATCH}
        assert Job.objects.get(pk=own.pk).next_seq == 0

    def test_a_database_that_fails_everything_fails_the_whole_trip_once(self, customer, catalog, monkeypatch) -> None:
        """A lost connection is no batch's fault: the trip is not split in search of one."""
        serving = roomy(make_host(name="unlucky"))
        jobs = [claimed(customer, serving, catalog)[1] for _ in range(4)]
        trips: list[int] = []

        def down(pushes: list) -> list:
            trips.append(len(pushes))
            raise OperationalError("server closed the connection unexpectedly")

        monkeypatch.setattr(services, "job_push_many", down)

        async def push_all() -> list:
            return await asyncio.gather(
                *(pushing.push_tokens(host=serving.host, job_id=job.pk, seq=0, text=BATCH) for job in jobs),
                return_exceptions=True,
            )

        results = asyncio.run(push_all())
        assert trips == [4] and all(isinstance(result, OperationalError) for result in results)


@pytest.mark.django_db(transaction=True)
class OfferWakeUpTests:
    def test_an_offer_to_a_host_wakes_one_of_its_waiting_claims(self, customer, catalog, settings, monkeypatch) -> None:
        settings.ROUTING_OFFER_SECONDS = 30  # no rechecks while the test counts
        serving = make_host(name="slots")
        Host.objects.filter(pk=serving.host.pk).update(
            last_heartbeat_at=timezone.now(), slots=5, trusted_at=timezone.now()
        )  # online
        serving.host.refresh_from_db()
        looks: list[int] = []
        payload = services.job_claim_payload

        def counted(**kwargs: object) -> dict | None:
            found = payload(**kwargs)
            looks.append(0 if found is None else found["id"])
            return found

        monkeypatch.setattr(services, "job_claim_payload", counted)

        async def five_waiters_and_an_offer() -> tuple[list, list[int]]:
            waiters = [
                asyncio.ensure_future(
                    claiming.claim_when_offered(serving.host, fingerprint=serving.fingerprint, wait=3)
                )
                for _ in range(5)
            ]
            while len(looks) < 5:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)  # all five are asleep on the channel layer
            from core.db import db

            await db(submit, customer, catalog)  # routing offers it to this host, its only warm-or-unknown host
            await asyncio.sleep(1.0)
            seen = list(looks)
            return await asyncio.gather(*waiters), seen

        answers, seen = asyncio.run(five_waiters_and_an_offer())
        assert len([answer for answer in answers if answer is not None]) == 1
        assert seen[:5] == [0] * 5 and len(seen) == 6 and seen[5] > 0  # one claim answered the offer, and got it

    def test_other_wake_ups_wake_everyone(self) -> None:
        assert claiming._first_to_hear({"type": "job.queued", "offer": "7.0"}) is True
        assert claiming._first_to_hear({"type": "job.queued", "offer": "7.0"}) is False
        assert claiming._first_to_hear({"type": "job.queued", "offer": "7.1"}) is True  # the same job requeued
        assert claiming._first_to_hear({"type": "job.queued"}) is True
        assert claiming._first_to_hear({"type": "job.queued"}) is True
