"""The API key lookup every admission makes, measured three ways in one run on a fresh test
database: the plain lookup (before e-mail verification), the one the gateway makes now (the
user's pending verification by a LEFT JOIN), and an EXISTS annotation (the first version).
Prints medians; asserts nothing.

    [DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres] .venv/bin/python bench/key_lookup.py
"""

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
import django  # noqa: E402

django.setup()
from django.db import connection  # noqa: E402
from django.db.models import Exists, OuterRef  # noqa: E402
from django.test.runner import DiscoverRunner  # noqa: E402

runner = DiscoverRunner(verbosity=0)
old = runner.setup_databases()
try:
    from accounts.models import ApiKey
    from accounts.selectors import api_key_by_secret
    from catalog.models import CatalogModel
    from catalog.seed import catalog_seed
    from core.secrets import secret_hash
    from testkit.personas import make_customer

    catalog_seed(CatalogModel)
    customers = [make_customer() for _ in range(50)]

    def plain(secret):  # the lookup before e-mail verification
        key = ApiKey.objects.select_related("user").filter(key_hash=secret_hash(secret)).first()
        return key

    from accounts.models import EmailVerification

    def annotated(secret):  # the first version: an EXISTS annotation
        return (
            ApiKey.objects.select_related("user")
            .filter(key_hash=secret_hash(secret))
            .annotate(
                unverified=Exists(EmailVerification.objects.filter(user=OuterRef("user"), verified_at__isnull=True))
            )
            .first()
        )

    def timed(fn):
        out = []
        for _ in range(6):
            t = time.perf_counter()
            for c in customers:
                fn(secret=c.secret) if fn is api_key_by_secret else fn(c.secret)
            out.append((time.perf_counter() - t) / len(customers) * 1000)
        return statistics.median(out)

    res = {"annotated": [], "plain": [], "joined": []}
    for _ in range(5):  # alternating, so the machine's noise hits all three
        res["plain"].append(timed(plain))
        res["joined"].append(timed(api_key_by_secret))
        res["annotated"].append(timed(annotated))
    p, j, a = (statistics.median(res[k]) for k in ("plain", "joined", "annotated"))
    print(
        f"{connection.vendor}: key lookup p50 plain {p:.3f} ms, joined (now) {j:.3f} ms ({j / p:.2f}x), "
        f"EXISTS annotation {a:.3f} ms ({a / p:.2f}x)"
    )
finally:
    runner.teardown_databases(old)
