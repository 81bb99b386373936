"""The host job API: everything a mahout host does about work, always called outward by the host.

The hot paths (claim, tokens, complete, fail) are async views so a long-poll
or a stream of token batches never occupies a thread; the rest are DRF views.
Each view parses input, calls one service, renders the result.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone
from django.utils.decorators import method_decorator
from django.views import View
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.request import Request as DrfRequest
from rest_framework.response import Response

from billing.apis import PayoutSerializer, payout_body
from core.db import db
from core.errors import ApiError, DomainError, validation_error
from core.http import INT_MAX, bearer_secret, json_body
from core.openapi import ERROR, HOST_TOKEN
from hosts import selectors as hosts
from hosts import services as host_services
from hosts.apis import HostApi
from hosts.models import Host
from hosts.selectors import host_from_secret
from marketplace import selectors
from marketplace import services as market
from marketplace.hostdoor import pushing
from marketplace.hostdoor.claiming import JobClaimInputSerializer, boot_field, claim_when_offered
from marketplace.trust import redundancy, ring_inquiries
from marketplace.trust.audits import MAX_TOKENS_KEPT, audit_verdict_report
from protocol.jobs import AUDIT_VERDICTS, RING_CHECK_VERDICTS
from protocol.version import MAHOUT_VERSION as mahout_version


@method_decorator(csrf_exempt, name="dispatch")
class AsyncHostApi(View):
    """Parse, authenticate, validate, then `handle`; errors in the API's format."""

    security_scheme = HOST_TOKEN
    InputSerializer: type[serializers.Serializer]

    async def post(self, request: HttpRequest, **kwargs: object) -> HttpResponse:
        try:
            secret = bearer_secret(request)
            body = json_body(request)
            host = await db(host_from_secret, secret)  # a stranger's body is not validated
            serializer = self.InputSerializer(data=body)
            if not serializer.is_valid():
                raise validation_error(serializer.errors)
            return await self.handle(host, serializer.validated_data, **kwargs)
        except DomainError as error:
            return error.response()

    async def handle(self, host: Host, data: dict, **kwargs: object) -> HttpResponse:
        raise NotImplementedError


class ClaimedJobSerializer(serializers.Serializer):
    """The work and nothing about the customer (`protocol.jobs.JobPayload`)."""

    id = serializers.IntegerField()
    model = serializers.CharField()
    kind = serializers.CharField(
        help_text="chat, completion or embeddings; or audit, for a trusted host "
        "(protocol.jobs.AuditPayload: job, tokens, text, finish_reason, seed); or "
        "ring_check, for a trusted host (protocol.jobs.RingCheckPayload: job, tokens, "
        "stages, shared_output)"
    )
    messages = serializers.ListField(child=serializers.DictField(), required=False, allow_null=True, help_text="chat")
    prompt = serializers.CharField(required=False, allow_null=True, allow_blank=True, help_text="completion")
    input = serializers.ListField(
        child=serializers.CharField(), required=False, allow_null=True, help_text="embeddings"
    )
    params = serializers.DictField(required=False, help_text="max_tokens, temperature, top_p, stop, seed")
    continuation = serializers.BooleanField(
        required=False,
        help_text="a second attempt, continuing the text already delivered (every job but an audit carries it)",
    )
    job = serializers.DictField(
        required=False, help_text="an audit: the audited job as its host received it, without its id"
    )
    tokens = serializers.ListField(
        child=serializers.IntegerField(), required=False, help_text="an audit: the token ids reported"
    )
    text = serializers.CharField(required=False, allow_blank=True, help_text="an audit: the text the customer received")
    finish_reason = serializers.CharField(required=False, help_text="an audit: the answer's finish reason")
    seed = serializers.IntegerField(required=False, help_text="an audit: the job's sampling seed")
    draw = serializers.IntegerField(
        required=False,
        allow_null=True,
        help_text="an audit: check this many tokens, drawn at random; null: every token",
    )
    stages = serializers.ListField(
        child=serializers.DictField(),
        required=False,
        help_text="a ring check: each stage's index, layers [start, end) and parts of evidence",
    )
    shared_output = serializers.BooleanField(
        required=False, help_text="a ring check: the head and tail share the output head"
    )


