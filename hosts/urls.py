from __future__ import annotations

from django.urls import path

from hosts import apis

urlpatterns = [
    path("catalog", apis.CatalogListApi.as_view()),
    path("qualifications", apis.QualificationRegisterApi.as_view()),
]
