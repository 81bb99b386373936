"""Into the queue and out of it unclaimed: admission (the worst-case hold, the request and
its first job in one commit), a job's limits and routing decision written with it, the
offers that wake hosts, re-offers when an offer lapses, and what a queue timeout does (the
next fallback model, or an honest unbilled failure). Canaries queue through here too, so it
sits below them.
"""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from accounts.models import ApiKey
from billing import services as billing
from catalog.models import CatalogModel
from catalog.pricing import price
from catalog.rendering import prompt_count, prompt_fragments, render_instant
from catalog.tokenizer import tokenizer_for
from core.db import ChainMissed, Step, chain_run, insert_step
from core.errors import DomainError
from core.events import announce_on_commit, host_group, queue_group, request_group
from hosts.selectors import warm_host_counts
from marketplace.lifecycle.errors import HostFailed, QueueTimeout
from marketplace.lifecycle.transitions import request_fail
from marketplace.models import CHOICE_OF, Job, Liveness, Request
from marketplace.trust import prefixes, routing
from protocol.rendering import TemplateRefused


def estimate_ucents(*, model: CatalogModel, prompt_tokens: int, max_tokens: int, cached_tokens: int = 0) -> int:
    """Upper bound of the cost: every prompt token (the cached ones at their price) plus every
    allowed output token."""
    return price(model, prompt_tokens=prompt_tokens, completion_tokens=max_tokens, cached_tokens=cached_tokens)


def new_public_id(kind: str) -> str:
    starts: dict[str, str] = {Request.Kind.CHAT: "chatcmpl-", Request.Kind.EMBEDDINGS: "emb-"}
    return starts.get(kind, "cmpl-") + secrets.token_hex(12)


def request_submit(
    *,
    public_id: str,
    api_key: ApiKey,
    model: CatalogModel,
    kind: str,
    messages: list | None,
    prompt: str | None,
    params: dict,
    stream: bool,
    prompt_tokens: int,
    inputs: list[str] | None = None,
    only_host_id: int | None = None,
    trusted_only: bool = False,
    prefix_hashes: list[str] | None = None,
) -> Request:
    """Admit a request: hold its worst-case cost, then queue its first job (a canary's,
    `only_host_id`, for its host alone; `trusted_only`: for trusted hosts only).
    `prefix_hashes` (its prompt's blocks, `trust.prefixes`): a host holding a prefix of it for
    this account is offered it first, and then that prefix is its `cached_tokens`.

    Raises InsufficientCredit / KeyLimitExceeded (→ 402) before anything is
    queued; the hold, request and job commit together or not at all. The usual
    admission is one statement chain (`_request_admit_chained`: one round trip on
    PostgreSQL); a key with limits, a refusal and a customer's first request take the
    locked path (`billing.hold_place`), which counts the limits and says why.
    """
    request = Request(
        public_id=public_id,
        user=api_key.user,
        api_key=api_key,
        model=model,
        kind=kind,
        stream=stream,
        messages=messages,
        prompt=prompt,
        inputs=inputs,
        params=params,
        prompt_tokens=prompt_tokens,
        prefix_hashes=prefix_hashes or None,
    )
    limits = job_limits(request=request, model=model, now=timezone.now())  # (a process's first reads the vocabulary)
    # Routing reads before the account's row is locked: a customer's admissions queue on
    # that lock, so it is held for the writes only. The offer's clock starts here.
    holders: dict[int, int] = {}
    if prefix_hashes and only_host_id is None:
        holders = prefixes.prefix_holders(user_id=api_key.user_id, model_id=model.pk, hashes=prefix_hashes)
    placement = _placement(
        model=model,
        only_host_id=only_host_id,
        avoid_host_id=None,
        trusted_only=trusted_only,
        beside_host_id=_first_choice_host(request),
        prefix_hosts=holders,
    )
    held = holders.get(placement["offered_host_id"], 0) if placement["offered_host_id"] is not None else 0
    request.cached_tokens = prefixes.cached_tokens(prefix_tokens=held, prompt_tokens=prompt_tokens)
    estimate = estimate_ucents(
        model=model,
        prompt_tokens=request.prompt_tokens_billed,
        max_tokens=params["max_tokens"],
        cached_tokens=request.cached_tokens_billed,
    )
    request.estimate_ucents = estimate
    job = Job(request=request, model=model, trusted_only=trusted_only, only_host_id=only_host_id, **placement, **limits)
    hold = billing.hold_steps(user_id=api_key.user_id, api_key=api_key, amount_ucents=estimate)
    if hold is not None and _request_admit_chained(request=request, job=job, hold=hold):
        return request
    return _request_admit_locked(request=request, job=job)


def _request_admit_chained(*, request: Request, job: Job, hold: list[Step]) -> bool:
    """The hold, the request and its job as one chain of compare-and-sets and inserts;
    False (nothing written) when a step refused."""
    steps = [
        *hold,
        insert_step("request", request, refs={"hold_id": "hold"}),
        insert_step("job", job, refs={"request_id": "request"}),
    ]
    try:
        with transaction.atomic():
            ids = chain_run(steps)
            request.pk, request.hold_id, job.pk = ids["request"], ids["hold"], ids["job"]
            job.request = request
            job_announce(job)
    except ChainMissed:
        return False
    return True