class ClaimSerializer(serializers.Serializer):
    job = ClaimedJobSerializer()


class TokensAcceptedSerializer(serializers.Serializer):
    accepted = serializers.BooleanField(help_text="false: a retry of a batch already applied")
    next_seq = serializers.IntegerField()


class ProgressSerializer(serializers.Serializer):
    ok = serializers.BooleanField()


class CompletedSerializer(serializers.Serializer):
    earned_ucents = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()


class FailedSerializer(serializers.Serializer):
    failed = serializers.BooleanField()


# A job that is not this host's is a 403; one that is no longer running, or a batch from the future, a 409.
JOB_ERRORS = {409: ERROR}


@extend_schema(
    responses={
        200: ClaimSerializer,
        204: OpenApiResponse(description="No job within `wait` seconds: claim again."),
        429: ERROR,
        409: ERROR,
        426: ERROR,  # no heartbeat within HOST_OFFLINE_AFTER_SECONDS; a mahout older than MAHOUT_MIN_VERSION
    }
)
class JobClaimApi(AsyncHostApi):
    """Long-poll: answer with a job as soon as one is queued for a model this
    host qualified on this machine, or 204 after `wait` seconds. Waiting hosts
    are woken through the channel layer, not by polling the database."""

    InputSerializer = JobClaimInputSerializer

    async def handle(self, host: Host, data: dict, **kwargs: object) -> HttpResponse:
        if data[
            "boot"
        ]:  # a new one ends the attempts of the host's earlier process first (a socket's: at its handshake)
            await db(market.host_boot_seen, host_id=host.pk, boot=data["boot"])
        payload = await claim_when_offered(host, fingerprint=data["fingerprint"], wait=data["wait"], boot=data["boot"])
        return HttpResponse(status=204) if payload is None else JsonResponse({"job": payload})


@extend_schema(responses={200: TokensAcceptedSerializer, **JOB_ERRORS})
class JobTokensApi(AsyncHostApi):
    """A batch of generated text, numbered from 0 (`seq`): applied once, in order."""

    InputSerializer = pushing.TokenBatchSerializer

    async def handle(self, host: Host, data: dict, **kwargs: Any) -> HttpResponse:  # (the URL's job_id)
        result = await pushing.push_tokens(
            host=host,
            job_id=kwargs["job_id"],
            seq=data["seq"],
            text=data["text"],
            logprobs=data.get("logprobs"),
            finish_reason=data["finish_reason"],
        )
        return JsonResponse({"accepted": result.accepted, "next_seq": result.next_seq})


@extend_schema(responses={200: ProgressSerializer, **JOB_ERRORS})
class JobProgressApi(AsyncHostApi):
    """Still loading the model or prefilling the prompt, no token yet: a sign of life that
    keeps the job alive past its start bound (`services.job_start_overdue`)."""

    class InputSerializer(serializers.Serializer):
        stage = serializers.ChoiceField(choices=["loading", "prefill"], required=False, default="prefill")

    async def handle(self, host: Host, data: dict, **kwargs: object) -> HttpResponse:
        await db(market.job_progress, host=host, job_id=kwargs["job_id"])
        return JsonResponse({"ok": True})


@extend_schema(
    responses={200: CompletedSerializer, 422: ERROR, **JOB_ERRORS}
)  # 422: no evidence of its answer (evidence)
class JobCompleteApi(AsyncHostApi):
    """The job is done: the gateway counts the tokens, bills the customer, pays the host."""

    class InputSerializer(serializers.Serializer):
        finish_reason = serializers.ChoiceField(choices=["stop", "length"])
        completion_tokens = serializers.IntegerField(min_value=0, required=False)
        embeddings = serializers.JSONField(required=False, default=None)  # checked by the service, not per float here
        # the token ids the host generated: what an audit re-reads (marketplace.trust.audits)
        tokens = serializers.ListField(
            child=serializers.IntegerField(min_value=0, max_value=2**31 - 1),
            required=False,
            allow_null=True,
            default=None,
            max_length=MAX_TOKENS_KEPT,
        )
        seed = serializers.IntegerField(required=False, allow_null=True, default=None)  # the host's word; never used

    async def handle(self, host: Host, data: dict, **kwargs: object) -> HttpResponse:
        done = await db(
            market.job_complete,
            host=host,
            job_id=kwargs["job_id"],
            finish_reason=data["finish_reason"],
            embeddings=data["embeddings"],
            token_ids=data["tokens"],
        )
        return JsonResponse({"earned_ucents": done.earned_ucents, "completion_tokens": done.request.completion_tokens})


