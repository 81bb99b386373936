"""The host API: everything a mahout host does, always called outward by the host.

The hot paths (claim, tokens, complete, fail) are async views so a long-poll
or a stream of token batches never occupies a thread; the rest are DRF views.
Each view parses input, calls one service, renders the result.
"""
from __future__ import annotations

import time

from channels.layers import get_channel_layer
from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.decorators import method_decorator
from django.views import View
from django.views.decorators.csrf import csrf_exempt
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from billing import selectors as billing_selectors
from hosts import selectors, services
from hosts.models import Host
from marketplace import routing
from marketplace import services as market
from marketplace.aio import db
from marketplace.apis import bearer_secret, json_body
from marketplace.errors import ApiError, validation_error
from marketplace.events import Inbox, host_group, queue_group


def host_from_secret(secret: str) -> Host:
    host = selectors.host_by_token(token=secret)
    if host is None:
        raise ApiError(401, "Invalid host token.", code="invalid_host_token", type="authentication_error")
    return host


def _refusal(error: Exception) -> ApiError:
    if isinstance(error, market.HostRefused):
        return ApiError(403, error.message, code=error.code, type="permission_error")
    if isinstance(error, market.JobNotRunning):
        return ApiError(409, str(error), code="job_not_running", type="conflict")
    if isinstance(error, market.SequenceGap):
        return ApiError(409, str(error), code="sequence_gap", type="conflict")
    if isinstance(error, market.BadResult):
        return ApiError(400, error.message, code="invalid_result")
    raise error


@method_decorator(csrf_exempt, name="dispatch")
class AsyncHostApi(View):
    """Parse, authenticate, validate, then `handle`; errors in the API's format."""

    InputSerializer: type[serializers.Serializer]

    async def post(self, request: HttpRequest, **kwargs: object) -> HttpResponse:
        try:
            secret = bearer_secret(request)
            body = json_body(request)
            serializer = self.InputSerializer(data=body)
            if not serializer.is_valid():
                raise validation_error(serializer.errors)
            host = await db(host_from_secret, secret)
            return await self.handle(host, serializer.validated_data, **kwargs)
        except (market.HostRefused, market.JobNotRunning, market.SequenceGap, market.BadResult) as error:
            return _refusal(error).response()
        except ApiError as error:
            return error.response()

    async def handle(self, host: Host, data: dict, **kwargs: object) -> HttpResponse:
        raise NotImplementedError


class JobClaimApi(AsyncHostApi):
    """Long-poll: answer with a job as soon as one is queued for a model this
    host qualified on this machine, or 204 after `wait` seconds. Waiting hosts
    are woken through the channel layer, not by polling the database."""

    class InputSerializer(serializers.Serializer):
        fingerprint = serializers.CharField(max_length=64)
        wait = serializers.FloatField(min_value=0, max_value=settings.CLAIM_MAX_WAIT_SECONDS, default=20)

    async def handle(self, host: Host, data: dict, **kwargs: object) -> HttpResponse:
        if host.paused:
            raise ApiError(403, "This host is paused; resume it to claim work.", code="host_paused", type="permission_error")
        if host.maintenance_since is not None:
            raise ApiError(
                403, f"This host is in maintenance: {host.maintenance_reason} Its owner or an operator can resume it.",
                code="host_maintenance", type="permission_error",
            )
        model_ids = await db(selectors.qualified_model_ids, host=host, fingerprint=data["fingerprint"])
        if not model_ids:
            raise ApiError(
                403, "This host has not qualified any model on this machine; run the benchmark and register it first.",
                code="not_qualified", type="permission_error",
            )
        warm_ids = await db(routing.warm_model_ids, host=host, model_ids=model_ids)
        layer = get_channel_layer()
        channel = await layer.new_channel()
        groups = [queue_group(model_id) for model_id in model_ids] + [host_group(host.pk)]
        for group in groups:
            await layer.group_add(group, channel)
        inbox = Inbox(layer, channel)
        try:
            return await self._claim_until(host, data, model_ids, warm_ids, inbox)
        finally:
            inbox.close()
            for group in groups:
                await layer.group_discard(group, channel)

    async def _claim_until(
        self, host: Host, data: dict, model_ids: list[int], warm_ids: list[int], inbox: Inbox
    ) -> HttpResponse:
        """Claim, or sleep until woken. Offers to other hosts and the cold grace lapse
        without a wake-up, so a waiting host also looks again every ROUTING_OFFER_SECONDS."""
        deadline = time.monotonic() + data["wait"]
        recheck = max(settings.ROUTING_OFFER_SECONDS, 0.2)
        while True:  # a host paused while it waits simply gets nothing
            payload = await db(market.job_claim_payload, host=host, model_ids=model_ids, warm_ids=warm_ids)
            if payload is not None:
                return JsonResponse({"job": payload})
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return HttpResponse(status=204)
            await inbox.next(min(remaining, recheck))


