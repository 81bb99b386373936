"""Customer requests and the jobs hosts claim."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db import models
from django.db.models import Q

CHOICE_OF = "choice_of"  # in a later choice's params: the id of its request's first choice (`prompt_tokens_billed`)


class Request(models.Model):
    """The customer's contract: what was asked, what was delivered, what it cost.

    The prompt (`messages` / `prompt`) lives here only until the request ends;
    settlement and failure delete it, keeping counts and costs.
    """

    class Kind(models.TextChoices):
        CHAT = "chat"
        COMPLETION = "completion"
        EMBEDDINGS = "embeddings"

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        COMPLETED = "completed"
        FAILED = "failed"

    public_id = models.CharField(max_length=64, unique=True)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="requests")
    api_key = models.ForeignKey("accounts.ApiKey", on_delete=models.PROTECT, related_name="requests")
    model = models.ForeignKey("catalog.CatalogModel", on_delete=models.PROTECT, related_name="requests")
    kind = models.CharField(max_length=16, choices=Kind.choices)
    stream = models.BooleanField(default=False)
    messages = models.JSONField(null=True, blank=True)
    prompt = models.TextField(null=True, blank=True)
    inputs = models.JSONField(
        null=True, blank=True, help_text="texts to embed (embeddings requests), deleted at the end"
    )
    result = models.JSONField(null=True, blank=True, help_text="embedding vectors, kept only until delivered")
    params = models.JSONField(default=dict)
    hold = models.OneToOneField("billing.Hold", on_delete=models.PROTECT, related_name="request")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED)
    delivered_chars = models.PositiveIntegerField(
        default=0, help_text="characters delivered so far: the next chunk's offset"
    )
    output_forgotten = models.BooleanField(default=False)
    prompt_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(
        default=0, help_text="of its prompt tokens, those billed at the cached price: decided at admission"
    )
    prefix_hashes = models.JSONField(
        null=True,
        blank=True,
        help_text="its prompt's block hashes (`trust.prefixes`): recorded for the host claiming it",
    )
    completion_tokens = models.PositiveIntegerField(default=0)
    estimate_ucents = models.BigIntegerField(default=0)
    cost_ucents = models.BigIntegerField(default=0)
    finish_reason = models.CharField(max_length=16, blank=True)
    error_code = models.CharField(max_length=64, blank=True)
    error_message = models.CharField(max_length=500, blank=True)
    resumed = models.BooleanField(default=False)
    left_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="when its customer's connection went away while it ran (cleared when one re-attaches)",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["status", "created_at"]), models.Index(fields=["user", "created_at"])]

    def __str__(self) -> str:
        return self.public_id

    @property
    def prompt_tokens_billed(self) -> int:
        """The prompt tokens this request pays for: none for the later choices of an `n` request
        (`params["choice_of"]`: the first choice's id), whose first choice pays the one prompt, as
        OpenAI bills it and as the response's `usage` counts it."""
        return 0 if (self.params or {}).get(CHOICE_OF) else self.prompt_tokens

    @property
    def cached_tokens_billed(self) -> int:
        """Of `prompt_tokens_billed`, those billed at the cached price."""
        return 0 if (self.params or {}).get(CHOICE_OF) else self.cached_tokens

    @property
    def delivered_text(self) -> str:
        """Everything delivered so far, read from its chunks (a query: settlement, a
        continuation and a listener's catch-up read it, the token path never does)."""
        return "".join(self.chunks.order_by("char_offset").values_list("text", flat=True))


class Job(models.Model):
    """One attempt at a request, claimed by one host."""

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        COMPLETED = "completed"
        FAILED = "failed"

    request = models.ForeignKey(Request, on_delete=models.CASCADE, related_name="jobs")
    model = models.ForeignKey("catalog.CatalogModel", on_delete=models.PROTECT, related_name="jobs")
    attempt = models.PositiveSmallIntegerField(
        default=1, help_text="1, or 2 for the continuation after a death mid-answer"
    )
    requeue = models.PositiveSmallIntegerField(
        default=0, help_text="times this attempt went back to the queue because its host died before its first token"
    )
    host = models.ForeignKey("hosts.Host", null=True, blank=True, on_delete=models.PROTECT, related_name="jobs")
    avoid_host = models.ForeignKey(
        "hosts.Host",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="+",
        help_text="the host whose attempt died: it gets this continuation only if nobody else takes it",
    )
    offered_host = models.ForeignKey(
        "hosts.Host",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="+",
        help_text="the warm host routing chose; others may take the job once offer_until passes",
    )
    offer_until = models.DateTimeField(null=True, blank=True)
    only_host = models.ForeignKey(
        "hosts.Host",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="+",
        help_text="a canary: only this host may claim it (nothing on the wire says so)",
    )
    warm_until = models.DateTimeField(
        null=True,
        blank=True,
        help_text="until then only hosts with the model loaded (or of unknown catalog) may take it",
    )
    trusted_only = models.BooleanField(default=False, help_text="the customer asked for trusted hosts only")
    max_chars = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="text its host may send: max_tokens at the tokenizer's longest token (None: embeddings)",
    )
    deadline_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="the attempt ends by then whatever its host says (queue, start allowance, max_tokens)",
    )
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED)
    next_seq = models.PositiveIntegerField(default=0)
    generated_chars = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    earned_ucents = models.BigIntegerField(default=0)
    fail_reason = models.CharField(max_length=500, blank=True)
    fail_cause = models.CharField(
        max_length=8,
        blank=True,
        choices=[("host", "the host"), ("request", "the request's content")],
        help_text=(
            "whose fault a failure was: a host that says 'request' gets no strike, unless another host then served it"
        ),
    )
    text_end = models.CharField(
        max_length=8,
        blank=True,
        default="",
        help_text=(
            "the finish_reason its host sent with a batch (its text "
            "ended the answer): its death then settles the answer"
        ),
    )
    boot = models.CharField(
        max_length=64,
        blank=True,
        default="",
        help_text=(
            "the boot id of the mahout process that claimed it (blank: "
            "a client that sends none); a new one from its host ends it"
        ),
    )
    created_at = models.DateTimeField(auto_now_add=True)
    claimed_at = models.DateTimeField(null=True, blank=True)
    first_token_at = models.DateTimeField(null=True, blank=True)
    last_token_at = models.DateTimeField(null=True, blank=True)
    progress_at = models.DateTimeField(
        null=True, blank=True, help_text="the host's last progress report before its first token (loading, prefill)"
    )
    loaded_at_claim = models.BooleanField(
        default=False,
        help_text="its host's fresh catalog said the model was loaded when it claimed: its start bound is "
        "a prefill, not a load (`watchdog.job_start_bounds`)",
    )
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["request", "attempt", "requeue"], name="one_job_per_attempt_and_requeue"),
            models.UniqueConstraint(
                fields=["request"], condition=Q(status__in=["queued", "running"]), name="one_live_job_per_request"
            ),
            models.CheckConstraint(
                condition=Q(status__in=["queued", "failed"]) | Q(host__isnull=False), name="claimed_job_has_host"
            ),
        ]
        indexes = [
            models.Index(fields=["status", "model", "created_at"]),
            models.Index(fields=["host", "status"]),
            models.Index(fields=["offered_host", "created_at"]),
            models.Index(fields=["offered_host", "status"]),  # a host's live offers (routing's load), not its history
            models.Index(fields=["status", "deadline_at"]),
        ]

    def __str__(self) -> str:
        return f"job {self.pk} ({self.status})"