@extend_schema(responses={200: FailedSerializer, **JOB_ERRORS})
class JobFailApi(AsyncHostApi):
    """The host gives the job up: it continues elsewhere once, or fails honestly."""

    class InputSerializer(serializers.Serializer):
        reason = serializers.CharField(max_length=500)
        # "request": the job's own content cannot be run (no strike; another host gets a second opinion)
        cause = serializers.ChoiceField(choices=["host", "request"], default="host")

    async def handle(self, host: Host, data: dict, **kwargs: object) -> HttpResponse:
        await db(market.job_fail, host=host, job_id=kwargs["job_id"], reason=data["reason"], cause=data["cause"])
        return JsonResponse({"failed": True})


class AuditVerdictSerializer(serializers.Serializer):
    status = serializers.CharField(
        help_text="the audit's status after this verdict: pending (another scorer reads it next), passed or failed"
    )


@extend_schema(responses={200: AuditVerdictSerializer, 409: ERROR})
class AuditVerdictApi(AsyncHostApi):
    """A trusted host's verdict on the audit it claimed (a claim answered with kind "audit",
    `protocol.jobs.AuditPayload`); it is paid its prefill's fee when the audit is decided."""

    class InputSerializer(serializers.Serializer):
        verdict = serializers.ChoiceField(
            choices=list(AUDIT_VERDICTS), help_text="passed, failed, or declined (it cannot score it here)"
        )
        reason = serializers.CharField(max_length=500, required=False, default="", allow_blank=True)
        checked = serializers.IntegerField(min_value=0, max_value=INT_MAX, required=False, default=0)
        uncertain = serializers.IntegerField(min_value=0, max_value=INT_MAX, required=False, default=0)
        misses = serializers.IntegerField(min_value=0, max_value=INT_MAX, required=False, default=0)

    async def handle(self, host: Host, data: dict, **kwargs: object) -> HttpResponse:
        status = await db(
            audit_verdict_report,
            host=host,
            audit_id=kwargs["audit_id"],
            verdict=data["verdict"],
            reason=data["reason"],
            counts=data,
        )
        return JsonResponse({"status": status})


class HeartbeatApi(HostApi):
    class InputSerializer(serializers.Serializer):
        fingerprint = serializers.CharField(max_length=64)
        paused = serializers.BooleanField(default=False)
        active_jobs = serializers.ListField(child=serializers.IntegerField(), required=False, default=list)
        models_loaded = serializers.ListField(child=serializers.CharField(max_length=100), required=False, default=list)
        version = serializers.CharField(max_length=32, required=False, default="")
        catalog = serializers.JSONField(required=False, default=None)  # read leniently: see host_heartbeat
        boot = boot_field()  # a new one ends the host's attempts of its earlier process (services.host_boot_seen)

    class OutputSerializer(serializers.Serializer):
        status = serializers.CharField(
            help_text="maintenance, paused, offline, busy or online (a host's own state before a silence)"
        )
        paused = serializers.BooleanField()
        maintenance = serializers.CharField(allow_null=True, help_text="why the host is in maintenance, if it is")
        load = serializers.ListField(
            child=serializers.CharField(), help_text="models the gateway asks this host to load"
        )
        unload = serializers.ListField(child=serializers.CharField(), help_text="models it may unload")

    @extend_schema(responses={200: OutputSerializer})
    def post(self, request: DrfRequest) -> Response:
        host = self.host(request)
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        too_old = hosts.client_too_old(data["version"])
        if too_old is not None:
            wheel = request.build_absolute_uri(
                f"/downloads/elephant_mahout-{mahout_version}-py3-none-any.whl"
            )  # (the one served)
            raise ApiError(
                426,
                f"{too_old}. Upgrade it: pip install --upgrade {wheel} (or, in a checkout: git pull && make install), "
                "then start it again.",
                code="upgrade_required",
            )
        host = host_services.host_heartbeat(
            host=host,
            fingerprint=data["fingerprint"],
            paused=data["paused"],
            models_loaded=data["models_loaded"],
            version=data["version"],
            catalog=data["catalog"],
        )
        market.host_boot_seen(host_id=host.pk, boot=data["boot"])
        asks = redundancy.heartbeat_asks(host=host, now=timezone.now())  # `load` / `unload`: deliberate redundancy
        return Response(
            {
                "status": selectors.host_status(host=host),
                "paused": host.paused,
                "maintenance": host.maintenance_reason or None,
                **asks,
            }
        )


