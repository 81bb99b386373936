"""The expert market API (host token auth, like the host API). Each view parses, calls one
service or selector, renders.

* `GET  /api/moe/recruitment`: per model busy, saturation, base vs effective target, workers.
* `GET  /api/expert-demand`: scarce slices and the `recruiting` flag.
* `POST /api/expert-volunteer`: an idle host asks for a slice (200 with it and its link
  secret, 204: none wanted; 403 banned, in maintenance or blamed, 409 paused or while it
  serves one). A host that is not trusted serves on probation (checked more often).
* `GET  /api/expert-workers/<id>/slice`: the GGUF of that slice's tensors only.
* `POST /api/expert-workers/<id>/register`: the worker serves its slice (at `address`, which
  must be public unless the operator allows private ones, or via the relay).
* `POST /api/expert-workers/<id>/heartbeat`: stay covered; the answer says whether to retire.
* `POST /api/expert-workers/<id>/leave`: the volunteer is leaving (its owner came back): the
  worker retires now and its slice is handed out again.
* `POST /api/moe/coordinator-report`: the bound coordinator's busy slots, its workers'
  `last_serve_ms` and passed checks, the workers it blames (retired at once; 403 for
  another model's), and how many experts it engaged its workers for or only probed them with
  (saturated and only probing: the boost is held back); the answer is its dispatch map,
  each worker with its link secret and the share of its batches to recompute.
"""

from __future__ import annotations

from django.http import FileResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from core.errors import ApiError
from core.http import BIGINT_MAX, INT_MAX
from core.openapi import ERROR
from hosts.apis import HostApi
from hosts.models import Host
from mesh.experts import selectors, services
from mesh.experts.models import ExpertWorker


class MoeHostApi(HostApi):
    """The host API's token check (`HostApi.host`), plus the lookup of the host's own worker."""

    def own_worker(self, request: Request, worker_id: int) -> tuple[Host, ExpertWorker]:
        host = self.host(request)
        worker = selectors.worker_of_host(worker_id=worker_id, host_id=host.pk)
        if worker is None:
            raise ApiError(404, f"No expert worker {worker_id} of this host.", code="worker_not_found")
        return host, worker


class SliceSerializer(serializers.Serializer):
    """A worker as its own host sees it (`_slice`)."""

    worker = serializers.IntegerField()
    model = serializers.CharField()
    layer = serializers.IntegerField()
    first = serializers.IntegerField()
    count = serializers.IntegerField()
    status = serializers.CharField(help_text="assigned, active or retired")
    slice_url = serializers.CharField()
    address = serializers.CharField(allow_blank=True, help_text="HOST:PORT, or blank: reached through the relay")
    secret = serializers.CharField()


def _slice(worker: ExpertWorker) -> dict:
    """A worker as its own host sees it, with the secret its listener admits the coordinator with."""
    return {
        "worker": worker.pk,
        "model": worker.model.name,
        "layer": worker.layer,
        "first": worker.first,
        "count": worker.count,
        "status": worker.status,
        "slice_url": f"/api/expert-workers/{worker.pk}/slice",
        "address": worker.address,
        "secret": worker.secret,
    }


class MoeRecruitmentApi(MoeHostApi):
    class OutputSerializer(serializers.Serializer):
        class ModelSerializer(serializers.Serializer):
            class WorkerSerializer(serializers.Serializer):
                id = serializers.IntegerField()
                host = serializers.IntegerField()
                layer = serializers.IntegerField()
                first = serializers.IntegerField()
                count = serializers.IntegerField()
                status = serializers.CharField()
                last_serve_ms = serializers.IntegerField()
                heartbeat_at = serializers.DateTimeField(allow_null=True)
                checks_passed = serializers.IntegerField()
                probation = serializers.BooleanField(help_text="its host is on expert probation: checked more often")

            model = serializers.CharField()
            busy = serializers.IntegerField()
            saturation_threshold = serializers.IntegerField()
            saturated = serializers.BooleanField()
            base_target = serializers.IntegerField()
            boost = serializers.IntegerField()
            boost_held = serializers.BooleanField(
                help_text="the boost is held back: the saturated coordinator sends its measured workers only probes",
            )
            effective_target = serializers.IntegerField()
            reported_at = serializers.DateTimeField(allow_null=True)
            coordinator = serializers.ChoiceField(["reporting", "silent", "never"])
            silent_since = serializers.DateTimeField(allow_null=True)
            n_layers = serializers.IntegerField()
            n_experts = serializers.IntegerField()
            slice_size = serializers.IntegerField()
            workers = WorkerSerializer(many=True)

        models = ModelSerializer(many=True)

    @extend_schema(responses={200: OutputSerializer})
    def get(self, request: Request) -> Response:
        self.host(request)
        return Response({"models": selectors.recruitment()})


class ExpertDemandApi(MoeHostApi):
    class OutputSerializer(serializers.Serializer):
        class ScarceSerializer(serializers.Serializer):
            model = serializers.CharField()
            layer = serializers.IntegerField()
            first = serializers.IntegerField()
            count = serializers.IntegerField()
            covered = serializers.IntegerField()
            target = serializers.IntegerField()

        recruiting = serializers.BooleanField()
        slices = ScarceSerializer(many=True)

    @extend_schema(responses={200: OutputSerializer})
    def get(self, request: Request) -> Response:
        self.host(request)
        recruiting, scarce = selectors.expert_demand()
        return Response(
            {
                "recruiting": recruiting,
                "slices": [
                    {
                        "model": s.model,
                        "layer": s.layer,
                        "first": s.first,
                        "count": s.count,
                        "covered": s.covered,
                        "target": s.target,
                    }
                    for s in scarce
                ],
            }
        )


