from __future__ import annotations

from django.urls import path

from mesh import apis

urlpatterns = [
    path("rings/assignment", apis.RingAssignmentApi.as_view()),
    path("rings/<int:ring_id>/stats", apis.RingStatsApi.as_view()),
]
