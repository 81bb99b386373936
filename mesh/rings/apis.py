"""The ring API for hosts: propose a ring on one's own machine, pull a stage assignment,
report where a stage listens and read where the others do (the address exchange: every
call is outbound from the host), report and read stage time use. Each link of a ring has
its own secret (`selectors.link_secret`), handed to that link's two ends only: a stage host
gets its stages' links' with its assignment, the bridge host its links to the head and the
tail from ``GET rings/<id>/secret``. The plan's own secret, which they are derived from,
never leaves the gateway.

Host token auth is the host API's (`hosts.apis.HostApi`); each view parses, calls one service or
selector, renders.
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from core.errors import ApiError
from core.http import BIGINT_MAX, INT_MAX
from core.openapi import ERROR
from hosts.apis import HostApi
from hosts.models import Host
from mesh.rings import selectors, services
from mesh.rings.models import RingPlan


class StageAddressSerializer(serializers.Serializer):
    """Where a stage listens (`selectors.stage_address`): "" until it has said."""

    stage = serializers.IntegerField()
    start = serializers.IntegerField()
    end = serializers.IntegerField()
    host = serializers.IntegerField(allow_null=True, help_text="null: the bridge's own stage")
    address = serializers.CharField(allow_blank=True)
    reported_at = serializers.DateTimeField(allow_null=True)


class StageSharesSerializer(serializers.Serializer):
    """A stage's reported time use (`selectors.stage_shares`)."""

    stage = serializers.IntegerField()
    start = serializers.IntegerField()
    end = serializers.IntegerField()
    host = serializers.IntegerField(allow_null=True)
    hold_s = serializers.FloatField()
    idle_s = serializers.FloatField()
    queue_depth = serializers.IntegerField()
    batches = serializers.IntegerField()
    hold_share = serializers.FloatField(allow_null=True, help_text="near 1: saturated; near 0: starved")
    reported_at = serializers.DateTimeField(allow_null=True)


def _participant_ring(*, ring_id: int, host: Host) -> RingPlan:
    plan = selectors.ring_for_participant(plan_id=ring_id, host=host)
    if plan is None:
        raise ApiError(404, f"No ring {ring_id} that this host serves.", code="ring_not_found")
    return plan


class RingAssignmentApi(HostApi):
    """The stages this host serves: its layer range, the whole plan, the declared widths, its links' secrets."""

    class OutputSerializer(serializers.Serializer):
        class AssignmentSerializer(serializers.Serializer):
            class StageSerializer(serializers.Serializer):
                stage = serializers.IntegerField()
                start = serializers.IntegerField()
                end = serializers.IntegerField()
                host = serializers.IntegerField(allow_null=True)

            class LinksSerializer(serializers.Serializer):
                class LinkSerializer(serializers.Serializer):
                    stage = serializers.IntegerField(help_text="the neighbour at the link's other end")
                    secret = serializers.CharField()

                upstream = LinkSerializer(help_text="the link the previous stage dials this one on")
                downstream = LinkSerializer(help_text="the link this stage dials the next one on")
                bridge = serializers.CharField(
                    allow_null=True, help_text="the bridge's link to the head or the tail; null elsewhere"
                )

            ring = serializers.IntegerField()
            model = serializers.CharField()
            stage = serializers.IntegerField()
            start = serializers.IntegerField()
            end = serializers.IntegerField()
            row_width = serializers.IntegerField()
            micro_batch = serializers.IntegerField()
            n_layers = serializers.IntegerField()
            links = LinksSerializer()
            stages = StageSerializer(many=True)

        assignments = AssignmentSerializer(many=True)

    @extend_schema(responses={200: OutputSerializer})
    def get(self, request: Request) -> Response:
        host = self.host(request)
        return Response(
            {
                "assignments": [
                    {
                        "ring": stage.plan_id,
                        "model": stage.plan.model.name,
                        "stage": stage.index,
                        "start": stage.start,
                        "end": stage.end,
                        "row_width": stage.plan.row_width,
                        "micro_batch": stage.plan.micro_batch,
                        "n_layers": stage.plan.n_layers,
                        "links": selectors.stage_links(stage, len(stage.plan.stages.all())),
                        "stages": [
                            {"stage": s.index, "start": s.start, "end": s.end, "host": s.host_id}
                            for s in stage.plan.stages.all()
                        ],
                    }
                    for stage in selectors.ring_assignments(host=host)
                ]
            }
        )


class RingProposeApi(HostApi):
    """A host's own ring: every stage on this host, which bridges it (reused if it exists)."""

    class InputSerializer(serializers.Serializer):
        model = serializers.CharField(max_length=200)
        stages = serializers.IntegerField(max_value=INT_MAX)
        row_width = serializers.IntegerField(max_value=INT_MAX)
        micro_batch = serializers.IntegerField(max_value=INT_MAX)

    class OutputSerializer(serializers.Serializer):
        ring = serializers.IntegerField()
        model = serializers.CharField()
        row_width = serializers.IntegerField()
        micro_batch = serializers.IntegerField()
        stages = StageAddressSerializer(many=True)

    @extend_schema(responses={201: OutputSerializer})
    def post(self, request: Request) -> Response:
        host = self.host(request)
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        plan = services.ring_plan_propose_local(
            host=host,
            model_name=data["model"],
            n_stages=data["stages"],
            row_width=data["row_width"],
            micro_batch=data["micro_batch"],
        )
        return Response(
            {
                "ring": plan.pk,
                "model": plan.model.name,
                "row_width": plan.row_width,
                "micro_batch": plan.micro_batch,
                "stages": [selectors.stage_address(stage) for stage in plan.stages.all()],
            },
            status=201,
        )