class ExpertVolunteerApi(MoeHostApi):
    @extend_schema(
        request=None,
        responses={
            200: SliceSerializer,
            204: OpenApiResponse(description="No slice is wanted now."),
            409: ERROR,
        },
    )
    def post(self, request: Request) -> Response:
        worker = services.expert_volunteer(host=self.host(request))
        if worker is None:
            return Response(status=204)
        return Response(_slice(worker))


class ExpertSliceApi(MoeHostApi):
    """Only the tensors of the worker's own slice, as a GGUF file."""

    @extend_schema(responses={(200, "application/octet-stream"): OpenApiTypes.BINARY, 409: ERROR})
    def get(self, request: Request, worker_id: int) -> FileResponse:
        _, worker = self.own_worker(request, worker_id)
        path = services.expert_slice_file(worker=worker)
        return FileResponse(path.open("rb"), content_type="application/octet-stream", filename=path.name)


class ExpertWorkerRegisterApi(MoeHostApi):
    class InputSerializer(serializers.Serializer):
        address = serializers.RegexField(
            r"^[A-Za-z0-9.\-\[\]:]+:\d{1,5}$", required=False, allow_blank=True, default=""
        )

    @extend_schema(responses={200: SliceSerializer, 409: ERROR})
    def post(self, request: Request, worker_id: int) -> Response:
        host = self.host(request)
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        worker = services.expert_worker_register(
            worker_id=worker_id, host=host, address=serializer.validated_data["address"]
        )
        return Response(_slice(worker))


class ExpertWorkerHeartbeatApi(MoeHostApi):
    class OutputSerializer(serializers.Serializer):
        retire = serializers.BooleanField(help_text="true: stop serving this slice")

    @extend_schema(request=None, responses={200: OutputSerializer, 409: ERROR})
    def post(self, request: Request, worker_id: int) -> Response:
        host = self.host(request)
        retire = services.expert_worker_heartbeat(worker_id=worker_id, host=host)
        return Response({"retire": retire})


class ExpertWorkerLeaveApi(MoeHostApi):
    class InputSerializer(serializers.Serializer):
        reason = serializers.CharField(
            max_length=150,
            required=False,
            allow_blank=True,
            default="",
            help_text="why, in a few words (e.g. the owner came back)",
        )

    class OutputSerializer(serializers.Serializer):
        left = serializers.BooleanField(help_text="false: it had already retired")

    @extend_schema(responses={200: OutputSerializer, 404: ERROR})
    def post(self, request: Request, worker_id: int) -> Response:
        host = self.host(request)
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        left = services.expert_worker_leave(worker_id=worker_id, host=host, reason=serializer.validated_data["reason"])
        return Response({"left": left})


class CoordinatorReportApi(MoeHostApi):
    class InputSerializer(serializers.Serializer):
        class WorkerSerializer(serializers.Serializer):
            id = serializers.IntegerField(min_value=1, max_value=BIGINT_MAX)
            last_serve_ms = serializers.IntegerField(min_value=0, max_value=BIGINT_MAX)
            checks_passed = serializers.IntegerField(
                min_value=0,
                max_value=INT_MAX,
                required=False,
                default=0,
                help_text="its batches recomputed here and found equal",
            )

        class BlameSerializer(serializers.Serializer):
            id = serializers.IntegerField(min_value=1, max_value=BIGINT_MAX)
            reason = serializers.CharField(max_length=500, help_text="what disagreed, e.g. the layer, experts and gap")

        model = serializers.CharField(max_length=200)
        busy = serializers.IntegerField(min_value=0, max_value=INT_MAX)
        workers = WorkerSerializer(many=True, required=False, default=list)
        blamed = BlameSerializer(
            many=True,
            required=False,
            default=list,
            help_text="workers of this model whose recomputed batch disagreed: retired and never handed out again",
        )
        engaged_experts = serializers.IntegerField(
            min_value=0,
            max_value=BIGINT_MAX,
            required=False,
            default=None,
            help_text="since the last report: experts sent to measured workers because their round trip beat "
            "computing them here",
        )
        probed_experts = serializers.IntegerField(
            min_value=0,
            max_value=BIGINT_MAX,
            required=False,
            default=None,
            help_text="since the last report: experts sent only as shadow probes (workers measured and skipped)",
        )

    class OutputSerializer(serializers.Serializer):
        class DispatchSerializer(serializers.Serializer):
            id = serializers.IntegerField()
            layer = serializers.IntegerField()
            first = serializers.IntegerField()
            count = serializers.IntegerField()
            address = serializers.CharField(allow_blank=True)
            relay = serializers.BooleanField()
            last_serve_ms = serializers.IntegerField()
            secret = serializers.CharField()
            check_share = serializers.FloatField(
                allow_null=True,
                help_text="share of its batches to recompute (probation); null: the coordinator's own",
            )

        model = serializers.CharField()
        saturated = serializers.BooleanField()
        boost_held = serializers.BooleanField(
            help_text="the boost is held back: the coordinator sends its workers only probes"
        )
        effective_target = serializers.IntegerField()
        dispatch_map = DispatchSerializer(many=True)

    @extend_schema(responses={200: OutputSerializer})
    def post(self, request: Request) -> Response:
        host = self.host(request)
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        model = services.coordinator_report(
            host=host,
            model_name=data["model"],
            busy=data["busy"],
            workers=data["workers"],
            blamed=data["blamed"],
            engaged_experts=data["engaged_experts"],
            probed_experts=data["probed_experts"],
        )
        return Response(
            {
                "model": model.name,
                "saturated": selectors.is_saturated(model),
                "boost_held": selectors.boost_held(model),
                "effective_target": selectors.effective_target(model),
                "dispatch_map": selectors.dispatch_map(model),
            }
        )
