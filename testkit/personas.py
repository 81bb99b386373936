"""The personas every test and bench uses: a customer who pays, a host who serves."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (Django is imported only when a persona is made)
    from django.contrib.auth.models import User

    from accounts.models import ApiKey
    from hosts.models import Host


@dataclass
class Customer:
    user: User
    key: ApiKey
    secret: str


@dataclass
class ServingHost:
    host: Host
    token: str
    fingerprint: str


def make_customer(
    *, credit_ucents: int = 500_000_000, cap_ucents: int | None = None, email: str | None = None
) -> Customer:
    from django.contrib.auth import get_user_model

    from accounts.services import api_key_create
    from billing.services import credit_grant

    user = get_user_model().objects.create(username=email or f"c-{uuid.uuid4().hex[:8]}@example.com")
    if credit_ucents:
        credit_grant(user=user, amount_ucents=credit_ucents, reference=f"test-{uuid.uuid4()}")
    new = api_key_create(user=user, name="test", spend_cap_ucents=cap_ucents)
    return Customer(user=user, key=new.key, secret=new.secret)


def make_host(
    *, qualified: bool = True, name: str | None = None, fingerprint: str = "f" * 64, trusted: bool = False
) -> ServingHost:
    """A host in probation, like every new stranger's (`trusted`: out of it already)."""
    from hosts.services import host_create, qualification_register
    from marketplace.trust.reputation import trust_grant
    from protocol.catalog import MODEL_FILES

    new = host_create(email=f"h-{uuid.uuid4().hex[:8]}@example.com", name=name or "rig")
    if qualified:
        qualification_register(
            host=new.host,
            model_name="gemma-3-270m",
            fingerprint=fingerprint,
            benchmark={"prompt_tps": 500.0, "gen_tps": 40.0, "ttft_ms": 50.0, "memory_mb": 400.0, "threads": 2},
            machine={},
            sha256=MODEL_FILES["gemma-3-270m"]["sha256"],  # the catalog's file
        )
    if trusted:
        trust_grant(host_id=new.host.pk)
        new.host.refresh_from_db()
    return ServingHost(host=new.host, token=new.token, fingerprint=fingerprint)


def present(serving: ServingHost) -> ServingHost:
    """The host as if it had just sent a heartbeat: only a present host may claim work."""
    from django.utils import timezone

    from hosts.models import Host

    Host.objects.filter(pk=serving.host.pk).update(last_heartbeat_at=timezone.now())
    serving.host.refresh_from_db()
    return serving
