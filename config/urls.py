from __future__ import annotations

from django.contrib import admin
from django.urls import include, path, re_path
from django.views.generic import RedirectView

from marketplace import host_apis, usage_apis

urlpatterns = [
    # the catalog and API keys left the marketplace app: old admin bookmarks still land
    re_path(r"^admin/marketplace/catalogmodel/(?P<rest>.*)$", RedirectView.as_view(url="/admin/catalog/catalogmodel/%(rest)s", query_string=True, permanent=True)),
    re_path(r"^admin/marketplace/apikey/(?P<rest>.*)$", RedirectView.as_view(url="/admin/accounts/apikey/%(rest)s", query_string=True, permanent=True)),
    path("admin/", admin.site.urls),
    path("v1/usage", usage_apis.UsageApi.as_view()),
    path("v1/usage.csv", usage_apis.UsageCsvApi.as_view()),
    path("v1/", include("marketplace.urls")),
    path("hosts/api/", include("hosts.urls")),
    path("hosts/api/", include("marketplace.host_urls")),
    path("api/", include("mesh.urls")),
    path("billing/api/host/statement", host_apis.HostStatementApi.as_view()),
    path("billing/", include("billing.urls")),
    path("", include("web.urls")),  # last: the site's pages own the root
]
