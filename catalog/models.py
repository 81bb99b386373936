"""The models Elephant sells, with their prices per token."""

from __future__ import annotations

from django.db import models
from django.db.models import Q

from protocol.catalog import AUDITABLE_CONTEXT_TOKENS


class CatalogModel(models.Model):
    """A model the marketplace sells, with its prices per token in micro-cents."""

    class Kind(models.TextChoices):
        CHAT = "chat"
        EMBEDDING = "embedding"

    name = models.CharField(max_length=100, unique=True)
    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.CHAT)
    context_length = models.PositiveIntegerField()
    input_price_ucents = models.BigIntegerField(help_text="µ¢ per prompt token")
    output_price_ucents = models.BigIntegerField(help_text="µ¢ per generated token")
    cached_input_price_ucents = models.BigIntegerField(
        null=True, blank=True, help_text="µ¢ per cached prompt token; empty = a quarter of the input price"
    )
    embedding_dimensions = models.PositiveIntegerField(
        null=True, blank=True, help_text="an embeddings model's vector width: a host's vectors must have it"
    )
    tokenizer = models.CharField(max_length=100, help_text="how the gateway counts tokens, e.g. shipped:gemma-3-270m")
    sha256 = models.CharField(
        max_length=64, blank=True, help_text="the weights file every host must serve (blank: not pinned)"
    )
    quantization = models.CharField(max_length=32, blank=True, help_text="e.g. Q4_K_M")
    # What `catalog_add` read from the model's own GGUF (blank / null on entries made otherwise).
    architecture = models.CharField(max_length=64, blank=True, help_text="the GGUF's general.architecture, e.g. llama")
    chat_template = models.TextField(blank=True, help_text="the model's own Jinja chat template")
    bos_token_id = models.PositiveIntegerField(null=True, blank=True)
    eos_token_id = models.PositiveIntegerField(null=True, blank=True)
    eot_token_id = models.PositiveIntegerField(null=True, blank=True, help_text="end of turn, where the file names one")
    # How a job is rendered for the model (`protocol.rendering.ChatFormat`), read from its vocabulary.
    bos_text = models.CharField(max_length=64, blank=True, help_text="the BOS token's text, the template's bos_token")
    eos_text = models.CharField(max_length=64, blank=True, help_text="the EOS token's text, the template's eos_token")
    adds_bos = models.BooleanField(default=False, help_text="the vocabulary starts every prompt with BOS")
    control_tokens = models.JSONField(
        default=list, blank=True, help_text="the control tokens the template writes: found in its markup only"
    )
    end_of_turn = models.JSONField(default=list, blank=True, help_text="where the model ends its turn: a chat's stops")
    longest_token_chars = models.PositiveIntegerField(
        null=True, blank=True, help_text="the most characters one token decodes to (read once, when the model is added)"
    )
    vocab_size = models.PositiveIntegerField(null=True, blank=True)
    n_layers = models.PositiveIntegerField(null=True, blank=True)
    n_experts = models.PositiveIntegerField(null=True, blank=True, help_text="a mixture of experts' expert count")
    file_size = models.BigIntegerField(null=True, blank=True, help_text="bytes of the weights file")
    weights_path = models.CharField(
        max_length=500,
        blank=True,
        help_text="the weights file on the gateway's disk (where it was added from): what audits re-read answers with",
    )
    active = models.BooleanField(default=True)
    routing_strategy = models.CharField(
        max_length=24,
        blank=True,
        choices=[("least-connections", "least-connections"), ("weighted", "weighted")],
        help_text="how jobs are spread over warm hosts; empty = the gateway's ROUTING_STRATEGY",
    )
    latency_critical = models.BooleanField(
        default=False, help_text="keep on at least two warm hosts (the admin and host dashboards warn otherwise)"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "marketplace_catalogmodel"  # the table it had before the catalog became its own app
        constraints = [
            models.CheckConstraint(
                condition=Q(input_price_ucents__gte=0) & Q(output_price_ucents__gte=0), name="prices_not_negative"
            ),
            models.CheckConstraint(
                condition=Q(cached_input_price_ucents__isnull=True) | Q(cached_input_price_ucents__gte=0),
                name="cached_price_not_negative",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def context_sold(self) -> int:
        """The context a request may fill (prompt + max_tokens): the entry's, and for a chat
        model never more than its verifiers and runners take (`AUDITABLE_CONTEXT_TOKENS`), so
        every job sold can be audited whatever the row says (an operator's edit included)."""
        if self.kind == self.Kind.CHAT:
            return min(self.context_length, AUDITABLE_CONTEXT_TOKENS)
        return self.context_length
