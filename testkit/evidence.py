"""What an honest host reports with its completion (`marketplace.lifecycle.evidence`), for
tests that complete a job by hand: the ids of the text it delivered, as the model's own
vocabulary writes it, and an end of generation when the answer ended on its own."""

from __future__ import annotations

from catalog.tokenizer import GgufTokenizer, tokenizer_for
from marketplace.lifecycle.settlement import own_text
from marketplace.models import Job


def drawn(job_id: int, *, ended: bool = True) -> list[int]:
    """The token ids a host that generated `job_id`'s own delivered text would report. For a
    model counted by byte bound (no vocabulary on the gateway), one id per byte."""
    job = Job.objects.select_related("request__model").get(pk=job_id)
    text = own_text(job.request.delivered_text, job=job)
    tokenizer = tokenizer_for(job.request.model.tokenizer)
    if isinstance(tokenizer, GgufTokenizer):
        return tokenizer.token_ids(text) + ([tokenizer.end_of_generation()] if ended else [])
    return list(text.encode()) + ([0] if ended or not text else [])