class RingStageAddressApi(HostApi):
    """POST: the host running a stage says where its agent listens (``HOST:PORT``)."""

    class InputSerializer(serializers.Serializer):
        address = serializers.CharField(max_length=300)

    @extend_schema(responses={200: StageAddressSerializer})
    def post(self, request: Request, ring_id: int, index: int) -> Response:
        host = self.host(request)
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        stage = services.ring_stage_address_report(
            plan_id=ring_id, index=index, host=host, address=serializer.validated_data["address"]
        )
        return Response(selectors.stage_address(stage))


class RingStageLeaveApi(HostApi):
    """POST: the host running a stage says it left the address it reported (cleared if still that one)."""

    class InputSerializer(serializers.Serializer):
        address = serializers.CharField(
            max_length=300, help_text="the address the stage reported (as the gateway answered it)"
        )

    class OutputSerializer(serializers.Serializer):
        cleared = serializers.BooleanField(help_text="false: the stage had reported another address since")

    @extend_schema(responses={200: OutputSerializer, 403: ERROR, 404: ERROR})
    def post(self, request: Request, ring_id: int, index: int) -> Response:
        host = self.host(request)
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        cleared = services.ring_stage_leave(
            plan_id=ring_id, index=index, host=host, address=serializer.validated_data["address"]
        )
        return Response({"cleared": cleared})


class RingAddressesApi(HostApi):
    """GET: where every stage of a ring listens, for its participants only (stage hosts dial
    their next stage, the bridge dials the head and the tail)."""

    class OutputSerializer(serializers.Serializer):
        ring = serializers.IntegerField()
        status = serializers.CharField(help_text="active or retired")
        stages = StageAddressSerializer(many=True)

    @extend_schema(responses={200: OutputSerializer})
    def get(self, request: Request, ring_id: int) -> Response:
        plan = _participant_ring(ring_id=ring_id, host=self.host(request))
        return Response(
            {
                "ring": plan.pk,
                "status": plan.status,
                "stages": [selectors.stage_address(stage) for stage in plan.stages.all()],
            }
        )


class RingSecretApi(HostApi):
    """GET: the secrets of the bridge's links to the head and the tail, for the ring's bridge
    host only (a stage host: 403; anyone else: 404)."""

    class OutputSerializer(serializers.Serializer):
        ring = serializers.IntegerField()
        head = serializers.CharField(help_text="the bridge's link to the head (stage 0)")
        tail = serializers.CharField(help_text="the bridge's link to the tail (the last stage)")

    @extend_schema(responses={200: OutputSerializer, 403: ERROR, 404: ERROR, 409: ERROR})
    def get(self, request: Request, ring_id: int) -> Response:
        host = self.host(request)
        plan = _participant_ring(ring_id=ring_id, host=host)
        if plan.bridge_host_id != host.pk:
            raise ApiError(
                403, f"Only ring {ring_id}'s bridge host is handed its bridge's links.", code="not_the_bridge"
            )
        if plan.status != RingPlan.Status.ACTIVE:
            raise ApiError(409, f"Ring {ring_id} is retired; its links are no longer admitted.", code="ring_retired")
        return Response({"ring": plan.pk, **selectors.bridge_links(plan)})


class RingStatsApi(HostApi):
    """GET: every stage's reported hold/idle seconds and queue depth. POST: report them."""

    class InputSerializer(serializers.Serializer):
        class StageSerializer(serializers.Serializer):
            stage = serializers.IntegerField(min_value=0, max_value=INT_MAX)
            hold_s = serializers.FloatField(min_value=0)
            idle_s = serializers.FloatField(min_value=0)
            queue_depth = serializers.IntegerField(min_value=0, max_value=INT_MAX)
            batches = serializers.IntegerField(min_value=0, max_value=BIGINT_MAX, required=False, default=0)

        stages = StageSerializer(many=True, allow_empty=False)

    class OutputSerializer(serializers.Serializer):
        ring = serializers.IntegerField()
        model = serializers.CharField()
        row_width = serializers.IntegerField()
        micro_batch = serializers.IntegerField()
        stages = StageSharesSerializer(many=True)

    class ReportedSerializer(serializers.Serializer):
        updated = serializers.IntegerField(help_text="stages whose figures were recorded")

    @extend_schema(responses={200: OutputSerializer})
    def get(self, request: Request, ring_id: int) -> Response:
        plan = _participant_ring(ring_id=ring_id, host=self.host(request))
        return Response(
            {
                "ring": plan.pk,
                "model": plan.model.name,
                "row_width": plan.row_width,
                "micro_batch": plan.micro_batch,
                "stages": [selectors.stage_shares(stage) for stage in plan.stages.all()],
            }
        )

    @extend_schema(responses={200: ReportedSerializer})
    def post(self, request: Request, ring_id: int) -> Response:
        host = self.host(request)
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        updated = services.ring_stats_report(plan_id=ring_id, host=host, stages=serializer.validated_data["stages"])
        return Response({"updated": updated})
