"""Holds: a request's worst-case cost reserved before it runs, released or settled after.

A hold adds its amount to `held_ucents` on two rows, the customer's account and the API
key, and must fit each row's `Limit`: the credit (balance less what is held) and the key's
spend cap (the cap less what the key spent and holds). Each limit is written here once
and renders itself in the two forms admission needs: an SQL condition for the statement
chain's compare-and-set (`hold_steps`, the usual path) and a check of a row loaded under
its lock that says why a hold does not fit (`hold_place`, the path that explains). The SQL
is the same on PostgreSQL and SQLite; how a chain runs on each is `core.db.chain_run`'s.
`billing/tests/test_hold_limits.py` holds the two forms to the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from django.db import connection, models, transaction
from django.db.models import F
from django.utils import timezone

from accounts.models import ApiKey
from billing import selectors
from billing.errors import BillingError, InsufficientCredit, KeyLimitExceeded, RateLimited, TooManyStreams
from billing.ledger import account_for_customer
from billing.models import Account, Hold
from catalog.money import usd
from core.db import Step, insert_step

if TYPE_CHECKING:
    from django.contrib.auth.models import User


@dataclass(frozen=True)
class Limit:
    """What a hold must fit in on one row of `model`: `cap` less the `used` columns is what
    is left to hold (a null cap: no limit). The refusal names what is left and the advice."""

    model: type[models.Model]
    cap: str
    used: tuple[str, ...]
    refusal: type[BillingError]
    left_as: str
    advice: str

    def left(self, row: models.Model) -> int | None:
        """What `row` has left to hold; None when it has no limit."""
        cap = getattr(row, self.cap)
        return None if cap is None else cap - sum(getattr(row, column) for column in self.used)

    def unmet(self, row: models.Model, amount_ucents: int) -> BillingError | None:
        """The refusal of a hold of `amount_ucents` that `row` cannot fit, or None when it fits."""
        left = self.left(row)
        if left is None or left >= amount_ucents:
            return None
        return self.refusal(
            f"This request may cost up to {usd(amount_ucents)} but {self.left_as} {usd(max(left, 0))}. {self.advice}"
        )

    def sql(self, amount_ucents: int) -> tuple[str, list]:
        """The limit as an SQL condition on the row's table (the columns unqualified), with its parameters."""
        fits = f"{' - '.join((self.cap, *self.used))} >= %s"
        if self.model._meta.get_field(self.cap).null:
            return f"({self.cap} IS NULL OR {fits})", [amount_ucents]
        return fits, [amount_ucents]


CREDIT = Limit(
    Account,
    cap="balance_ucents",
    used=("held_ucents",),
    refusal=InsufficientCredit,
    left_as="the available credit is",
    advice="Top up, or lower max_tokens.",
)
KEY_CAP = Limit(
    ApiKey,
    cap="spend_cap_ucents",
    used=("spent_ucents", "held_ucents"),
    refusal=KeyLimitExceeded,
    left_as="this API key's spend cap leaves",
    advice="Raise the key's cap or use another key.",
)
# A key's limits that are counted, not summed: only `hold_place` counts them, under the key's lock.
COUNTED_KEY_LIMITS = ("max_concurrent", "rate_limit_per_minute")


def hold_place(*, user: User, api_key: ApiKey, amount_ucents: int) -> Hold:
    """Reserve `amount_ucents` against the balance and the key's cap, or refuse.

    Must run inside the caller's transaction (the request row is created in the
    same one). Locks the account, then the key; the key's limits are counted
    under the key's lock, so racing admissions cannot both take the last slot.
    Raises TooManyStreams / RateLimited (429), InsufficientCredit /
    KeyLimitExceeded (402).
    """
    account = Account.objects.select_for_update().filter(kind=Account.Kind.CUSTOMER, user=user).first()
    if account is None:  # the first request of a customer without an account yet
        account = Account.objects.select_for_update().get(pk=account_for_customer(user=user).pk)
    key = ApiKey.objects.select_for_update().get(pk=api_key.pk)
    _key_limits_check(key=key)
    refusal = CREDIT.unmet(account, amount_ucents) or KEY_CAP.unmet(key, amount_ucents)
    if refusal is not None:
        raise refusal
    Account.objects.filter(pk=account.pk).update(held_ucents=F("held_ucents") + amount_ucents)
    ApiKey.objects.filter(pk=key.pk).update(held_ucents=F("held_ucents") + amount_ucents)
    return Hold.objects.create(account=account, api_key=key, amount_ucents=amount_ucents)


