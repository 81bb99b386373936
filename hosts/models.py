"""Host machines, their tokens, and the models they qualified on their hardware.

The rules on a host's state are written here once each, as a `Rule` (a list of
`Condition`s on its columns) that renders itself in every form a caller needs: a `Q` for
querysets, SQL on an aliased host table for the plain statements routing and claims run,
and a test of a loaded row. `hosts/tests/test_predicates.py` holds the forms to the same
hosts in every state.

    connected   heard from within HOST_OFFLINE_AFTER_SECONDS
    accepting   not banned, in maintenance or paused: takes work when asked (a claim is
                its own sign of life, so the claim checks this and not the heartbeat)
    online      connected and accepting: may be offered work
    trusted     out of probation (`marketplace.trust.reputation`) and not banned
    claim cap   the jobs it may run at once: its slots, bounded by probation or trust
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import reduce
from operator import and_

from django.conf import settings
from django.db import connection, models
from django.db.models.functions import Greatest, Least
from django.utils import timezone

SQL_OPERATORS = {"exact": "=", "gte": ">="}


@dataclass(frozen=True)
class Condition:
    """One condition on one host field, the unit the host rules are written in; `fails_as`
    names a host that fails it (`Rule.unmet`: a host's status, its standing)."""

    field: str
    lookup: str  # "exact", "gte" or "isnull" (the lookups the rules need)
    value: object
    fails_as: str

    def q(self) -> models.Q:
        return models.Q(**{f"{self.field}__{self.lookup}": self.value})

    def sql(self, alias: str) -> tuple[str, list]:
        column = f"{alias}.{self.field}"  # (the rules' fields are plain columns of their own name)
        if self.lookup == "isnull":
            return f"{column} IS {'' if self.value else 'NOT '}NULL", []
        value = connection.ops.adapt_datetimefield_value(self.value) if isinstance(self.value, datetime) else self.value
        return f"{column} {SQL_OPERATORS[self.lookup]} %s", [value]

    def holds(self, host: Host) -> bool:
        value = getattr(host, self.field)
        if self.lookup == "isnull":
            return (value is None) is self.value
        if self.lookup == "gte":
            return value is not None and value >= self.value
        return value == self.value


@dataclass(frozen=True)
class Rule:
    """Conditions that must all hold, in the order a host that fails them is named by."""

    conditions: tuple[Condition, ...]

    def __add__(self, other: Rule) -> Rule:
        return Rule(self.conditions + other.conditions)

    def q(self) -> models.Q:
        return reduce(and_, (condition.q() for condition in self.conditions), models.Q())

    def sql(self, *, alias: str) -> tuple[str, list]:
        """The rule as SQL conditions on the host table under `alias`, with their parameters."""
        parts = [condition.sql(alias) for condition in self.conditions]
        return " AND ".join(sql for sql, _ in parts), [param for _, params in parts for param in params]

    def unmet(self, host: Host) -> str | None:
        """What the first condition `host` fails calls it, or None when it meets them all."""
        return next((condition.fails_as for condition in self.conditions if not condition.holds(host)), None)

    def holds(self, host: Host) -> bool:
        return self.unmet(host) is None


def connected_since(now: datetime) -> datetime:
    return now - timedelta(seconds=settings.HOST_OFFLINE_AFTER_SECONDS)


def connected_rule(now: datetime) -> Rule:
    return Rule((Condition("last_heartbeat_at", "gte", connected_since(now), "offline"),))


NOT_BANNED = Condition("banned_at", "isnull", True, "banned")
ACCEPTING = Rule(
    (
        NOT_BANNED,
        Condition("maintenance_since", "isnull", True, "maintenance"),
        Condition("paused", "exact", False, "paused"),
    )
)
TRUSTED = Rule((NOT_BANNED, Condition("trusted_at", "isnull", False, "probation")))


def online_rule(now: datetime) -> Rule:
    """Accepting, then connected: a host that fails both is named by its own standing state
    (banned, maintenance, paused), which outlasts a silence, rather than by "offline"."""
    return ACCEPTING + connected_rule(now)


def online_sql(*, alias: str, now: datetime) -> tuple[str, list]:
    """`HostQuerySet.online` as SQL on the host table under `alias` (routing's plain statement)."""
    return online_rule(now).sql(alias=alias)


def claim_cap_bounds() -> tuple[int, int]:
    """The most jobs at once a host in probation, and a trusted one, may run whatever its slots."""
    return settings.HOST_PROBATION_MAX_JOBS, settings.HOST_TRUSTED_MAX_JOBS


def claim_cap_expression() -> models.Func:
    """`Host.claim_cap` as an ORM expression (to annotate a queryset with)."""
    probation, trusted = claim_cap_bounds()
    integer = models.IntegerField()
    bound = models.Case(
        models.When(TRUSTED.q(), then=models.Value(trusted)), default=models.Value(probation), output_field=integer
    )
    return Greatest(models.Value(1), Least(models.F("slots"), bound, output_field=integer), output_field=integer)


def claim_cap_sql(*, alias: str) -> tuple[str, list]:
    """`Host.claim_cap` as an SQL expression on the host table under `alias` (the claim's
    statement), with its parameters."""
    least, greatest = ("MIN", "MAX") if connection.vendor == "sqlite" else ("LEAST", "GREATEST")
    trusted, params = TRUSTED.sql(alias=alias)
    probation_bound, trusted_bound = claim_cap_bounds()
    return (
        f"{greatest}(1, {least}({alias}.slots, CASE WHEN {trusted} THEN %s ELSE %s END))",
        [*params, trusted_bound, probation_bound],
    )


class HostQuerySet(models.QuerySet):
    """The rules above as querysets: which hosts are connected, online and trusted."""

    def connected(self, now: datetime | None = None) -> HostQuerySet:
        return self.filter(connected_rule(now or timezone.now()).q())

    def accepting(self) -> HostQuerySet:
        return self.filter(ACCEPTING.q())

    def online(self, now: datetime | None = None) -> HostQuerySet:
        """Connected, not banned, in maintenance or paused: may be offered work."""
        return self.connected(now).accepting()

    def trusted(self) -> HostQuerySet:
        """Out of probation (see `marketplace.trust.reputation`) and not banned."""
        return self.filter(TRUSTED.q())

    def in_probation(self) -> HostQuerySet:
        """Neither trusted nor banned."""
        return self.exclude(TRUSTED.q()).filter(NOT_BANNED.q())

    def qualified_for(self, model: object) -> HostQuerySet:
        return self.filter(qualifications__model=model)


class Host(models.Model):
    """A machine running mahout. Its token is stored only as a hash.

    A host in maintenance (`maintenance_since` set, always with a reason its owner
    can read) claims no work until it is resumed; its running job still finishes.
    """

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="hosts")
    name = models.CharField(max_length=100)
    token_prefix = models.CharField(max_length=16)
    token_hash = models.CharField(max_length=64, unique=True)
    paused = models.BooleanField(default=False)
    fingerprint = models.CharField(max_length=64, blank=True)
    version = models.CharField(max_length=32, blank=True)
    models_loaded = models.JSONField(default=list, blank=True)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    catalog = models.JSONField(
        default=dict, blank=True, help_text="last readable catalog: installed, qualified, loaded, slots, active_jobs"
    )
    catalog_at = models.DateTimeField(null=True, blank=True, help_text="when a readable catalog last arrived")
    slots = models.PositiveSmallIntegerField(default=1, help_text="jobs the host runs at once (from its catalog)")
    routing_weight = models.FloatField(
        null=True,
        blank=True,
        help_text="operator override of the weighted strategy's weight (default: measured tokens/s)",
    )
    socket_since = models.DateTimeField(
        null=True, blank=True, help_text="when its current WebSocket (presence, batches) opened"
    )
    maintenance_reason = models.CharField(max_length=300, blank=True)
    maintenance_since = models.DateTimeField(null=True, blank=True)
    maintenance_by = models.CharField(max_length=100, blank=True, help_text="who put it in maintenance, e.g. operator")
    trusted_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="when it left probation (enough canaries passed and jobs done); cleared by a failure",
    )
    measured_tps = models.FloatField(
        null=True, blank=True, help_text="tokens/s the gateway measured on its own jobs (moving average), not reported"
    )
    banned_at = models.DateTimeField(
        null=True, blank=True, help_text="operator ban: refused everywhere; only an operator lifts it"
    )
    ban_reason = models.CharField(max_length=300, blank=True)
    banned_by = models.CharField(max_length=100, blank=True)
    warm_asked = models.ForeignKey(
        "catalog.CatalogModel",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="a latency-critical model the gateway asked this idle host to keep loaded (deliberate redundancy)",
    )
    warm_asked_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = HostQuerySet.as_manager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["owner", "name"], name="host_name_unique_per_owner"),
            models.CheckConstraint(
                condition=models.Q(maintenance_since__isnull=True) | ~models.Q(maintenance_reason=""),
                name="host_maintenance_has_reason",
            ),
            models.CheckConstraint(
                condition=models.Q(banned_at__isnull=True) | ~models.Q(ban_reason=""), name="host_ban_has_reason"
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def is_connected(self, now: datetime) -> bool:
        return connected_rule(now).holds(self)

    def is_online(self, now: datetime) -> bool:
        return online_rule(now).holds(self)

    def not_online_because(self, now: datetime) -> str | None:
        """banned, maintenance, paused or offline: the first that applies; None when online."""
        return online_rule(now).unmet(self)

    @property
    def is_trusted(self) -> bool:
        return TRUSTED.holds(self)

    @property
    def standing(self) -> str:
        """banned, probation or trusted."""
        return TRUSTED.unmet(self) or "trusted"

    @property
    def claim_cap(self) -> int:
        """Jobs the host may run at once: its slots, bounded by its reputation (at least one)."""
        probation, trusted = claim_cap_bounds()
        return max(1, min(self.slots, trusted if self.is_trusted else probation))

    def catalog_fresh(self, now: datetime) -> bool:
        """Whether the host's catalog can be trusted to say what is loaded."""
        return catalog_fresh(self.catalog_at, now)

    def warm_for(self, model_name: str, now: datetime) -> bool:
        """Warm (its fresh catalog says the model is loaded) or possibly warm (no fresh
        catalog): a host whose catalog cannot be read never counts as cold."""
        return is_warm(catalog=self.catalog, catalog_at=self.catalog_at, model_name=model_name, now=now)


def catalog_fresh(catalog_at: datetime | None, now: datetime) -> bool:
    return catalog_at is not None and now - catalog_at <= timedelta(seconds=settings.CATALOG_STALE_SECONDS)


def is_warm(*, catalog: dict | None, catalog_at: datetime | None, model_name: str, now: datetime) -> bool:
    """The warm rule, for a host row or for its columns read in bulk."""
    return not catalog_fresh(catalog_at, now) or model_name in ((catalog or {}).get("loaded") or [])


class Qualification(models.Model):
    """Proof that a host benchmarked a model on one machine (its fingerprint).

    A host may claim a model only with a qualification whose fingerprint is
    the machine it claims from: a catalog entry or a build is not enough.
    """

    host = models.ForeignKey(Host, on_delete=models.CASCADE, related_name="qualifications")
    model = models.ForeignKey("catalog.CatalogModel", on_delete=models.PROTECT, related_name="qualifications")
    fingerprint = models.CharField(max_length=64)
    prompt_tps = models.FloatField()
    gen_tps = models.FloatField()
    ttft_ms = models.FloatField()
    load_ms = models.FloatField(
        default=0, help_text="how long loading the model took in the benchmark (0: not reported)"
    )
    memory_mb = models.FloatField()
    threads = models.PositiveIntegerField(default=0)
    machine = models.JSONField(default=dict, blank=True)
    sha256 = models.CharField(max_length=64, blank=True, help_text="the file benchmarked (the catalog's pin)")
    device = models.CharField(max_length=100, default="cpu", help_text='where it ran: "cpu" or the GPU\'s name')
    gpu_layers = models.PositiveIntegerField(default=0, help_text="layers offloaded to the GPU")
    vram_mb = models.FloatField(default=0, help_text="GPU memory its layers take")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["host", "model", "fingerprint"], name="one_qualification_per_machine"),
            models.CheckConstraint(condition=models.Q(gen_tps__gt=0), name="qualification_measured"),
        ]

    def __str__(self) -> str:
        return f"{self.host} · {self.model} · {self.fingerprint[:8]}"


class HostAllowance(models.Model):
    """An operator's exception to HOSTS_PER_ACCOUNT for one owner: how many machines their
    account may register, and why."""

    owner = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="host_allowance")
    machines = models.PositiveIntegerField(help_text="machines this owner may register (replaces HOSTS_PER_ACCOUNT)")
    reason = models.CharField(max_length=300, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.owner} · {self.machines} machines"
