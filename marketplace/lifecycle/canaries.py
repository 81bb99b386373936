"""Canaries: hidden jobs with known answers, so a host earns only by serving the real model.

A canary is an ordinary request (a prompt from the corpus in `canary_prompts.json`, greedy,
a usual `max_tokens`) made by the platform's own canary customer and offered to one host
alone (`Job.only_host`, never on the wire). It is paid like any job. Its answer is compared
with a reference the operator computed with the real model (`manage.py canary_references`,
llama-cpp-python on the gateway's side, kept per model in `CanaryReference`).

Honest hardware may part from the reference where the model's two best tokens are nearly
tied (`CANARY_TIE_GAP`, in log-probability): the answer must follow the reference until the
two part, and they may part only at a near-tie (each reference token's gap is kept). After
such a parting the reference can say nothing, so the answer is then read under the real model
on a Celery worker (`canary_score_pending`): each of its tokens must be the model's best
choice or within the tie gap of it, and it may end only where ending was. A host that fails
is put in maintenance with a reason naming verification; its owner sees why.

Schedule (`canary_send_if_due`, on every heartbeat, so no customer traffic is needed): a
host in probation (fewer than `CANARY_TRUST_AFTER` passed canaries) gets one every
`CANARY_PROBATION_SECONDS`, one at a time; a trusted host one every
`CANARY_TRUSTED_SECONDS`. A model without references gets canaries only when trusted hosts
score its audits (the gateway never held its weights): a corpus prompt, sampled as
customers' jobs are and judged by its audit alone (`_canary_drawn`); otherwise none.
"""

from __future__ import annotations

import atexit
import json
import random
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import lru_cache
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.db.models import Sum
from django.utils import timezone

from accounts.models import ApiKey
from accounts.services import api_key_create
from billing import selectors as ledger
from billing import services as billing
from catalog.models import CatalogModel
from catalog.rendering import (
    RENDERED_AT,
    chat_format,
    prompt_count,
    prompt_fragments,
    render_instant,
    render_instant_fixed,
)
from hosts.models import TRUSTED, Host
from hosts.selectors import qualified_model_ids
from hosts.services import host_maintenance_enter
from marketplace.lifecycle.queueing import new_public_id, request_submit
from marketplace.models import Audit, CanaryCheck, CanaryReference, Request, TextChunk
from marketplace.trust import reputation
from marketplace.trust.audits import audit_possible, audit_weights, scorers_exist
from protocol.jobs import job_fragments, job_stop_strings
from protocol.rendering import ChatFormat, TemplateRefused, chat_stops

CORPUS = Path(__file__).with_name("canary_prompts.json")
CANARY_EMAIL = "canary@elephant.invalid"
BUDGET_UCENTS = 10 * 100_000_000  # the canary customer's credit is topped up to this ($10)
REFERENCE_CTX = 256  # the corpus' prompts and answers fit; all logits of 2,048 positions would take 2 GB


class CorpusInvalid(ImproperlyConfigured):
    """The operator's canary prompts file is not what `corpus_read` accepts (one line says why)."""


def corpus() -> list[dict]:
    """The prompts canaries are made of: `{"kind": "chat", "messages": [...]}` or
    `{"kind": "completion", "prompt": "..."}`, realistic requests of both kinds. The
    operator's own (CANARY_PROMPTS_FILE) when set, else the shipped corpus, which is public:
    a cheat that reads this repository can recognise every canary made of it."""
    return corpus_read(_corpus_path())[0]


def system_prompts() -> list[str]:
    """The system turns a canary's chat may open with: the operator file's own when it names
    some, else the shipped ones (`SYSTEM_PROMPTS`)."""
    return corpus_read(_corpus_path())[1] or SYSTEM_PROMPTS


def _corpus_path() -> str:
    return settings.CANARY_PROMPTS_FILE or str(CORPUS)


def corpus_public() -> bool:
    """Whether canaries are made of the shipped, public corpus (the pool page says so)."""
    return not settings.CANARY_PROMPTS_FILE


