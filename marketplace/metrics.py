"""The operator's metrics, in Prometheus' text format at `GET /metrics`.

Every figure is read from the database when Prometheus scrapes, not counted in a process's
memory. So any gateway process answers for the whole system, and a process that restarts
loses nothing. Scrape one process (or the balancer): scraping every process and summing
would count each figure once per process. Counters are totals over the rows kept
(`Request`, `Job`, `CanaryCheck`); gauges are now. Histograms of queue wait and time to
first token are computed in SQL over first attempts, with fixed buckets.

Access: `Authorization: Bearer <METRICS_TOKEN>` when the setting is set, or a signed-in
staff user."""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from datetime import timedelta

from django.conf import settings
from django.db.models import Count, DurationField, ExpressionWrapper, F, Q, Sum
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from catalog.models import CatalogModel
from core.http import bearer_of
from hosts.models import Host
from hosts.selectors import warm_host_counts
from marketplace.models import CanaryCheck, Job, Request

BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class DatabaseCollector:
    """Prometheus' collector interface over the marketplace's rows."""

    def collect(self) -> Iterator[Metric]:
        yield from self._requests()
        yield from self._queue_and_hosts()
        yield self._histogram(
            "elephant_queue_wait_seconds",
            "From admission to a host's claim (first attempts).",
            start="created_at",
            end="claimed_at",
        )
        yield self._histogram(
            "elephant_time_to_first_token_seconds",
            "From admission to the first token at the gateway (first attempts).",
            start="created_at",
            end="first_token_at",
        )
        verdicts = CounterMetricFamily(
            "elephant_canary_checks", "Canaries sent to hosts, by verdict.", labels=["verdict"]
        )
        for row in CanaryCheck.objects.values("verdict").annotate(n=Count("id")).order_by("verdict"):
            verdicts.add_metric([row["verdict"]], row["n"])
        yield verdicts

    def _requests(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "elephant_requests", "Requests admitted, by model, kind and status.", labels=["model", "kind", "status"]
        )
        errors = CounterMetricFamily(
            "elephant_request_errors", "Requests that failed, by model and error code.", labels=["model", "code"]
        )
        tokens = CounterMetricFamily(
            "elephant_tokens_relayed", "Completion tokens delivered and billed.", labels=["model"]
        )
        settled = CounterMetricFamily(
            "elephant_settled_ucents", "Micro-cents settled (billed to customers).", labels=["model"]
        )
        settlements = CounterMetricFamily(
            "elephant_settlements", "Requests settled (completed and billed).", labels=["model"]
        )
        continuations = CounterMetricFamily(
            "elephant_continuations", "Requests another host finished after a death.", labels=["model"]
        )
        rows = (
            Request.objects.values("model__name", "kind", "status")
            .annotate(
                n=Count("id"),
                tokens=Sum("completion_tokens"),
                ucents=Sum("cost_ucents"),
                resumed=Count("id", filter=Q(resumed=True)),
            )
            .order_by("model__name", "kind", "status")
        )
        per_model: dict[str, dict[str, int]] = {}
        for row in rows:
            model = row["model__name"]
            requests.add_metric([model, row["kind"], row["status"]], row["n"])
            totals = per_model.setdefault(model, {"tokens": 0, "ucents": 0, "settled": 0, "resumed": 0})
            totals["resumed"] += row["resumed"]
            if row["status"] == Request.Status.COMPLETED:
                totals["tokens"] += row["tokens"] or 0
                totals["ucents"] += row["ucents"] or 0
                totals["settled"] += row["n"]
        for model, totals in per_model.items():
            tokens.add_metric([model], totals["tokens"])
            settled.add_metric([model], totals["ucents"])
            settlements.add_metric([model], totals["settled"])
            continuations.add_metric([model], totals["resumed"])
        for failed in (
            Request.objects.filter(status=Request.Status.FAILED)
            .values("model__name", "error_code")
            .annotate(n=Count("id"))
            .order_by("model__name", "error_code")
        ):
            errors.add_metric([failed["model__name"], failed["error_code"] or ""], failed["n"])
        yield from (requests, errors, tokens, settled, settlements, continuations)

    def _queue_and_hosts(self) -> Iterator[Metric]:
        queued = GaugeMetricFamily("elephant_queue_depth", "Jobs waiting for a host, by model.", labels=["model"])
        for row in (
            Job.objects.filter(status=Job.Status.QUEUED)
            .values("request__model__name")
            .annotate(n=Count("id"))
            .order_by("request__model__name")
        ):
            queued.add_metric([row["request__model__name"]], row["n"])
        hosts = GaugeMetricFamily(
            "elephant_hosts", "Hosts online (qualified) and warm, by model.", labels=["model", "state"]
        )
        names = dict(CatalogModel.objects.values_list("pk", "name"))
        for model_id, counts in sorted(warm_host_counts().items()):
            for state in ("online", "warm"):
                hosts.add_metric([names.get(model_id, str(model_id)), state], counts[state])
        busy = GaugeMetricFamily("elephant_hosts_busy", "Hosts running at least one job.")
        busy.add_metric(
            [], Job.objects.filter(status=Job.Status.RUNNING, host__isnull=False).values("host").distinct().count()
        )
        online = GaugeMetricFamily("elephant_hosts_online", "Hosts whose heartbeat is recent.")
        online.add_metric([], Host.objects.online(timezone.now()).count())
        yield from (queued, hosts, busy, online)

    @staticmethod
    def _histogram(name: str, documentation: str, *, start: str, end: str) -> Metric:
        waited = ExpressionWrapper(F(end) - F(f"request__{start}"), output_field=DurationField())
        buckets = {f"le_{i}": Count("id", filter=Q(waited__lte=timedelta(seconds=b))) for i, b in enumerate(BUCKETS_S)}
        row = (
            Job.objects.filter(attempt=1, **{f"{end}__isnull": False})
            .annotate(waited=waited)
            .aggregate(count=Count("id"), total=Sum("waited"), **buckets)
        )
        family = HistogramMetricFamily(name, documentation, labels=[])
        total = row["total"]
        seconds = (
            total.total_seconds() if isinstance(total, timedelta) else float(total or 0) / 1e6
        )  # (microseconds on SQLite)
        family.add_metric(
            [],
            [(str(b), row[f"le_{i}"]) for i, b in enumerate(BUCKETS_S)] + [("+Inf", row["count"])],
            sum_value=seconds,
        )
        return family


def metrics_allowed(request: HttpRequest) -> bool:
    token = settings.METRICS_TOKEN
    if token and hmac.compare_digest(bearer_of(request.headers.get("Authorization", "")) or "", token):
        return True
    user = getattr(request, "user", None)
    return bool(user is not None and user.is_authenticated and user.is_staff)


def metrics_view(request: HttpRequest) -> HttpResponse:
    """`GET /metrics` for Prometheus (a bearer METRICS_TOKEN, or a staff user's session)."""
    if not metrics_allowed(request):
        return HttpResponse(
            "Metrics need the METRICS_TOKEN as a bearer token, or a staff login.\n",
            status=401,
            content_type="text/plain",
        )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DatabaseCollector())
    return HttpResponse(generate_latest(registry), content_type="text/plain; version=0.0.4; charset=utf-8")