class Liveness:
    """The liveness rules of a job, each written once as a `Q` at the instant `now`: the
    watchdog sweeps every job by them, and a quiet stream asks them of its own job
    (`marketplace.lifecycle.watchdog`)."""

    @staticmethod
    def queue_expired(now: datetime) -> Q:
        """Queued for longer than QUEUE_TIMEOUT_SECONDS: no host claimed it in time."""
        return Q(status=Job.Status.QUEUED, created_at__lt=now - timedelta(seconds=settings.QUEUE_TIMEOUT_SECONDS))

    @staticmethod
    def offer_lapsed(now: datetime) -> Q:
        """Queued with no live offer: routing may offer it to another warm host."""
        return Q(status=Job.Status.QUEUED) & (Q(offer_until__isnull=True) | Q(offer_until__lt=now))

    @staticmethod
    def stalled(now: datetime) -> Q:
        """A stream that stopped: no token for STALL_SECONDS after its first, or no "complete"
        within COMPLETE_GRACE_SECONDS of a batch that said its text ended (`text_end`: a
        host that is alive completes at once, and waiting longer buys the customer nothing)."""
        return Q(status=Job.Status.RUNNING, first_token_at__isnull=False) & (
            Q(last_token_at__lt=now - timedelta(seconds=settings.STALL_SECONDS))
            | (~Q(text_end="") & Q(last_token_at__lt=now - timedelta(seconds=settings.COMPLETE_GRACE_SECONDS)))
        )

    @staticmethod
    def unstarted_since(now: datetime) -> Q:
        """Running with no token yet, claimed longer ago than any start bound can be short
        (its floor, at most the allowance): the jobs whose start bound
        (`watchdog.job_start_overdue`, which reads each host's benchmark) is worth checking."""
        earliest = min(settings.JOB_START_FLOOR_SECONDS, settings.JOB_START_ALLOWANCE_SECONDS)
        return Q(
            status=Job.Status.RUNNING, first_token_at__isnull=True, claimed_at__lt=now - timedelta(seconds=earliest)
        )

    @staticmethod
    def past_deadline(now: datetime) -> Q:
        """Running past its deadline (`queueing.job_limits`), however it trickles."""
        return Q(status=Job.Status.RUNNING, deadline_at__lt=now)


