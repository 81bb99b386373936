from __future__ import annotations

from django.urls import path

from hosts import apis

urlpatterns = [
    path("qualifications", apis.QualificationRegisterApi.as_view()),
]
