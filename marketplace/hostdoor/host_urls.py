"""The host job API under /hosts/api/ (the host's own registration is `hosts.urls`)."""

from __future__ import annotations

from django.urls import path

from core.openapi import documented
from marketplace.hostdoor import host_apis as apis

urlpatterns = [
    path("heartbeat", apis.HeartbeatApi.as_view()),
    path("claim", documented(apis.JobClaimApi)),
    path("jobs/<id:job_id>/tokens", documented(apis.JobTokensApi)),
    path("jobs/<id:job_id>/progress", documented(apis.JobProgressApi)),
    path("jobs/<id:job_id>/complete", documented(apis.JobCompleteApi)),
    path("jobs/<id:job_id>/fail", documented(apis.JobFailApi)),
    path("audits/<id:audit_id>/verdict", documented(apis.AuditVerdictApi)),
    path("ring-inquiries", apis.RingInquiriesWantedApi.as_view()),
    path("ring-inquiries/<id:inquiry_id>/evidence", apis.RingEvidenceApi.as_view()),
    path("ring-inquiries/<id:inquiry_id>/verdict", apis.RingCheckVerdictApi.as_view()),
    path("me", apis.HostMeApi.as_view()),
    path("earnings", apis.HostEarningsApi.as_view()),
]