class TextChunk(models.Model):
    """One batch of delivered text, appended and never rewritten, so a batch costs O(batch)
    whatever the answer's length. A request's text is its chunks in `char_offset` order; they
    are deleted with the rest of its output once it has been handed over."""

    request = models.ForeignKey(Request, on_delete=models.CASCADE, related_name="chunks")
    job = models.ForeignKey(Job, null=True, on_delete=models.CASCADE, related_name="chunks")
    seq = models.PositiveIntegerField(help_text="the job's batch number")
    char_offset = models.PositiveIntegerField(help_text="where the text starts in the request's delivered text")
    text = models.TextField()
    logprobs = models.JSONField(
        null=True, blank=True, help_text="the text's tokens' log-probability entries, when asked for"
    )

    class Meta:
        constraints = [models.UniqueConstraint(fields=["request", "char_offset"], name="one_chunk_per_offset")]

    def __str__(self) -> str:
        return f"{self.request_id}@{self.char_offset}"


class CanaryReference(models.Model):
    """A hidden test's known answer: what the real model writes, greedily, for one prompt
    of the corpus (computed by `manage.py canary_references` on the operator's machine).

    Two honest machines can part where the model's two best next tokens are nearly tied;
    `gaps` says, for each token of the reference, where it starts and how far its choice was
    from the runner-up, so a host's answer may part from the reference only at a near-tie."""

    model = models.ForeignKey("catalog.CatalogModel", on_delete=models.CASCADE, related_name="canary_references")
    kind = models.CharField(max_length=16, choices=[("chat", "chat"), ("completion", "completion")])
    prompt = models.JSONField(help_text="the messages (chat) or the prompt text (completion)")
    max_tokens = models.PositiveIntegerField()
    text = models.TextField(help_text="the reference answer")
    tokens = models.PositiveIntegerField(help_text="tokens in the reference answer")
    exact_chars = models.PositiveIntegerField(help_text="characters before the first near-tie")
    gaps = models.JSONField(
        default=list, help_text="per generated token: [its first character, its top-2 log-prob gap]"
    )
    gguf = models.CharField(
        max_length=500,
        blank=True,
        help_text=(
            "the model file the reference was computed from, which also scores answers (blank: the shipped model)"
        ),
    )
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"canary {self.pk} ({self.model_id}, {self.exact_chars}/{len(self.text)} exact)"