def hold_steps(*, user_id: int, api_key: ApiKey, amount_ucents: int) -> list[Step] | None:
    """`hold_place` as compare-and-set steps of a statement chain (`core.db.chain_run`),
    for a key with no concurrency or rate limit (those are counted under the key's lock:
    `hold_place`); None for a key that has one. The steps are named `account`, `api_key`
    and `hold`; the account and key rows are locked in the usual order by their UPDATEs,
    each of which refuses (no row) where `hold_place` would raise. On a miss the caller
    rolls back and asks `hold_place`, which says why."""
    if any(getattr(api_key, limit) is not None for limit in COUNTED_KEY_LIMITS):
        return None
    uncounted = " AND ".join(f"{limit} IS NULL" for limit in COUNTED_KEY_LIMITS)
    account = _held_step(
        "account", CREDIT, "kind = %s AND user_id = %s", [Account.Kind.CUSTOMER, user_id], amount_ucents
    )
    key = _held_step("api_key", KEY_CAP, f"id = %s AND {uncounted}", [api_key.pk], amount_ucents)
    hold = insert_step(
        "hold", Hold(amount_ucents=amount_ucents), refs={"account_id": "account", "api_key_id": "api_key"}
    )
    return [account, key, hold]


def _held_step(name: str, limit: Limit, where: str, params: list, amount_ucents: int) -> Step:
    """Hold `amount_ucents` on the row of `limit.model` that `where` selects, if it fits its limit."""
    fits, fits_params = limit.sql(amount_ucents)
    table = connection.ops.quote_name(limit.model._meta.db_table)
    return Step(
        name,
        f"UPDATE {table} SET held_ucents = held_ucents + %s WHERE {where} AND {fits} RETURNING id",
        [amount_ucents, *params, *fits_params],
    )


def _key_limits_check(*, key: ApiKey) -> None:
    """Refuse when the key has `max_concurrent` active holds, or has placed
    `rate_limit_per_minute` holds in the last 60 s. Caller holds the key's row lock."""
    if key.max_concurrent is not None:
        active = Hold.objects.filter(api_key=key, status=Hold.Status.ACTIVE).count()
        if active >= key.max_concurrent:
            raise TooManyStreams(
                f"This API key already has {active} requests in flight; its limit is {key.max_concurrent}. "
                "Wait for one to finish."
            )
    if key.rate_limit_per_minute is not None:
        headers = selectors.rate_headers(key=key)
        if headers["x-ratelimit-remaining-requests"] == "0":
            refusal = RateLimited(
                f"This API key is limited to {key.rate_limit_per_minute} requests per minute. "
                f"Retry in {headers['x-ratelimit-reset-requests']}."
            )
            refusal.retry_after = max(int(headers["x-ratelimit-reset-requests"][:-1]), 1)
            refusal.headers = headers
            raise refusal


@transaction.atomic
def hold_release(*, hold: Hold) -> bool:
    """Give the reserved credit back (request failed or expired): a compare-and-set from
    active, so it is idempotent; False if the hold was already closed."""
    closed = Hold.objects.filter(pk=hold.pk, status=Hold.Status.ACTIVE).update(
        status=Hold.Status.RELEASED, closed_at=timezone.now()
    )
    if not closed:
        return False
    Account.objects.filter(pk=hold.account_id).update(held_ucents=F("held_ucents") - hold.amount_ucents)
    ApiKey.objects.filter(pk=hold.api_key_id).update(held_ucents=F("held_ucents") - hold.amount_ucents)
    return True


# --- reconciliation steps (Celery beat calls the tick; tests call the steps) ----------


def orphaned_hold_release_one() -> bool:
    """Release one active hold whose request already ended (completed or failed)."""
    hold = (
        Hold.objects.filter(status=Hold.Status.ACTIVE, request__status__in=["completed", "failed"])
        .order_by("pk")
        .first()
    )
    return hold is not None and hold_release(hold=hold)