@transaction.atomic
def _request_admit_locked(*, request: Request, job: Job) -> Request:
    request.hold = billing.hold_place(user=request.user, api_key=request.api_key, amount_ucents=request.estimate_ucents)
    request.save(force_insert=True)
    job.save(force_insert=True)
    job_announce(job)
    return request


def _placement(
    *,
    model: CatalogModel,
    only_host_id: int | None,
    avoid_host_id: int | None,
    trusted_only: bool,
    beside_host_id: int | None = None,
    prefix_hosts: dict[int, int] | None = None,
) -> dict:
    if only_host_id is not None:  # a canary: offered to its host alone, for as long as it waits
        return {"offered_host_id": only_host_id, "offer_until": None, "warm_until": None}
    return routing.placement(
        model=model,
        avoid_host_id=avoid_host_id,
        trusted_only=trusted_only,
        beside_host_id=beside_host_id,
        prefix_hosts=prefix_hosts,
    )


def _first_choice_host(request: Request) -> int | None:
    """For a later choice of an `n` request, the host its first choice went to (or was offered
    to): the same prompt, read once where a host serves several sequences."""
    first = (request.params or {}).get(CHOICE_OF)
    if not first:
        return None
    found = (
        Job.objects.filter(request__public_id=first).order_by("-pk").values_list("host_id", "offered_host_id").first()
    )
    return (found[0] or found[1]) if found else None


def job_limits(*, request: Request, model: CatalogModel, now: datetime) -> dict:
    """What no host can exceed on this job, as its row's fields: the text it may send
    (`max_tokens` of the tokenizer's longest token) and its deadline (the queue timeout, a
    start allowance for loading and prefill, and `max_tokens` at the slowest acceptable
    speed). A continuation gets the whole budget again (it regenerates the prompt)."""
    max_tokens = int(request.params.get("max_tokens") or 0)
    seconds = (
        settings.QUEUE_TIMEOUT_SECONDS
        + settings.JOB_START_ALLOWANCE_SECONDS
        + max_tokens / settings.JOB_MIN_TOKENS_PER_SECOND
    )
    max_chars = None
    if request.kind != Request.Kind.EMBEDDINGS:
        max_chars = max_tokens * (model.longest_token_chars or tokenizer_for(model.tokenizer).longest_token_chars())
    return {"max_chars": max_chars, "deadline_at": now + timedelta(seconds=seconds)}


def job_queue(
    *,
    request: Request,
    model: CatalogModel,
    placement: dict | None = None,
    trusted_only: bool = False,
    **fields: object,
) -> Job:
    """Create a request's next job already routed (one INSERT carries the routing decision,
    `placement`, decided here unless given, and the job's limits), and wake whoever may
    take it (after the commit)."""
    if placement is None:
        avoid, only = fields.get("avoid_host_id"), fields.get("only_host_id")
        placement = _placement(
            model=model,
            only_host_id=only if isinstance(only, int) else None,
            avoid_host_id=avoid if isinstance(avoid, int) else None,
            trusted_only=trusted_only,
            beside_host_id=_first_choice_host(request) if avoid is None else None,
        )
    limits = job_limits(request=request, model=model, now=timezone.now())
    job = Job.objects.create(request=request, model=model, trusted_only=trusted_only, **fields, **placement, **limits)
    job_announce(job)
    return job


def job_announce(job: Job) -> None:
    """Wake whoever may take a queued job, after the commit."""
    offered = job.offered_host_id
    if offered is not None:  # one host's long-polls: one of them per gateway process need look
        announce_on_commit(host_group(offered), {"type": "job.queued", "offer": f"{job.pk}.{job.requeue}"})
    else:
        announce_on_commit(queue_group(job.model_id), {"type": "job.queued"})


def job_reoffer(*, job_id: int) -> int | None:
    """Offer a queued job whose offer lapsed (or that had none) to a warm host with a free
    slot, chosen by the model's strategy, so the strategy orders every warm claim and not
    only the first offer (seed 002). The host that let the offer lapse and a continuation's
    dead host are passed over; a canary stays its host's. A compare-and-set on the lapsed
    offer: a claim or another re-offer that got there first wins. Returns the host offered."""
    now = timezone.now()
    job = Job.objects.select_related("model").filter(Liveness.offer_lapsed(now), pk=job_id).first()
    if job is None or job.only_host_id is not None:
        return None
    passed_over = frozenset({job.offered_host_id, job.avoid_host_id})
    pool = routing.candidates(model=job.model, now=now, trusted_only=job.trusted_only, passed_over=passed_over)
    chosen = routing.pick(model=job.model, pool=pool, now=now)
    if chosen is None:
        return None
    if not Job.objects.filter(
        pk=job.pk, status=Job.Status.QUEUED, offered_host_id=job.offered_host_id, offer_until=job.offer_until
    ).update(offered_host_id=chosen.host_id, offer_until=now + timedelta(seconds=settings.ROUTING_OFFER_SECONDS)):
        return None
    job.offered_host_id = chosen.host_id
    job_announce(job)
    return chosen.host_id