@lru_cache(maxsize=4)
def corpus_read(path: str) -> tuple[list[dict], list[str]]:
    """A prompts file's prompts and system prompts (none: the shipped ones), checked: a JSON list
    of prompts, or an object with "prompts" and optionally "system_prompts". Raises
    CorpusInvalid naming the file and the first thing wrong with it."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as unreadable:
        raise CorpusInvalid(f"canary prompts {path}: {unreadable}") from unreadable
    if isinstance(data, list):
        data = {"prompts": data}
    if not isinstance(data, dict) or set(data) - {"prompts", "system_prompts"}:
        raise CorpusInvalid(
            f"canary prompts {path}: a JSON list of prompts, or an object with \"prompts\" and \"system_prompts\" only"
        )
    prompts, system = data.get("prompts"), data.get("system_prompts", [])
    if not isinstance(prompts, list) or not prompts:
        raise CorpusInvalid(f"canary prompts {path}: \"prompts\" must be a non-empty list")
    for index, item in enumerate(prompts):
        if (why := _prompt_invalid(item)) is not None:
            raise CorpusInvalid(f"canary prompts {path}: prompt {index}: {why}")
    if not isinstance(system, list) or not all(isinstance(text, str) and text.strip() for text in system):
        raise CorpusInvalid(f"canary prompts {path}: \"system_prompts\" must be a list of non-empty strings")
    return prompts, system


def _prompt_invalid(item: object) -> str | None:
    """Why `item` is not a canary prompt (None: it is)."""
    if not isinstance(item, dict):
        return "not an object"
    if item.get("kind") == Request.Kind.COMPLETION:
        prompt = item.get("prompt")
        return None if isinstance(prompt, str) and prompt.strip() else '"prompt" must be a non-empty string'
    if item.get("kind") != Request.Kind.CHAT:
        return '"kind" must be "chat" or "completion"'
    messages = item.get("messages")
    if not isinstance(messages, list) or not messages:
        return '"messages" must be a non-empty list'
    for message in messages:
        if (
            not isinstance(message, dict)
            or set(message) != {"role", "content"}
            or message["role"] not in ("system", "user", "assistant")
            or not isinstance(message["content"], str)
            or not message["content"].strip()
        ):
            return 'each message is {"role": "system", "user" or "assistant", "content": a non-empty string}'
    if messages[-1]["role"] != "user":
        return "the last message must be the user's"
    return None


# --- references (the operator's trusted machinery) --------------------------------------


@dataclass(frozen=True)
class Reference:
    text: str
    tokens: int
    exact_chars: int  # characters before the first near-tie
    gaps: list[tuple[int, float]]  # per generated token: (its first character, its top-2 gap)


def canary_job(
    fmt: ChatFormat,
    *,
    kind: str,
    messages: list | None,
    prompt: str | None,
    now: datetime | None = None,
) -> dict:
    """The job a canary is, rendered in its model's format at `now` (what a host receives, less its parameters)."""
    job: dict[str, Any] = {"kind": kind, "messages": messages, "prompt": prompt, "params": {}}
    return {
        **job,
        "fragments": job_fragments(fmt, job, now=now),
        "end_of_turn": chat_stops(fmt) if kind == "chat" else [],
    }


def job_tokens(llm: object, job: dict) -> list[int]:
    """A job's prompt as the real model's token ids, tokenized as every host tokenizes it."""
    from scorer.llama import PromptTokenizer

    return PromptTokenizer(llm).tokens(job)  # type: ignore[arg-type]


