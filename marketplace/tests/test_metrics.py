"""The operator's metrics: Prometheus' text format, read from the database at scrape time,
so any process answers for all of them; only the metrics token or staff may read them."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from conftest import make_customer
from marketplace import services
from marketplace.models import Job, Request
from marketplace.tests.test_reputation import claim, online
from marketplace.tests.test_services import submit
from testkit.evidence import drawn

pytestmark = pytest.mark.django_db


def scrape(client: Client, **headers: str) -> dict[str, float]:
    """Every sample, as "name{label=value,...}" (labels sorted) -> value."""
    response = client.get("/metrics", **headers)
    assert response.status_code == 200 and response["Content-Type"].startswith("text/plain")
    return {
        sample.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())) + "}": sample.value
        for family in text_string_to_metric_families(response.content.decode())
        for sample in family.samples
    }


def test_only_the_metrics_token_or_staff_may_read_them(settings, db) -> None:
    settings.METRICS_TOKEN = "m-secret"
    assert Client().get("/metrics").status_code == 401
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer m-secret").status_code == 200
    customer = get_user_model().objects.create_user(username="c@example.com", password="x" * 12)
    client = Client()
    client.force_login(customer)
    assert client.get("/metrics").status_code == 401
    staff = get_user_model().objects.create_user(username="ops@example.com", password="x" * 12, is_staff=True)
    client.force_login(staff)
    assert client.get("/metrics").status_code == 200


def test_they_count_what_happened(settings, serving_host, catalog) -> None:
    settings.METRICS_TOKEN = "m-secret"
    online(serving_host)
    served = submit(make_customer(), catalog)
    job = claim(serving_host)
    Job.objects.filter(pk=job.pk).update(claimed_at=served.created_at + timedelta(milliseconds=300))
    services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text=" Hello there, friend")
    Job.objects.filter(pk=job.pk).update(first_token_at=served.created_at + timedelta(seconds=2))
    services.job_complete(host=serving_host.host, job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk))
    submit(make_customer(), catalog)  # still queued
    expired = submit(make_customer(), catalog)
    services.request_expire_unclaimed(request_id=expired.pk) or Job.objects.filter(request=expired).update(
        created_at=timezone.now() - timedelta(hours=1)
    )
    services.request_expire_unclaimed(request_id=expired.pk)

    metrics = scrape(Client(), HTTP_AUTHORIZATION="Bearer m-secret")
    m = "model=gemma-3-270m"
    assert metrics[f"elephant_requests_total{{kind=chat,{m},status=completed}}"] == 1
    assert metrics[f"elephant_requests_total{{kind=chat,{m},status=queued}}"] == 1
    assert metrics[f"elephant_requests_total{{kind=chat,{m},status=failed}}"] == 1
    assert metrics[f"elephant_request_errors_total{{code=queue_timeout,{m}}}"] == 1
    completed = Request.objects.get(pk=served.pk)
    assert metrics[f"elephant_tokens_relayed_total{{{m}}}"] == completed.completion_tokens > 0
    assert metrics[f"elephant_settled_ucents_total{{{m}}}"] == completed.cost_ucents > 0
    assert metrics[f"elephant_settlements_total{{{m}}}"] == 1
    assert metrics[f"elephant_queue_depth{{{m}}}"] == 1
    assert metrics["elephant_queue_wait_seconds_bucket{le=0.25}"] == 0
    assert metrics["elephant_queue_wait_seconds_bucket{le=0.5}"] == 1
    assert metrics["elephant_queue_wait_seconds_count{}"] == 1
    assert metrics["elephant_queue_wait_seconds_sum{}"] == pytest.approx(0.3, abs=0.01)
    assert metrics["elephant_time_to_first_token_seconds_bucket{le=1.0}"] == 0
    assert metrics["elephant_time_to_first_token_seconds_bucket{le=2.5}"] == 1
    assert metrics[f"elephant_hosts{{{m},state=online}}"] == 1
    assert metrics["elephant_hosts_online{}"] >= 1


def test_the_sample_grafana_dashboard_reads_only_metrics_that_exist(settings, catalog) -> None:
    import json
    import re

    from testkit.stack import ROOT

    settings.METRICS_TOKEN = "m-secret"
    dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    used = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"elephant_\w+", target["expr"])
    }
    text = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer m-secret").content.decode()
    suffixes = {
        "counter": ["", "_total"],
        "gauge": [""],
        "histogram": ["_bucket", "_count", "_sum"],
    }  # (TYPE names counters either way)
    served = {
        name + suffix
        for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE)
        for suffix in suffixes[kind]
    }
    assert used and used <= served, used - served
