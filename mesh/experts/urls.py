from __future__ import annotations

from django.urls import path

from mesh.experts import apis

urlpatterns = [
    path("moe/recruitment", apis.MoeRecruitmentApi.as_view()),
    path("moe/coordinator-report", apis.CoordinatorReportApi.as_view()),
    path("expert-demand", apis.ExpertDemandApi.as_view()),
    path("expert-volunteer", apis.ExpertVolunteerApi.as_view()),
    path("expert-workers/<id:worker_id>/slice", apis.ExpertSliceApi.as_view()),
    path("expert-workers/<id:worker_id>/register", apis.ExpertWorkerRegisterApi.as_view()),
    path("expert-workers/<id:worker_id>/heartbeat", apis.ExpertWorkerHeartbeatApi.as_view()),
    path("expert-workers/<id:worker_id>/leave", apis.ExpertWorkerLeaveApi.as_view()),
]