def reference_of(llm: object, item: dict, *, fmt: ChatFormat, max_tokens: int, tie_gap: float) -> Reference:
    """What the real model writes for `item`, greedily, rendered in its model's format `fmt` and
    tokenized exactly as a host does, and where its first near-tie is: the first generated
    token whose distribution's two best logits are closer than `tie_gap` (a log-probability
    gap, read from the logits that chose that very token; `llm` keeps all logits)."""
    import numpy as np

    job = canary_job(fmt, kind=item["kind"], messages=item.get("messages"), prompt=item.get("prompt"))
    tokens = job_tokens(llm, job)
    llm.reset()  # type: ignore[attr-defined]  # no reuse of the previous prompt's cache: the same numbers every time
    out = llm.create_completion(  # type: ignore[attr-defined]
        prompt=tokens,
        max_tokens=max_tokens,
        temperature=0.0,
        top_p=1.0,
        stop=job_stop_strings(job),
    )
    text = out["choices"][0]["text"]
    generated = [int(t) for t in llm.input_ids[len(tokens) : llm.n_tokens]]  # type: ignore[attr-defined]

    def gap_at(index: int) -> float:  # the logits that chose generated token `index` (or what followed the last)
        logits = np.asarray(llm.scores[len(tokens) - 1 + index])  # type: ignore[attr-defined]
        best, second = np.partition(logits, -2)[-2:][::-1]
        return round(float(best - second), 4)

    exact, produced, gaps = len(text), b"", []
    for index, token in enumerate(generated):
        start = len(produced.decode("utf-8", errors="ignore"))
        gaps.append((min(start, len(text)), gap_at(index)))
        if start >= len(text):  # the token that ended the text (a stop string)
            break
        if gaps[-1][1] < tie_gap:
            exact = min(exact, start)
        produced += llm.detokenize([token])  # type: ignore[attr-defined]
    else:
        if len(generated) < max_tokens:  # it ended at the end of sequence: how sure was the model?
            gaps.append((len(text), gap_at(len(generated))))
    return Reference(text=text, tokens=int(out["usage"]["completion_tokens"]), exact_chars=exact, gaps=gaps)


def informative(item: dict, reference: Reference) -> bool:
    """Whether a reference is worth sending: it would catch an empty answer and an echo of
    the prompt (its first token, and the one where an echo would part from it, were clear
    choices; a base model often repeats the question first), and at least
    CANARY_MIN_EXACT_CHARS of its characters were written by clear choices."""
    echo = item.get("prompt") if item["kind"] == "completion" else (item.get("messages") or [{}])[-1].get("content", "")
    row = CanaryReference(
        kind=item["kind"],
        prompt="",
        max_tokens=reference.tokens,
        text=reference.text,
        tokens=reference.tokens,
        exact_chars=reference.exact_chars,
        gaps=[list(g) for g in reference.gaps],
    )
    catches = all(verdict_reason(row, text=cheat, completion_tokens=1) for cheat in ("", echo or ""))
    return catches and decisive_chars(reference.text, reference.gaps) >= settings.CANARY_MIN_EXACT_CHARS


def decisive_chars(text: str, gaps: list, *, since: int = 0) -> int:
    """Characters after `since` written by tokens the model chose clearly (no near-tie)."""
    starts = [int(start) for start, _ in gaps] + [len(text)]
    return sum(
        max(0, starts[i + 1] - max(int(start), since))
        for i, (start, gap) in enumerate(gaps)
        if i + 1 < len(starts) and gap >= settings.CANARY_TIE_GAP
    )


def references_compute(
    *, model: CatalogModel, gguf: str, count: int, max_tokens: int, threads: int = 2, out: object = print
) -> int:
    """Compute and store references for the first `count` corpus prompts (replacing the
    model's old ones); prompts that check too little (`informative`) are skipped. Returns how many were kept."""
    from catalog.tokenizer import shipped_model_path
    from scorer.llama import load_llama  # the same loader hosts use (it avoids AMX where a VM lies about it)

    llm = load_llama(gguf or shipped_model_path(), n_ctx=REFERENCE_CTX, threads=threads, logits_all=True)
    kept: list[CanaryReference] = []
    for index, item in enumerate(corpus()[:count]):
        try:
            reference = reference_of(
                llm, item, fmt=chat_format(model), max_tokens=max_tokens, tie_gap=settings.CANARY_TIE_GAP
            )
        except TemplateRefused as refused:
            out(f"  prompt {index}: {refused}; skipped")  # type: ignore[operator]
            continue
        if not informative(item, reference):
            out(
                f"  prompt {index}: too little to check before a near-tie ({reference.exact_chars} characters); skipped"
            )  # type: ignore[operator]
            continue
        kept.append(
            CanaryReference(
                model=model,
                kind=item["kind"],
                prompt=item.get("messages") if item["kind"] == "chat" else item["prompt"],
                max_tokens=max_tokens,
                text=reference.text,
                tokens=reference.tokens,
                exact_chars=reference.exact_chars,
                gaps=[list(gap) for gap in reference.gaps],
                gguf=gguf,
            )
        )
    llm.close()
    with transaction.atomic():
        CanaryReference.objects.filter(model=model).delete()
        CanaryReference.objects.bulk_create(kept)
    return len(kept)


