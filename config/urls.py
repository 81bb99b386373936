from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.urls import include, path, re_path
from django.views.defaults import bad_request, page_not_found
from django.views.generic import RedirectView
from drf_spectacular.renderers import (
    OpenApiJsonRenderer,
    OpenApiJsonRenderer2,
    OpenApiYamlRenderer,
    OpenApiYamlRenderer2,
)
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from config.health import healthz
from config.middleware import API_PATHS
from core.errors import ApiError
from core.openapi import CachedSchemaGenerator
from marketplace import metrics
from marketplace.hostdoor import host_apis
from marketplace.openai import usage_apis

urlpatterns = [
    # the catalog and API keys left the marketplace app: old admin bookmarks still land
    re_path(
        r"^admin/marketplace/catalogmodel/(?P<rest>.*)$",
        RedirectView.as_view(url="/admin/catalog/catalogmodel/%(rest)s", query_string=True, permanent=True),
    ),
    re_path(
        r"^admin/marketplace/apikey/(?P<rest>.*)$",
        RedirectView.as_view(url="/admin/accounts/apikey/%(rest)s", query_string=True, permanent=True),
    ),
    path("admin/", admin.site.urls),
    path("healthz", healthz),  # the load balancer's health check: no key, no database
    path("metrics", metrics.metrics_view),
    path("v1/usage", usage_apis.UsageApi.as_view()),
    path("v1/usage.csv", usage_apis.UsageCsvApi.as_view()),
    path("v1/", include("marketplace.openai.urls")),
    path("hosts/api/", include("hosts.urls")),
    path("hosts/api/", include("marketplace.hostdoor.host_urls")),
    # the OpenAPI schema: JSON, or YAML with ?format=yaml (generated once per process)
    path(
        "api/schema/",
        SpectacularAPIView.as_view(
            renderer_classes=[OpenApiJsonRenderer, OpenApiJsonRenderer2, OpenApiYamlRenderer, OpenApiYamlRenderer2],
            generator_class=CachedSchemaGenerator,
        ),
        name="schema",
    ),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api_docs"),
    path("api/", include("mesh.urls")),
    path("billing/api/host/statement", host_apis.HostStatementApi.as_view()),
    path("billing/", include("billing.urls")),
    path("", include("web.urls")),  # last: the site's pages own the root
]


def not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    """An API path that names nothing (or an id of the wrong shape, `jobs/abc/tokens`) is
    answered in the API's error format, like every other refusal; a page, with the site's page."""
    if request.path.startswith(API_PATHS):
        return ApiError(
            404, f"Nothing at {request.path}: see /api/schema/ for the API's paths.", code="not_found"
        ).response()
    return page_not_found(request, exception)


handler404 = not_found


def refused(request: HttpRequest, exception: Exception) -> HttpResponse:
    """A request Django itself refuses before any view (a Host header it does not serve, or one
    that is no host name at all): on an API path in the API's error format, like every other
    refusal; on a page, with the site's page."""
    if request.path.startswith(API_PATHS):
        return ApiError(
            400,
            "The request was refused before any view read it (its Host header is not one this "
            "gateway serves, or is malformed).",
            code="bad_request",
        ).response()
    return bad_request(request, exception)


handler400 = refused