class CanaryCheck(models.Model):
    """One hidden test sent to one host, and its verdict."""

    class Verdict(models.TextChoices):
        PENDING = "pending"
        SCORING = (
            "scoring",
            (
                "scoring (the real model reads it next: it parted from "
                "the reference at a near-tie, or its audit is pending)"
            ),
        )
        PASSED = "passed"
        FAILED = "failed"
        VOID = "void", "void (not answered: the host died, failed or never claimed it)"

    host = models.ForeignKey("hosts.Host", on_delete=models.CASCADE, related_name="canary_checks")
    reference = models.ForeignKey(
        CanaryReference,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="checks",
        help_text="its reference (blank: a corpus prompt for a model without references, judged by its audit alone)",
    )
    request = models.OneToOneField(Request, on_delete=models.CASCADE, related_name="canary")
    verdict = models.CharField(max_length=16, choices=Verdict.choices, default=Verdict.PENDING)
    reason = models.CharField(max_length=300, blank=True)
    answer = models.TextField(blank=True, help_text="the host's answer, kept only while it is being scored")
    answer_tokens = models.PositiveIntegerField(null=True, blank=True)
    by_audit = models.BooleanField(
        default=False,
        help_text="sampled with parameters drawn from customers' and judged by an audit of the real model "
        "(its reference gives only the prompt); else greedy, against the reference's text",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    decided_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["host", "verdict", "created_at"])]

    def __str__(self) -> str:
        return f"canary check {self.pk} ({self.verdict})"


class Audit(models.Model):
    """A real job chosen at random to be re-read under the real model before its host is
    paid (`marketplace.trust.audits`). Until decided, the host's share waits in the audit escrow
    and the rendered prompt, the answer and its tokens are kept here (nowhere else: the
    request's own copy is deleted at settlement as for any job); deciding deletes them."""

    class Status(models.TextChoices):
        PENDING = "pending"
        PASSED = "passed"
        FAILED = "failed", "failed (the customer was refunded, the host put in maintenance)"
        UNSCORED = (
            "unscored",
            "unscored (nobody independent could read it: the customer was refunded, the host not paid nor blamed)",
        )

    job = models.OneToOneField(Job, on_delete=models.CASCADE, related_name="audit")
    host = models.ForeignKey("hosts.Host", on_delete=models.PROTECT, related_name="audits")
    request = models.ForeignKey(Request, on_delete=models.PROTECT, related_name="audits")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    host_ucents = models.BigIntegerField(help_text="the host's share, in escrow until the audit passes")
    platform_ucents = models.BigIntegerField(help_text="the platform's share, refunded too if the audit fails")
    seed = models.BigIntegerField(help_text="the job's sampling seed (the gateway's, never the host's word)")
    payload = models.JSONField(null=True, blank=True, help_text="the job as its host received it; deleted when decided")
    text = models.TextField(blank=True, help_text="the text the host delivered; deleted when decided")
    token_ids = models.JSONField(
        null=True, blank=True, help_text="the tokens the host says it generated; deleted when decided"
    )
    logprobs = models.JSONField(
        null=True,
        blank=True,
        help_text="the log-probability entries the host reported with its text, when the job asked "
        "for them (compared with the model's); deleted when decided",
    )
    finish_reason = models.CharField(max_length=16, blank=True)
    checked = models.PositiveIntegerField(default=0, help_text="tokens checked")
    uncertain = models.PositiveIntegerField(
        default=0, help_text="tokens too close to call (never held against the host)"
    )
    misses = models.PositiveIntegerField(default=0, help_text="tokens the job's draw cannot have chosen")
    reason = models.CharField(max_length=500, blank=True, help_text="why it failed, with the evidence")
    created_at = models.DateTimeField(auto_now_add=True)
    decided_at = models.DateTimeField(null=True, blank=True)
    by_hosts = models.BooleanField(
        default=False, help_text="scored by trusted hosts paid to score (the gateway lacks the model's weights)"
    )
    scorer = models.ForeignKey(
        "hosts.Host",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="the trusted host scoring it now (never its own host)",
    )
    scorer_since = models.DateTimeField(null=True, blank=True, help_text="when that scorer claimed it")
    scorer_boot = models.CharField(
        max_length=64,
        blank=True,
        default="",
        help_text=(
            "the boot id of the scorer's process that claimed it (blank: none sent); a new one from that host frees it"
        ),
    )
    chosen = models.ForeignKey(
        "hosts.Host",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="the scorer the gateway chose to break a pass/fail split: only it may claim the audit",
    )
    chosen_at = models.DateTimeField(
        null=True, blank=True, help_text="when it was chosen (another is chosen if it is silent)"
    )

    class Meta:
        indexes = [models.Index(fields=["status", "created_at"]), models.Index(fields=["host", "status"])]
        constraints = [
            models.CheckConstraint(
                condition=Q(host_ucents__gte=0) & Q(platform_ucents__gte=0), name="audit_shares_not_negative"
            ),
        ]

    def __str__(self) -> str:
        return f"audit {self.pk} of job {self.job_id} ({self.status})"