# --- the verdict -------------------------------------------------------------------------


def verdict_reason(reference: CanaryReference, *, text: str, completion_tokens: int) -> str | None:
    """Why the host's answer cannot be the real model's greedy answer, or None when it could be.

    An honest host writes the reference's text until, perhaps, a near-tie, where its own
    arithmetic may pick the runner-up; after that nothing can be said. So the answer must
    match the reference up to where they first part, and they may part (or the answer end, or
    run on) only where the reference's token there was a near-tie (`gaps`, `CANARY_TIE_GAP`)."""
    if completion_tokens > reference.max_tokens:
        return f"more text than asked ({completion_tokens} tokens for max_tokens {reference.max_tokens})"
    ref = reference.text
    parted = next((i for i, (a, b) in enumerate(zip(text, ref, strict=False)) if a != b), min(len(text), len(ref)))
    if parted == len(text) == len(ref):
        return None
    if _near_tie_at(reference, parted):
        return None
    if parted == len(text):
        return f"the answer stopped after {len(text)} characters where the real model writes on"
    if parted == len(ref):
        return "the answer runs past where the real model ends"
    return f"the answer differs from the real model's at character {parted}"


def _near_tie_at(reference: CanaryReference, char: int) -> bool:
    """Whether the reference's token covering character `char` (or its end, at len(text))
    was chosen over a near-tie. A reference without gaps knows only `exact_chars`."""
    if not reference.gaps:
        return char >= reference.exact_chars
    covering = None
    for start, gap in reference.gaps:
        if int(start) <= char:
            covering = float(gap)
        else:
            break
    return covering is None or covering < settings.CANARY_TIE_GAP


def score_reason(llm: object, reference: CanaryReference, *, text: str, completion_tokens: int) -> str | None:
    """Why the host's answer cannot be the real model's greedy answer, judged token by token
    under the real model (`llm`, loaded with all logits): the answer is re-read after the
    prompt and each of its tokens must be the model's best choice there or within
    `CANARY_TIE_GAP` of it; an answer that ended before `max_tokens` must end where ending
    was (nearly) the model's best choice. This judges what follows a parting at a near-tie,
    where the reference can say nothing."""
    import numpy as np

    tie_gap = settings.CANARY_TIE_GAP
    job = reference_job(reference)
    prompt = job_tokens(llm, job)
    answer = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False) if text else []  # type: ignore[attr-defined]
    room = REFERENCE_CTX - len(prompt) - 1
    if len(answer) > room:
        return f"more text than asked ({len(answer)} tokens for max_tokens {reference.max_tokens})"
    llm.reset()  # type: ignore[attr-defined]
    llm.eval(prompt + answer)  # type: ignore[attr-defined]
    for index, token in enumerate(answer):
        logits = np.asarray(llm.scores[len(prompt) - 1 + index])  # type: ignore[attr-defined]
        gap = float(logits.max() - logits[token])
        if gap >= tie_gap:
            piece = llm.detokenize([token]).decode("utf-8", errors="replace")  # type: ignore[attr-defined]
            return (
                f"the answer's token {index + 1} ({piece!r}) is not the "
                f"real model's choice (log-probability {gap:.1f} below)"
            )
    ended = completion_tokens < reference.max_tokens or len(answer) + 2 < reference.max_tokens
    if ended:
        logits = np.asarray(llm.scores[len(prompt) + len(answer) - 1])  # type: ignore[attr-defined]
        enders = {llm.token_eos()} | {  # type: ignore[attr-defined]
            ids[0]
            for stop in job_stop_strings(job)
            if (ids := llm.tokenize(stop.encode("utf-8"), add_bos=False, special=True))  # type: ignore[attr-defined]
        }
        gap = float(logits.max() - max(logits[t] for t in enders))
        if gap >= tie_gap:
            return f"the answer stopped after {len(text)} characters where the real model writes on"
    return None