class JobTokensApi(AsyncHostApi):
    class InputSerializer(serializers.Serializer):
        seq = serializers.IntegerField(min_value=0)
        text = serializers.CharField(allow_blank=True, trim_whitespace=False, max_length=65536)

    async def handle(self, host: Host, data: dict, **kwargs: object) -> HttpResponse:
        result = await db(market.job_push_tokens, host=host, job_id=kwargs["job_id"], seq=data["seq"], text=data["text"])
        return JsonResponse({"accepted": result.accepted, "next_seq": result.next_seq})


class JobCompleteApi(AsyncHostApi):
    class InputSerializer(serializers.Serializer):
        finish_reason = serializers.ChoiceField(choices=["stop", "length"])
        completion_tokens = serializers.IntegerField(min_value=0, required=False)
        embeddings = serializers.JSONField(required=False, default=None)  # checked by the service, not per float here

    async def handle(self, host: Host, data: dict, **kwargs: object) -> HttpResponse:
        done = await db(
            market.job_complete, host=host, job_id=kwargs["job_id"], finish_reason=data["finish_reason"],
            embeddings=data["embeddings"],
        )
        return JsonResponse({"earned_ucents": done.earned_ucents, "completion_tokens": done.request.completion_tokens})


class JobFailApi(AsyncHostApi):
    class InputSerializer(serializers.Serializer):
        reason = serializers.CharField(max_length=500)

    async def handle(self, host: Host, data: dict, **kwargs: object) -> HttpResponse:
        await db(market.job_fail, host=host, job_id=kwargs["job_id"], reason=data["reason"])
        return JsonResponse({"failed": True})


class HostApi(APIView):
    def host(self, request) -> Host:  # type: ignore[no-untyped-def]
        return host_from_secret(bearer_secret(request))


class QualificationRegisterApi(HostApi):
    class InputSerializer(serializers.Serializer):
        class BenchmarkSerializer(serializers.Serializer):
            prompt_tps = serializers.FloatField(min_value=0)
            gen_tps = serializers.FloatField(min_value=0.001)
            ttft_ms = serializers.FloatField(min_value=0)
            memory_mb = serializers.FloatField(min_value=0)
            threads = serializers.IntegerField(min_value=0, required=False, default=0)

        model = serializers.CharField(max_length=100)
        fingerprint = serializers.CharField(max_length=64)
        benchmark = BenchmarkSerializer()
        machine = serializers.DictField(required=False, default=dict)

    def post(self, request) -> Response:  # type: ignore[no-untyped-def]
        host = self.host(request)
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        try:
            services.qualification_register(
                host=host, model_name=data["model"], fingerprint=data["fingerprint"], benchmark=data["benchmark"], machine=data["machine"]
            )
        except services.UnknownModel as error:
            raise ApiError(404, str(error), code="model_not_found", param="model") from None
        return Response({"model": data["model"], "fingerprint": data["fingerprint"]}, status=201)


class HeartbeatApi(HostApi):
    class InputSerializer(serializers.Serializer):
        fingerprint = serializers.CharField(max_length=64)
        paused = serializers.BooleanField(default=False)
        active_jobs = serializers.ListField(child=serializers.IntegerField(), required=False, default=list)
        models_loaded = serializers.ListField(child=serializers.CharField(max_length=100), required=False, default=list)
        version = serializers.CharField(max_length=32, required=False, default="")
        catalog = serializers.JSONField(required=False, default=None)  # read leniently: see host_heartbeat

    def post(self, request) -> Response:  # type: ignore[no-untyped-def]
        host = self.host(request)
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        host = services.host_heartbeat(
            host=host, fingerprint=data["fingerprint"], paused=data["paused"], models_loaded=data["models_loaded"], version=data["version"],
            catalog=data["catalog"],
        )
        return Response(
            {"status": selectors.host_status(host=host), "paused": host.paused, "maintenance": host.maintenance_reason or None}
        )


class HostMeApi(HostApi):
    def get(self, request) -> Response:  # type: ignore[no-untyped-def]
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
                "active_jobs": [{"id": job.pk, "model": job.model.name, "claimed_at": job.claimed_at} for job in active],
                "qualifications": [
                    {"model": q.model.name, "fingerprint": q.fingerprint, "gen_tps": q.gen_tps, "prompt_tps": q.prompt_tps, "ttft_ms": q.ttft_ms}
                    for q in selectors.host_qualifications(host=host)
                ],
            }
        )


class HostEarningsApi(HostApi):
    def get(self, request) -> Response:  # type: ignore[no-untyped-def]
        host = self.host(request)
        account = billing_selectors.host_account(host=host)
        lines = selectors.host_earning_lines(host=host)
        return Response(
            {
                "balance_ucents": account.balance_ucents if account else 0,
                "lines": [
                    {
                        "job_id": job.pk,
                        "model": job.model.name,
                        "completion_tokens": job.completion_tokens,
                        "earned_ucents": job.earned_ucents,
                        "finished_at": job.finished_at,
                    }
                    for job in lines
                ],
            }
        )
