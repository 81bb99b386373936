from __future__ import annotations

from django.contrib import admin
from django.urls import include, path

from billing import apis as billing_apis

urlpatterns = [
    path("admin/", admin.site.urls),
    path("v1/usage", billing_apis.UsageApi.as_view()),
    path("v1/usage.csv", billing_apis.UsageCsvApi.as_view()),
    path("v1/", include("marketplace.urls")),
    path("hosts/api/", include("hosts.urls")),
    path("api/", include("mesh.urls")),
    path("billing/", include("billing.urls")),
    path("", include("web.urls")),  # last: the site's pages own the root
]