def answer_reason(llm: object, reference: CanaryReference, *, text: str, completion_tokens: int) -> str | None:
    """Both steps of the verdict at once (the gateway takes them in two processes:
    `canary_judge` on completion, `canary_score_pending` on a worker): for the benchmark."""
    reason = verdict_reason(reference, text=text, completion_tokens=completion_tokens)
    if reason is None and text != reference.text:
        return score_reason(llm, reference, text=text, completion_tokens=completion_tokens)
    return reason


def reference_job(reference: CanaryReference) -> dict:
    """The job a canary of `reference` is (what a host receives, less its parameters)."""
    chat = reference.kind == Request.Kind.CHAT
    return canary_job(
        chat_format(reference.model),
        kind=reference.kind,
        messages=reference.prompt if chat else None,
        prompt=None if chat else reference.prompt,
        now=reference.created_at,
    )


def canary_check(*, request: Request) -> CanaryCheck | None:
    """The canary check a request is, if it is one (one query, at each completion)."""
    return CanaryCheck.objects.select_related("reference").filter(request=request).first()


def canary_judge(*, check: CanaryCheck, host: Host, text: str, completion_tokens: int, audited: bool) -> str | None:
    """Judge a completed canary (None when it was decided already). One sampled like
    customers' jobs waits for its audit (`audited`: the settlement opened one; else it is
    void: nothing can check it). A greedy one is judged against its reference: passed,
    failed (the host is in maintenance) or scoring — it parted from the reference at a
    near-tie, so the real model reads it next. Both end in `canary_score_pending`, on the
    workers. Runs in the completion's transaction."""
    if check.verdict != CanaryCheck.Verdict.PENDING:
        return None
    TextChunk.objects.filter(request_id=check.request_id).delete()  # nobody reads a canary's answer
    if check.by_audit:
        verdict = CanaryCheck.Verdict.SCORING if audited else CanaryCheck.Verdict.VOID
        CanaryCheck.objects.filter(pk=check.pk, verdict=CanaryCheck.Verdict.PENDING).update(
            verdict=verdict, decided_at=None if audited else timezone.now()
        )
        return verdict
    assert check.reference is not None  # a canary not judged by its audit has its reference
    reason = verdict_reason(check.reference, text=text, completion_tokens=completion_tokens)
    if reason is None and text != check.reference.text:
        CanaryCheck.objects.filter(pk=check.pk).update(
            verdict=CanaryCheck.Verdict.SCORING, answer=text, answer_tokens=completion_tokens
        )
        return CanaryCheck.Verdict.SCORING
    return canary_decide(check=check, host=host, reason=reason, was=CanaryCheck.Verdict.PENDING)


def canary_decide(*, check: CanaryCheck, host: Host, reason: str | None, was: str) -> str | None:
    """Record a verdict (once: compare-and-set from `was`); a failure puts the host in
    maintenance, revokes its trust and forfeits its unvested earnings, with the reason."""
    verdict = CanaryCheck.Verdict.PASSED if reason is None else CanaryCheck.Verdict.FAILED
    if not CanaryCheck.objects.filter(pk=check.pk, verdict=was).update(
        verdict=verdict, reason=reason or "", answer="", decided_at=timezone.now()
    ):
        return None  # decided elsewhere
    if reason is not None:
        why = f"Failed verification: {reason} (canary {check.pk})."
        host_maintenance_enter(host=host, reason=why, by="verification")
        reputation.trust_revoke(host_id=host.pk)
        billing.earnings_forfeit(host=host, reason=why)
    return verdict


_scorer_cache: dict[str, object] = {}


@atexit.register
def _scorers_close() -> None:
    """Close the cached model before the interpreter tears llama.cpp's bindings down (else its
    finaliser fails then, printing "Exception ignored")."""
    for llm in _scorer_cache.values():
        llm.close()  # type: ignore[attr-defined]
    _scorer_cache.clear()