class HostMeApi(HostApi):
    class OutputSerializer(serializers.Serializer):
        class ActiveJobSerializer(serializers.Serializer):
            id = serializers.IntegerField()
            model = serializers.CharField()
            claimed_at = serializers.DateTimeField(allow_null=True)

        class QualificationSerializer(serializers.Serializer):
            model = serializers.CharField()
            fingerprint = serializers.CharField()
            gen_tps = serializers.FloatField()
            prompt_tps = serializers.FloatField()
            ttft_ms = serializers.FloatField()

        id = serializers.IntegerField()
        name = serializers.CharField()
        status = serializers.CharField(
            help_text="maintenance, paused, offline, busy or online (a host's own state before a silence)"
        )
        paused = serializers.BooleanField()
        maintenance_reason = serializers.CharField(allow_null=True)
        maintenance_since = serializers.DateTimeField(allow_null=True)
        last_heartbeat_at = serializers.DateTimeField(allow_null=True)
        active_jobs = ActiveJobSerializer(many=True)
        qualifications = QualificationSerializer(many=True)

    @extend_schema(responses={200: OutputSerializer})
    def get(self, request: DrfRequest) -> Response:
        host = self.host(request)
        active = selectors.host_active_jobs(host=host)
        return Response(
            {
                "id": host.pk,
                "name": host.name,
                "status": selectors.host_status(host=host),
                "paused": host.paused,
                "maintenance_reason": host.maintenance_reason or None,
                "maintenance_since": host.maintenance_since,
                "last_heartbeat_at": host.last_heartbeat_at,
                "active_jobs": [
                    {"id": job.pk, "model": job.model.name, "claimed_at": job.claimed_at} for job in active
                ],
                "qualifications": [
                    {
                        "model": q.model.name,
                        "fingerprint": q.fingerprint,
                        "gen_tps": q.gen_tps,
                        "prompt_tps": q.prompt_tps,
                        "ttft_ms": q.ttft_ms,
                    }
                    for q in hosts.host_qualifications(host=host)
                ],
            }
        )


class EarningLineSerializer(serializers.Serializer):
    """One completed job as its host sees it (`earning_line`)."""

    job_id = serializers.IntegerField()
    model = serializers.CharField()
    completion_tokens = serializers.IntegerField()
    earned_ucents = serializers.IntegerField()
    finished_at = serializers.DateTimeField(allow_null=True)
    ring = serializers.IntegerField(allow_null=True, help_text="a ring stage's share: the ring")
    layers = serializers.CharField(allow_null=True, help_text='the layers this host ran of it ("6/18")')


class HostEarningsApi(HostApi):
    """GET /hosts/api/earnings: the balance and the latest completed jobs."""

    class OutputSerializer(serializers.Serializer):
        balance_ucents = serializers.IntegerField()
        payable_ucents = serializers.IntegerField()
        unvested_ucents = serializers.IntegerField()
        today_ucents = serializers.IntegerField(help_text="earned from work finished since midnight UTC")
        lines = EarningLineSerializer(many=True)

    @extend_schema(responses={200: OutputSerializer})
    def get(self, request: DrfRequest) -> Response:
        host = self.host(request)
        statement = selectors.host_statement(host=host)
        money = statement.payouts
        midnight = timezone.now().replace(hour=0, minute=0, second=0, microsecond=0)
        return Response(
            {
                "balance_ucents": money.balance_ucents,
                "payable_ucents": money.available_ucents,
                "unvested_ucents": money.unvested_ucents,
                "today_ucents": selectors.host_earned_since(host=host, since=midnight),
                "lines": [earning_line(job) for job in statement.jobs],
            }
        )


