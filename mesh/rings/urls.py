from __future__ import annotations

from django.urls import path

from mesh.rings import apis

urlpatterns = [
    path("rings/own", apis.RingProposeApi.as_view()),
    path("rings/assignment", apis.RingAssignmentApi.as_view()),
    path("rings/<id:ring_id>/addresses", apis.RingAddressesApi.as_view()),
    path("rings/<id:ring_id>/secret", apis.RingSecretApi.as_view()),
    path("rings/<id:ring_id>/stages/<id:index>/address", apis.RingStageAddressApi.as_view()),
    path("rings/<id:ring_id>/stages/<id:index>/leave", apis.RingStageLeaveApi.as_view()),
    path("rings/<id:ring_id>/stats", apis.RingStatsApi.as_view()),
]