def _scorer(gguf: str) -> object:
    """The real model with all logits, loaded once per worker process and file."""
    from catalog.tokenizer import shipped_model_path
    from scorer.llama import load_llama  # the same loader hosts use

    path = gguf or str(shipped_model_path())
    if path not in _scorer_cache:
        _scorer_cache.clear()  # one model at a time: its logits take REFERENCE_CTX × vocabulary floats
        _scorer_cache[path] = load_llama(
            path, n_ctx=REFERENCE_CTX, threads=settings.CANARY_SCORER_THREADS, logits_all=True
        )
    return _scorer_cache[path]


def canary_score_pending(*, limit: int = 20) -> int:
    """Score answers that parted from their reference at a near-tie under the real model
    (`score_reason`) and decide them; on the Celery workers, every WATCHDOG_INTERVAL. Returns
    how many were decided."""
    decided = _audited_decide()
    for check_id in list(
        CanaryCheck.objects.filter(verdict=CanaryCheck.Verdict.SCORING, by_audit=False)
        .order_by("created_at")
        .values_list("pk", flat=True)[:limit]
    ):
        check = (
            CanaryCheck.objects.select_related("reference", "host")
            .filter(pk=check_id, verdict=CanaryCheck.Verdict.SCORING)
            .first()
        )
        if check is None:
            continue
        assert check.reference is not None  # a canary not judged by its audit has its reference
        reason = score_reason(
            _scorer(check.reference.gguf),
            check.reference,
            text=check.answer,
            completion_tokens=check.answer_tokens or 0,
        )
        with transaction.atomic():
            decided += (
                canary_decide(check=check, host=check.host, reason=reason, was=CanaryCheck.Verdict.SCORING) is not None
            )
    return decided


def _audited_decide() -> int:
    """Canaries judged by an audit take its verdict once the audit is decided
    (`audits.audit_score_pending`: the host is in maintenance already if it failed). One
    whose audit was unscored (nobody independent could read it), or passed having checked
    nothing, is void: it vouches for nothing and blames nobody."""
    decided = 0
    waiting = CanaryCheck.objects.filter(verdict=CanaryCheck.Verdict.SCORING, by_audit=True).select_related("host")
    for check in waiting:
        audit = Audit.objects.filter(request_id=check.request_id).exclude(status=Audit.Status.PENDING).first()
        if audit is None:
            continue
        if audit.status == Audit.Status.UNSCORED or (audit.status == Audit.Status.PASSED and not audit.checked):
            decided += CanaryCheck.objects.filter(pk=check.pk, verdict=CanaryCheck.Verdict.SCORING).update(
                verdict=CanaryCheck.Verdict.VOID, decided_at=timezone.now()
            )
            continue
        reason = None if audit.status == Audit.Status.PASSED else f"its audit failed: {audit.reason}"
        with transaction.atomic():
            decided += (
                canary_decide(check=check, host=check.host, reason=reason, was=CanaryCheck.Verdict.SCORING) is not None
            )
    return decided


def canary_void(*, request: Request) -> bool:
    """A canary that ended without an answer (its host died, failed or never claimed it)."""
    return bool(
        CanaryCheck.objects.filter(request=request, verdict=CanaryCheck.Verdict.PENDING).update(
            verdict=CanaryCheck.Verdict.VOID, decided_at=timezone.now()
        )
    )


def is_canary(request: Request) -> bool:
    return CanaryCheck.objects.filter(request=request).exists()


# --- the schedule ------------------------------------------------------------------------


def host_vetted(*, host: Host) -> bool:
    """The canaries vouch for the host (`reputation.canaries_vouch`): they become rare (leaving
    probation also takes completed jobs and time, `marketplace.trust.reputation`)."""
    return reputation.canaries_vouch(host_id=host.pk)