class RingInquiry(models.Model):
    """Which of a ring's hosts made its audit fail (`marketplace.trust.ring_inquiries`): the failed
    audit's customer is refunded at once; here the ring's stages hand over what they kept of
    the request (`RingEvidence`), a trusted host outside the ring recomputes each stage on its
    own inputs (`mahout.ring.blame`), and only the hosts it finds at fault are put in
    maintenance. The job, its answer and the evidence are deleted when it is decided."""

    class Status(models.TextChoices):
        COLLECTING = "collecting", "collecting (the stages hand over their evidence)"
        CHECKING = "checking", "checking (a trusted host outside the ring recomputes the stages)"
        DECIDED = "decided"

    audit = models.OneToOneField(Audit, on_delete=models.CASCADE, related_name="ring_inquiry")
    plan = models.ForeignKey("mesh.RingPlan", on_delete=models.PROTECT, related_name="+")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.COLLECTING)
    audit_reason = models.CharField(max_length=500, blank=True, help_text="why the audit failed")
    payload = models.JSONField(
        null=True, blank=True, help_text="the job as the bridge received it; deleted when decided"
    )
    token_ids = models.JSONField(
        null=True, blank=True, help_text="the answer's tokens as audited; deleted when decided"
    )
    shared_output = models.BooleanField(
        default=True, help_text="the head and the tail share the output head (both pick)"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    checking_since = models.DateTimeField(null=True, blank=True)
    checker = models.ForeignKey(
        "hosts.Host",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="the trusted host recomputing the stages now (never one of the ring's)",
    )
    checker_since = models.DateTimeField(null=True, blank=True)
    declined_by = models.JSONField(default=list, blank=True, help_text="hosts that declined or abandoned the check")
    verdicts = models.JSONField(
        default=list,
        blank=True,
        help_text="each checker's verdict so far: [{checker, owner, blamed, reasons}]; two that agree decide",
    )
    blamed = models.JSONField(default=list, blank=True, help_text="the hosts blamed: [{host, stage, reason}]")
    verdict = models.TextField(blank=True, help_text="the checker's reasons, or why the bridge was blamed without one")
    decided_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["status", "created_at"]), models.Index(fields=["plan", "status"])]

    def __str__(self) -> str:
        return f"ring inquiry {self.pk} into audit {self.audit_id} ({self.status})"


class RingEvidence(models.Model):
    """One part of what one stage kept of an inquired request (`mahout.ring.evidence`, as an
    npz file split into parts that fit a request body), or its word that it kept nothing
    (`parts` 0)."""

    inquiry = models.ForeignKey(RingInquiry, on_delete=models.CASCADE, related_name="evidence")
    stage = models.PositiveIntegerField()
    host = models.ForeignKey("hosts.Host", on_delete=models.CASCADE, related_name="+")
    part = models.PositiveIntegerField()
    parts = models.PositiveIntegerField(help_text="0: the stage kept nothing of the request")
    data = models.BinaryField(default=bytes)
    received_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["inquiry", "stage", "part"], name="one_evidence_part")]


