"""The host job API under /hosts/api/ (the host's own registration is `hosts.urls`)."""
from __future__ import annotations

from django.urls import path

from marketplace import host_apis as apis

urlpatterns = [
    path("heartbeat", apis.HeartbeatApi.as_view()),
    path("claim", apis.JobClaimApi.as_view()),
    path("jobs/<int:job_id>/tokens", apis.JobTokensApi.as_view()),
    path("jobs/<int:job_id>/progress", apis.JobProgressApi.as_view()),
    path("jobs/<int:job_id>/complete", apis.JobCompleteApi.as_view()),
    path("jobs/<int:job_id>/fail", apis.JobFailApi.as_view()),
    path("me", apis.HostMeApi.as_view()),
    path("earnings", apis.HostEarningsApi.as_view()),
]