@transaction.atomic
def request_expire_unclaimed(*, request_id: int) -> bool:
    """No host claimed the request (or its continuation) in time: fail it, release the hold."""
    job = Job.objects.filter(request_id=request_id, status=Job.Status.QUEUED).first()
    if job is None:
        return False
    if not Job.objects.filter(pk=job.pk, status=Job.Status.QUEUED).update(
        status=Job.Status.FAILED, finished_at=timezone.now(), fail_reason="not claimed in time"
    ):
        return False
    if job.attempt == 1 and request_reroute(
        request_id=request_id, requeue=job.requeue + 1, trusted_only=job.trusted_only
    ):
        return True
    wait = f"{settings.QUEUE_TIMEOUT_SECONDS:g} seconds"
    before = (
        Job.objects.filter(request_id=request_id, attempt=job.attempt, requeue=job.requeue - 1)
        .values_list("fail_reason", flat=True)
        .first()
    )
    request = Request.objects.select_related("model").get(pk=request_id)
    if job.attempt > 1 or (job.requeue > 0 and before != "not claimed in time"):  # (a fallback's queue is a queue)
        code, message = (
            HostFailed.code,
            f"The host serving this request failed and no other host took over within {wait}; nothing was billed.",
        )
    else:
        code = QueueTimeout.code
        message = f"No host claimed this request within {wait}; nothing was billed. " + _nobody_claimed_why(
            model=request.model, trusted_only=job.trusted_only
        )
    return request_fail(request=request, code=code, message=message)


def _nobody_claimed_why(*, model: CatalogModel, trusted_only: bool) -> str:
    """Why a request of `model` was not claimed, as its caller reads it: no host serving the
    model is online (waiting will not help), or those online were busy (trying again may)."""
    online = warm_host_counts(model_id=model.pk).get(model.pk, {}).get("online", 0)
    if not online:
        return f"No host that serves {model.name} is online now; GET /v1/models lists the models being served."
    hosts_online = (
        f"{online} host{'s' if online > 1 else ''} serving {model.name} {'are' if online > 1 else 'is'} online"
    )
    if trusted_only:
        return (
            f"{hosts_online}, but this request takes trusted hosts only and none of those was free; try again shortly."
        )
    return f"{hosts_online} and {'all were' if online > 1 else 'it was'} busy; try again shortly."


def request_reroute(*, request_id: int, requeue: int, trusted_only: bool = False) -> bool:
    """A request whose model's queue timed out goes to its next fallback model (`models`,
    `params["fallbacks"]`), as the first attempt again (its `requeue` counts on): nothing
    was delivered yet. Its hold
    stays when it covers the new model's worst case, and is placed again otherwise (a
    refusal then ends the request with it). Fallbacks that no longer exist, or whose
    context the request does not fit, are skipped. False when none is left."""
    request = (
        Request.objects.select_for_update()
        .select_related("model", "hold", "api_key", "user")
        .filter(pk=request_id, status=Request.Status.QUEUED)
        .first()
    )
    if request is None:
        return False
    fallbacks = list((request.params or {}).get("fallbacks") or [])
    while fallbacks:
        model = CatalogModel.objects.filter(name=fallbacks.pop(0), active=True, kind=CatalogModel.Kind.CHAT).first()
        if model is None:
            continue
        try:
            fragments = prompt_fragments(
                model,
                kind=request.kind,
                messages=request.messages,
                prompt=request.prompt,
                now=render_instant(request.params),
            )
        except TemplateRefused:  # this fallback's template refuses the conversation: the next one may not
            continue
        prompt_tokens = prompt_count(model, fragments)
        max_tokens = int(request.params["max_tokens"])
        if prompt_tokens + max_tokens > model.context_length:
            continue
        estimate = estimate_ucents(
            model=model, prompt_tokens=0 if request.params.get(CHOICE_OF) else prompt_tokens, max_tokens=max_tokens
        )
        if estimate > request.hold.amount_ucents:
            billing.hold_release(hold=request.hold)
            try:
                request.hold = billing.hold_place(user=request.user, api_key=request.api_key, amount_ucents=estimate)
            except DomainError as refused:
                request_fail(
                    request=request, code=refused.code, message=f"Falling back to {model.name}: {refused.message}"
                )
                return True
        request.model, request.prompt_tokens, request.estimate_ucents = model, prompt_tokens, estimate
        request.cached_tokens, request.prefix_hashes = 0, None  # (its blocks were the other model's)
        request.params = {**request.params, "fallbacks": fallbacks}
        request.save(
            update_fields=[
                "model",
                "prompt_tokens",
                "cached_tokens",
                "prefix_hashes",
                "estimate_ucents",
                "params",
                "hold",
            ]
        )
        job_queue(request=request, model=model, trusted_only=trusted_only, requeue=requeue)
        announce_on_commit(request_group(request.public_id), {"type": "request.rerouted", "model": model.name})
        return True
    return False
