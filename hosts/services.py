"""Writes for hosts: creation, qualification, heartbeat."""
from __future__ import annotations

from dataclasses import dataclass

from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from hosts.models import Host, Qualification
from marketplace.models import CatalogModel
from marketplace.secrets import secret_hash, secret_new, secret_prefix


@dataclass(frozen=True)
class NewHost:
    host: Host
    token: str


@transaction.atomic
def host_create(*, email: str, name: str) -> NewHost:
    """Create a host (and its owner's user if new). The token is returned once."""
    User = get_user_model()
    owner, _ = User.objects.get_or_create(username=email, defaults={"email": email})
    token = secret_new("host")
    host = Host.objects.create(owner=owner, name=name, token_prefix=secret_prefix(token), token_hash=secret_hash(token))
    return NewHost(host=host, token=token)


class UnknownModel(Exception):
    pass


@transaction.atomic
def qualification_register(
    *, host: Host, model_name: str, fingerprint: str, benchmark: dict, machine: dict
) -> Qualification:
    """Record (or refresh) a host's benchmark of a model on one machine."""
    model = CatalogModel.objects.filter(name=model_name, active=True).first()
    if model is None:
        raise UnknownModel(f"The model '{model_name}' is not in the catalog.")
    figures = {
        "prompt_tps": float(benchmark["prompt_tps"]),
        "gen_tps": float(benchmark["gen_tps"]),
        "ttft_ms": float(benchmark["ttft_ms"]),
        "memory_mb": float(benchmark["memory_mb"]),
        "threads": int(benchmark.get("threads") or 0),
        "machine": machine,
    }
    qualification, _ = Qualification.objects.update_or_create(
        host=host, model=model, fingerprint=fingerprint, defaults=figures
    )
    Host.objects.filter(pk=host.pk).update(fingerprint=fingerprint)
    return qualification


def host_heartbeat(*, host: Host, fingerprint: str, paused: bool, models_loaded: list[str], version: str) -> Host:
    """Record that the host is alive and whether its owner paused it."""
    Host.objects.filter(pk=host.pk).update(
        fingerprint=fingerprint,
        paused=paused,
        models_loaded=models_loaded,
        version=version[:32],
        last_heartbeat_at=timezone.now(),
    )
    host.refresh_from_db()
    return host