def canary_due(*, host: Host, now: datetime) -> bool:
    """Whether `host` should get a canary now (one at a time; probation often, trusted rarely)."""
    if not settings.CANARY_ENABLED or host.paused or host.maintenance_since is not None:
        return False
    checks = CanaryCheck.objects.filter(host=host)
    ended = (Request.Status.COMPLETED, Request.Status.FAILED)
    checks.filter(verdict=CanaryCheck.Verdict.PENDING, request__status__in=ended).update(
        verdict=CanaryCheck.Verdict.VOID, decided_at=now
    )  # ended unanswered (expired, failed)
    if checks.filter(verdict__in=(CanaryCheck.Verdict.PENDING, CanaryCheck.Verdict.SCORING)).exists():
        return False
    last = checks.order_by("-created_at").values_list("created_at", flat=True).first()
    every = settings.CANARY_TRUSTED_SECONDS if host_vetted(host=host) else settings.CANARY_PROBATION_SECONDS
    return last is None or now - last >= timedelta(seconds=every)


def _canary_key() -> ApiKey:
    """The platform's canary customer and its key, created on first use, with its credit
    topped up from the platform's funding (a GRANT in the ledger: canary spend is visible)."""
    user, _ = get_user_model().objects.get_or_create(username=CANARY_EMAIL, defaults={"email": CANARY_EMAIL})
    key = ApiKey.objects.filter(user=user, revoked_at__isnull=True).first()
    if key is None:
        key = api_key_create(user=user, name="canaries").key
    account = ledger.customer_account(user=user)
    available = account.available_ucents if account is not None else 0
    if available < BUDGET_UCENTS // 2:
        billing.credit_grant(
            user=user,
            amount_ucents=BUDGET_UCENTS - available,
            reference=f"canary-budget-{secrets.token_hex(8)}",
            memo="canary budget",
        )
    return key


@transaction.atomic
def canary_send(*, host: Host) -> CanaryCheck | None:
    """Queue one canary for `host` (a model it qualified that can be checked, `_canary_drawn`), or None."""
    model_ids = qualified_model_ids(host=host, fingerprint=host.fingerprint) if host.fingerprint else []
    drawn = _canary_drawn(host=host, model_ids=model_ids)
    if drawn is None:
        return None
    model, item, reference = drawn
    kind = item["kind"]
    by_audit = reference is None or (settings.AUDIT_ENABLED and audit_possible(model, besides=host))
    messages = item.get("messages") if kind == Request.Kind.CHAT else None
    prompt = item.get("prompt") if kind == Request.Kind.COMPLETION else None
    now: datetime | None
    if by_audit:  # judged by its audit, so it may look like customers' jobs
        params, now = render_instant_fixed(live_params(model=model, kind=kind))
        if messages is not None and messages[0]["role"] != "system" and random.random() < 0.5:
            messages = [{"role": "system", "content": random.choice(system_prompts())}, *messages]
    else:
        # judged against its reference: greedy, as long as the reference, rendered when it was
        # (a template may write the date)
        assert reference is not None  # by_audit otherwise
        params = {
            "max_tokens": reference.max_tokens,
            "temperature": 0.0,
            "top_p": 1.0,
            "stop": None,
            "seed": None,
            RENDERED_AT: int(reference.created_at.timestamp()),
        }
        now = render_instant(params)
    try:
        fragments = prompt_fragments(model, kind=kind, messages=messages, prompt=prompt, now=now)
    except TemplateRefused:  # a template without a system role
        messages = item.get("messages") if kind == Request.Kind.CHAT else None
        try:
            fragments = prompt_fragments(model, kind=kind, messages=messages, prompt=prompt, now=now)
        except TemplateRefused:  # (a corpus prompt its template refuses: references skip those too)
            return None
    request = request_submit(
        public_id=new_public_id(kind),
        api_key=_canary_key(),
        model=model,
        kind=kind,
        messages=messages,
        prompt=prompt,
        stream=True,
        prompt_tokens=prompt_count(model, fragments),
        params=params,
        only_host_id=host.pk,
    )
    return CanaryCheck.objects.create(host=host, reference=reference, request=request, by_audit=by_audit)


