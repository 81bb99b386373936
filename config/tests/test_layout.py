"""The house's walls, checked from outside: what the gateway loads, and where old
addresses lead."""

from __future__ import annotations

import subprocess
import sys

import pytest

from testkit.stack import ROOT

# Every module of every gateway app that Django or a request can reach.
GATEWAY_MODULES = [
    f"{app}.{module}"
    for app, modules in {
        "accounts": ["models", "services", "selectors", "apis", "admin"],
        "catalog": ["models", "selectors", "money", "pricing", "tokenizer", "seed"],
        "hosts": ["models", "services", "selectors", "apis", "admin"],
        "billing": ["models", "services", "selectors", "apis", "admin", "tasks", "webhooks"],
        "mesh": [
            "models",
            "admin",
            "urls",
            "experts.services",
            "experts.apis",
            "experts.consumers",
            "rings.services",
            "rings.apis",
        ],
        "marketplace": [
            "models",
            "services",
            "openai.admission",
            "selectors",
            "trust.routing",
            "openai.apis",
            "hostdoor.host_apis",
            "openai.usage_apis",
            "openai.consumers",
            "hostdoor.consumers",
            "openai.streaming",
            "admin",
            "tasks",
        ],
        "web": ["views", "selectors"],
        "config": ["urls", "asgi", "celery"],
    }.items()
    for module in modules
]


class GatewayImportTests:
    def test_it_never_loads_torch(self) -> None:
        code = (
            "import os, sys, importlib, django; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'config.settings');"
            f" django.setup(); [importlib.import_module(m) for m in {GATEWAY_MODULES!r}];"
            " print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'sentence_transformers')))"
        )
        result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "[]"


@pytest.mark.django_db
class OldAdminAddressTests:
    def test_the_catalog_and_keys_admin_pages_moved_with_their_apps(self, client) -> None:
        response = client.get("/admin/marketplace/catalogmodel/3/change/?x=1")
        assert (response.status_code, response["Location"]) == (301, "/admin/catalog/catalogmodel/3/change/?x=1")
        assert client.get("/admin/marketplace/apikey/")["Location"] == "/admin/accounts/apikey/"