class AuditScore(models.Model):
    """One trusted host's reading of an audit scored by hosts (`marketplace.trust.audits`): its
    verdict and counts, whether a confirmation overruled it (a strike), and what it was paid."""

    class Verdict(models.TextChoices):
        PASSED = "passed"
        FAILED = "failed"
        DECLINED = "declined", "declined (it could not score it: another scorer is asked)"
        ABANDONED = "abandoned", "abandoned (no verdict within AUDIT_SCORE_TIMEOUT_SECONDS: another scorer is asked)"

    audit = models.ForeignKey(Audit, on_delete=models.CASCADE, related_name="scores")
    scorer = models.ForeignKey("hosts.Host", on_delete=models.PROTECT, related_name="audit_scores")
    verdict = models.CharField(max_length=16, choices=Verdict.choices)
    reason = models.CharField(max_length=500, blank=True)
    checked = models.PositiveIntegerField(default=0)
    uncertain = models.PositiveIntegerField(default=0)
    misses = models.PositiveIntegerField(default=0)
    overruled = models.BooleanField(default=False, help_text="a second scorer's confirmation disagreed (a strike)")
    paid_ucents = models.BigIntegerField(
        default=0, help_text="its fee for the prefill, paid when the audit was decided"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["scorer", "overruled", "created_at"])]

    def __str__(self) -> str:
        return f"audit {self.audit_id} scored by host {self.scorer_id}: {self.verdict}"


class StageShare(models.Model):
    """What a ring's stage host earned for the layers it ran of one job (the job's own host,
    the bridge, earns `Job.earned_ucents` for its layers): on that host's statement."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="stage_shares")
    host = models.ForeignKey("hosts.Host", on_delete=models.PROTECT, related_name="stage_shares")
    plan = models.ForeignKey("mesh.RingPlan", on_delete=models.PROTECT, related_name="+")
    layers = models.PositiveIntegerField()
    n_layers = models.PositiveIntegerField(help_text="the ring's layers in all")
    earned_ucents = models.BigIntegerField()
    finished_at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "host"], name="one_stage_share_per_job_and_host")]
        indexes = [models.Index(fields=["host", "finished_at"])]

    def __str__(self) -> str:
        return f"job {self.job_id} · host {self.host_id} · {self.layers}/{self.n_layers} layers"


class StoredResponse(models.Model):
    """A Responses API answer its customer asked to keep (`store: true`), so that a later turn
    can continue it (`previous_response_id`) and GET /v1/responses/{id} can read it back.

    Kept only until `expires_at` (`RESPONSE_STORE_SECONDS` after it was answered), then deleted
    by the watchdog's sweep, or earlier by DELETE /v1/responses/{id}. Its request's row keeps the
    bill, as every request's does; the prompt on that row is forgotten as any other. Bounded per
    response and per account (`marketplace.openai.stored_responses`)."""

    request = models.OneToOneField(Request, on_delete=models.CASCADE, related_name="stored_response")
    conversation = models.JSONField(
        help_text="the input items (earlier turns first) then the output items, "
        "in the Responses API's shape, normalised (only what a turn needs); "
        "instructions are not carried over"
    )
    body = models.JSONField(help_text="the Response object as it was returned")
    size_bytes = models.PositiveBigIntegerField(
        default=0, help_text="conversation and body as compact UTF-8 JSON: what RESPONSE_STORE_ACCOUNT_MAX_BYTES counts"
    )
    expires_at = models.DateTimeField(db_index=True)

    def __str__(self) -> str:
        return f"stored {self.request_id} until {self.expires_at:%Y-%m-%d %H:%M}"


class PrefixBlock(models.Model):
    """A block of a prompt the gateway routed to a host: the host holds its KV (and every block
    before it) for a while, so a later prompt of the same account starting with it is offered to
    that host and billed its `tokens` at the cached price (`marketplace.trust.prefixes`).

    One account's only: the price of a cached prefix would tell another what was sent. Deleted
    `PROMPT_CACHE_SECONDS` after its last use (each claim of a job with it renews it)."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    model = models.ForeignKey("catalog.CatalogModel", on_delete=models.CASCADE, related_name="+")
    host = models.ForeignKey("hosts.Host", on_delete=models.CASCADE, related_name="+")
    block_hash = models.CharField(max_length=64, help_text="the chain's hash through this block")
    tokens = models.PositiveIntegerField(help_text="the prefix's tokens, through this block")
    expires_at = models.DateTimeField(db_index=True)

    class Meta:
        constraints = [  # (also the lookup's index: an account's model's blocks by hash)
            models.UniqueConstraint(fields=["user", "model", "block_hash", "host"], name="prefix_block_once"),
        ]

    def __str__(self) -> str:
        return f"{self.tokens} tokens on host {self.host_id} until {self.expires_at:%H:%M:%S}"