def _canary_drawn(*, host: Host, model_ids: list[int]) -> tuple[CatalogModel, dict, CanaryReference | None] | None:
    """A model for `host`'s canary, drawn at random among those it qualified that can check one,
    and its prompt: one of the model's references, or (no reference: the gateway never held
    the weights) a corpus prompt, for a model whose audit trusted hosts score
    (`_scored_by_hosts`); such a canary is judged by its audit alone."""
    referenced: dict[int, list[int]] = {}
    for pk, model_id in CanaryReference.objects.filter(model_id__in=model_ids).values_list("pk", "model_id"):
        referenced.setdefault(model_id, []).append(pk)
    choices = [*referenced, *_scored_by_hosts(host=host, model_ids=[m for m in model_ids if m not in referenced])]
    if not choices:
        return None
    model_id = random.choice(choices)
    if model_id in referenced:
        reference = CanaryReference.objects.select_related("model").get(pk=random.choice(referenced[model_id]))
        prompt_key = "messages" if reference.kind == Request.Kind.CHAT else "prompt"
        return reference.model, {"kind": reference.kind, prompt_key: reference.prompt}, reference
    return CatalogModel.objects.get(pk=model_id), random.choice(corpus()), None


def _scored_by_hosts(*, host: Host, model_ids: list[int]) -> list[int]:
    """Of `model_ids` (chat models without references), those the gateway cannot read but a
    trusted host other than `host` scores audits of: a canary of one is judged by its audit."""
    if not settings.AUDIT_ENABLED or not model_ids:
        return []
    models = CatalogModel.objects.filter(pk__in=model_ids, kind=CatalogModel.Kind.CHAT)
    return [
        model.pk
        for model in models
        if audit_weights(model, assemble=False) is None and scorers_exist(model_id=model.pk, besides=host)
    ]


# Never a customer's words: a canary's system turn is one of these, as often as not.
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a helpful assistant. Answer briefly.",
    "Answer the user's question clearly and concisely.",
    "You are a friendly assistant who explains things simply.",
    "Keep answers short and to the point.",
]
LIVE_SAMPLE = 200  # recent customer requests the parameters are drawn from
CUSTOMER_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 256}  # what a client that sets nothing sends


def live_params(*, model: CatalogModel, kind: str) -> dict:
    """A canary's sampling, drawn from recent customer requests of this model and kind (their
    temperature, top_p and max_tokens, capped at CANARY_MAX_TOKENS; never their content), or
    a client's defaults when there are none. The seed is the gateway's, as for any job."""
    recent = list(
        Request.objects.filter(model=model, kind=kind, canary__isnull=True)
        .order_by("-created_at")
        .values_list("params", flat=True)[:LIVE_SAMPLE]
    )
    drawn = random.choice(recent) if recent else {}
    picked = {key: drawn[key] if drawn.get(key) is not None else default for key, default in CUSTOMER_DEFAULTS.items()}
    picked["max_tokens"] = min(int(picked["max_tokens"]), settings.CANARY_MAX_TOKENS)
    return {**picked, "stop": None, "seed": None}


def canary_send_if_due(*, host: Host) -> CanaryCheck | None:
    """On every claim (`marketplace.hostdoor.claiming`): two queries when no model has references and
    no trusted host could score a canary's audit."""
    if not settings.CANARY_ENABLED:
        return None
    if not CanaryReference.objects.exists() and not (
        settings.AUDIT_ENABLED and Host.objects.filter(TRUSTED.q()).exists()
    ):
        return None
    return canary_send(host=host) if canary_due(host=host, now=timezone.now()) else None


# --- what the operator sees --------------------------------------------------------------


def canary_summary() -> dict:
    """Canaries sent, passed, failed, void; their cost; hosts that failed verification."""
    counts = {verdict: CanaryCheck.objects.filter(verdict=verdict).count() for verdict in CanaryCheck.Verdict.values}
    spent = Request.objects.filter(canary__isnull=False).aggregate(total=Sum("cost_ucents"))["total"] or 0
    failed_hosts = list(
        Host.objects.filter(canary_checks__verdict=CanaryCheck.Verdict.FAILED).distinct().values_list("name", flat=True)
    )
    decided = counts["passed"] + counts["failed"]
    return {
        **counts,
        "pass_rate": counts["passed"] / decided if decided else None,
        "spent_ucents": spent,
        "failed_hosts": failed_hosts,
        "prompts_public": corpus_public(),
        "prompts": len(corpus()),
    }
