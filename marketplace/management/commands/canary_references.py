"""`canary_references [--model NAME] [--count N] [--max-tokens N]`: compute the canaries'
known answers with the real model (llama-cpp-python on this machine), replacing the old."""

from __future__ import annotations

import time
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser

from catalog.models import CatalogModel
from marketplace.lifecycle.canaries import corpus, references_compute
from protocol.catalog import file_sha256


class Command(BaseCommand):
    help = "Compute canary references for a chat model (default: the shipped Gemma 3 270M)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--model", default="gemma-3-270m", help="the catalog model's name")
        parser.add_argument(
            "--gguf",
            default="",
            help="the model's own GGUF file (required but for the shipped model); "
            "the workers score answers with it too",
        )
        parser.add_argument("--count", type=int, default=len(corpus()), help="corpus prompts to use")
        parser.add_argument("--max-tokens", type=int, default=24)
        parser.add_argument("--threads", type=int, default=2)

    def handle(
        self, *args: object, model: str, gguf: str, count: int, max_tokens: int, threads: int, **options: object
    ) -> None:
        entry = CatalogModel.objects.filter(name=model, kind=CatalogModel.Kind.CHAT).first()
        if entry is None:
            raise CommandError(f"No chat model named {model!r} in the catalog.")
        if count < 1 or max_tokens < 1:
            raise CommandError("--count and --max-tokens must be at least 1.")
        if gguf:
            _check_file(entry, Path(gguf))
        elif not entry.tokenizer.startswith("shipped:"):
            raise CommandError(
                f"--gguf PATH is needed: {model}'s own file (sha256 {entry.sha256 or 'not pinned'}); "
                "references are the real model's answers."
            )
        started = time.monotonic()
        self.stdout.write(f"Computing {count} canary references for {model} ({max_tokens} tokens each)…")
        kept = references_compute(
            model=entry, gguf=gguf, count=count, max_tokens=max_tokens, threads=threads, out=self.stdout.write
        )
        self.stdout.write(f"Kept {kept} references in {time.monotonic() - started:.1f} s.")


def _check_file(entry: CatalogModel, path: Path) -> None:
    """The file must be the one the catalog sells: references of another model would fail every honest host."""
    if not path.is_file():
        raise CommandError(f"{path}: no such file.")
    if entry.sha256 and (found := file_sha256(path)) != entry.sha256:
        raise CommandError(f"{path} is not {entry.name}'s file (sha256 {found}, the catalog pins {entry.sha256}).")