def earning_line(job: dict) -> dict:
    """One completed job as a host sees it: tokens and earnings, nothing about the customer."""
    return {
        "job_id": job["pk"],
        "model": job["model__name"],
        "completion_tokens": job["completion_tokens"],
        "earned_ucents": job["earned_ucents"],
        "finished_at": job["finished_at"],
        "ring": job["ring"],  # a ring stage's share: the ring, and the layers this host ran of it ("6/18")
        "layers": job["layers"],
    }


class HostStatementApi(HostApi):
    """GET /billing/api/host/statement: balance, available, payouts, and the latest completed
    jobs (tokens and earnings only: nothing about the customer)."""

    class OutputSerializer(serializers.Serializer):
        object = serializers.CharField(help_text="host_statement")
        balance_ucents = serializers.IntegerField()
        available_ucents = serializers.IntegerField()
        unvested_ucents = serializers.IntegerField()
        forfeited_ucents = serializers.IntegerField()
        vest_seconds = serializers.FloatField()
        pending_payout_ucents = serializers.IntegerField()
        paid_out_ucents = serializers.IntegerField()
        payout_minimum_ucents = serializers.IntegerField()
        jobs = EarningLineSerializer(many=True)
        payouts = PayoutSerializer(many=True)

    @extend_schema(responses={200: OutputSerializer})
    def get(self, request: DrfRequest) -> Response:
        statement = selectors.host_statement(host=self.host(request))
        return Response(
            {
                "object": "host_statement",
                "balance_ucents": statement.payouts.balance_ucents,
                "available_ucents": statement.payouts.available_ucents,
                "unvested_ucents": statement.payouts.unvested_ucents,
                "forfeited_ucents": statement.payouts.forfeited_ucents,
                "vest_seconds": settings.EARNINGS_VEST_SECONDS,
                "pending_payout_ucents": statement.payouts.pending_payout_ucents,
                "paid_out_ucents": statement.payouts.paid_out_ucents,
                "payout_minimum_ucents": settings.PAYOUT_MINIMUM_UCENTS,
                "jobs": [earning_line(job) for job in statement.jobs],
                "payouts": [payout_body(payout) for payout in statement.payouts.payouts],
            }
        )


# --- ring inquiries (marketplace.trust.ring_inquiries) ---
# a ring's failed audit, its stages' evidence, a checker's verdict


def _valid(serializer: type[serializers.Serializer], data: object) -> dict:
    """`data` validated by `serializer`, or the API's 400 naming what is wrong."""
    parsed = serializer(data=data)
    if not parsed.is_valid():
        raise validation_error(parsed.errors)
    return parsed.validated_data


class RingInquiriesWantedApi(HostApi):
    """The inquiries a stage host's stage owes its evidence to (a stage process asks every few seconds)."""

    class QuerySerializer(serializers.Serializer):
        ring = serializers.IntegerField(min_value=1, max_value=INT_MAX)
        stage = serializers.IntegerField(min_value=0, max_value=INT_MAX)

    class OutputSerializer(serializers.Serializer):
        class WantedSerializer(serializers.Serializer):
            id = serializers.IntegerField()
            job = serializers.IntegerField(
                help_text="the job whose request the stage looks for (request id job-<job>-…)"
            )

        inquiries = WantedSerializer(many=True)

    @extend_schema(parameters=[QuerySerializer], responses={200: OutputSerializer, 400: ERROR, 404: ERROR})
    def get(self, request: DrfRequest) -> Response:
        host = self.host(request)
        query = _valid(self.QuerySerializer, request.query_params)
        return Response(
            {"inquiries": ring_inquiries.inquiries_wanted(host=host, plan_id=query["ring"], stage=query["stage"])}
        )


