from __future__ import annotations

from django.urls import path

from mesh import apis

urlpatterns = [
    path("rings/own", apis.RingProposeApi.as_view()),
    path("rings/assignment", apis.RingAssignmentApi.as_view()),
    path("rings/<int:ring_id>/addresses", apis.RingAddressesApi.as_view()),
    path("rings/<int:ring_id>/stages/<int:index>/address", apis.RingStageAddressApi.as_view()),
    path("rings/<int:ring_id>/stats", apis.RingStatsApi.as_view()),
]

from mesh import moe_apis  # noqa: E402  the expert market (MoE); kept apart from the ring's routes

urlpatterns += [
    path("moe/recruitment", moe_apis.MoeRecruitmentApi.as_view()),
    path("moe/coordinator-report", moe_apis.CoordinatorReportApi.as_view()),
    path("expert-demand", moe_apis.ExpertDemandApi.as_view()),
    path("expert-volunteer", moe_apis.ExpertVolunteerApi.as_view()),
    path("expert-workers/<int:worker_id>/slice", moe_apis.ExpertSliceApi.as_view()),
    path("expert-workers/<int:worker_id>/register", moe_apis.ExpertWorkerRegisterApi.as_view()),
    path("expert-workers/<int:worker_id>/heartbeat", moe_apis.ExpertWorkerHeartbeatApi.as_view()),
]
