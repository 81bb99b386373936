"""A database made before the catalog and API keys left the marketplace app migrates
forward with nothing lost: keys still authenticate, a request held before the move
settles after it, the admin's content types follow, and the books reconcile."""

from __future__ import annotations

import pytest
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from accounts.selectors import api_key_by_secret
from billing import selectors as ledger
from billing.services import credit_grant
from catalog.models import CatalogModel
from catalog.seed import catalog_seed
from conftest import make_host
from core.secrets import secret_hash, secret_new, secret_prefix
from marketplace import services
from marketplace.models import Request
from testkit.evidence import drawn
from testkit.requests import submit_request

# The leaf migrations of every app at the commit before the move.
BEFORE_THE_MOVE = [
    ("marketplace", "0007_seed_embeddings"),
    ("billing", "0003_topups_payouts"),
    ("hosts", "0004_host_catalog"),
    ("mesh", "0004_moe"),
    ("accounts", None),
    ("catalog", None),
]


def migrate(targets: list[tuple[str, str | None]]) -> MigrationExecutor:
    executor = MigrationExecutor(connection)
    executor.migrate(targets)
    return executor


@pytest.mark.django_db(transaction=True)
class CatalogAndKeysMoveTests:
    def test_an_old_database_migrates_forward_without_loss(self, django_user_model) -> None:
        latest = MigrationExecutor(connection).loader.graph.leaf_nodes()
        old = migrate(BEFORE_THE_MOVE).loader.project_state([t for t in BEFORE_THE_MOVE if t[1]]).apps
        try:
            user = django_user_model.objects.create(username="before@example.com")
            credit_grant(user=user, amount_ucents=500_000_000, reference="before-the-move")
            secret = secret_new("el")
            OldKey = old.get_model("marketplace", "ApiKey")
            old_key = OldKey.objects.create(
                user_id=user.pk, name="old", prefix=secret_prefix(secret), key_hash=secret_hash(secret)
            )
            OldCatalogModel = old.get_model("marketplace", "CatalogModel")
            catalog_seed(OldCatalogModel)  # an earlier transactional test may have flushed the seeded rows
            model_id = OldCatalogModel.objects.get(name="gemma-3-270m").pk
            key_type = ContentType.objects.get_or_create(app_label="marketplace", model="apikey")[0].pk
        finally:
            migrate(latest)

        ContentType.objects.clear_cache()
        key = api_key_by_secret(secret=secret)
        assert key is not None and key.pk == old_key.pk and key.user_id == user.pk
        assert ContentType.objects.get(pk=key_type).natural_key() == ("accounts", "apikey")
        request = submit_request(key, CatalogModel.objects.get(pk=model_id), max_tokens=8, seed=1, prompt_tokens=5)
        serving = make_host()
        job = services.job_claim_next(host=serving.host, fingerprint=serving.fingerprint)
        services.job_push_tokens(host=serving.host, job_id=job.pk, seq=0, text="Hello there")
        services.job_complete(host=serving.host, job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk))
        settled = Request.objects.select_related("api_key", "model").get(pk=request.pk)
        assert (settled.status, settled.api_key.prefix, settled.model.name) == ("completed", key.prefix, "gemma-3-270m")
        assert settled.cost_ucents > 0
        assert ledger.reconcile_report() == []
        call_command("reconcile")  # raises CommandError on drift