class RingEvidenceApi(HostApi):
    """POST: a stage host's evidence, part by part (base64 of an npz file's bytes; `parts` 0:
    it kept nothing). GET: one part, for the inquiry's checker only."""

    class InputSerializer(serializers.Serializer):
        stage = serializers.IntegerField(min_value=0, max_value=INT_MAX)
        part = serializers.IntegerField(min_value=0, max_value=INT_MAX)
        parts = serializers.IntegerField(min_value=0, max_value=INT_MAX)
        # (the wire's field `data`: DRF's stubs take the name for Serializer.data)
        data = serializers.CharField(  # type: ignore[assignment]
            allow_blank=True, required=False, default="", max_length=4 * ring_inquiries.PART_BYTES // 3 + 8
        )

    class QuerySerializer(serializers.Serializer):
        stage = serializers.IntegerField(min_value=0, max_value=INT_MAX)
        part = serializers.IntegerField(min_value=0, max_value=INT_MAX)

    class StoredSerializer(serializers.Serializer):
        complete = serializers.BooleanField(help_text="every part of this stage's evidence is in")
        status = serializers.CharField(help_text="the inquiry's: collecting, or checking once every stage answered")

    class PartSerializer(serializers.Serializer):
        # (the wire's field `data`: DRF's stubs take the name for Serializer.data)
        data = serializers.CharField(help_text="base64")  # type: ignore[assignment]

    @extend_schema(request=InputSerializer, responses={200: StoredSerializer, 400: ERROR, 404: ERROR, 409: ERROR})
    def post(self, request: DrfRequest, inquiry_id: int) -> Response:
        host = self.host(request)
        data = _valid(self.InputSerializer, request.data)
        try:
            raw = base64.b64decode(data["data"], validate=True)
        except (binascii.Error, ValueError):  # (a non-ASCII character is a ValueError before any decoding)
            raise ApiError(
                400, "data is not base64.", code="invalid_data", type="invalid_request_error", param="data"
            ) from None
        return Response(
            ring_inquiries.evidence_store(
                host=host, inquiry_id=inquiry_id, stage=data["stage"], part=data["part"], parts=data["parts"], data=raw
            )
        )

    @extend_schema(parameters=[QuerySerializer], responses={200: PartSerializer, 400: ERROR, 404: ERROR, 409: ERROR})
    def get(self, request: DrfRequest, inquiry_id: int) -> Response:
        host = self.host(request)
        query = _valid(self.QuerySerializer, request.query_params)
        raw = ring_inquiries.evidence_read(host=host, inquiry_id=inquiry_id, stage=query["stage"], part=query["part"])
        return Response({"data": base64.b64encode(raw).decode("ascii")})


class RingCheckVerdictApi(HostApi):
    """The checker's verdict on a ring inquiry it claimed (kind "ring_check", `protocol.jobs.RingCheckPayload`):
    the stages at fault (-1: the bridge) with why, or declined."""

    class InputSerializer(serializers.Serializer):
        verdict = serializers.ChoiceField(choices=list(RING_CHECK_VERDICTS))
        blamed = serializers.ListField(
            child=serializers.IntegerField(min_value=-1, max_value=INT_MAX),
            required=False,
            default=list,
            max_length=1000,
        )
        disputed = serializers.ListField(
            child=serializers.ListField(
                child=serializers.IntegerField(min_value=-1, max_value=INT_MAX), min_length=2, max_length=2
            ),
            required=False,
            default=list,
            max_length=1000,
            help_text="links [sender, receiver] whose two ends disagree (neither blamed for it)",
        )
        reasons = serializers.ListField(
            child=serializers.CharField(max_length=1000), required=False, default=list, max_length=1000
        )

    class OutputSerializer(serializers.Serializer):
        status = serializers.CharField(
            help_text="the inquiry's status after this verdict: checking (another checker is asked) or decided"
        )

    @extend_schema(request=InputSerializer, responses={200: OutputSerializer, 400: ERROR, 409: ERROR})
    def post(self, request: DrfRequest, inquiry_id: int) -> Response:
        host = self.host(request)
        data = _valid(self.InputSerializer, request.data)
        return Response(
            {
                "status": ring_inquiries.inquiry_verdict_report(
                    host=host,
                    inquiry_id=inquiry_id,
                    verdict=data["verdict"],
                    blamed=data["blamed"],
                    reasons=data["reasons"],
                    disputed=data["disputed"],
                )
            }
        )
