"""`catalog_add PATH.gguf --name NAME --input-price USD_PER_MTOK --output-price USD_PER_MTOK [--template FILE]`:
add a chat model to the catalog from its own file. It sells the file's own context, at most what hosts and
audits read (`protocol.catalog.AUDITABLE_CONTEXT_TOKENS`); `--context-length N` sells less. Bad input: one line
on stderr, exit 2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from catalog.money import per_million
from catalog.services import CatalogAddRefused, catalog_model_add


class Command(BaseCommand):
    help = "Add a chat model to the catalog from its own GGUF file (prices in USD per million tokens)."

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        """A usage error is one line and exit 2 too, like every other refusal (no usage block)."""
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parser.print_usage = lambda file=None: None  # type: ignore[method-assign]
        return parser

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("path", type=Path, help="the model's GGUF file")
        parser.add_argument("--name", required=True, help="the model's name in the API")
        parser.add_argument("--input-price", required=True, help="USD per million prompt tokens, e.g. 0.10")
        parser.add_argument("--output-price", required=True, help="USD per million generated tokens, e.g. 0.40")
        parser.add_argument(
            "--template",
            type=Path,
            default=None,
            help="a Jinja chat template file, for a GGUF without tokenizer.chat_template",
        )
        parser.add_argument(
            "--context-length",
            type=int,
            default=None,
            help="the context sold, in tokens (default: the file's own, at most what audits read)",
        )

    def handle(
        self,
        *args: object,
        path: Path,
        name: str,
        input_price: str,
        output_price: str,
        template: Path | None,
        context_length: int | None,
        **options: object,
    ) -> None:
        try:
            entry = catalog_model_add(
                path=path,
                name=name,
                input_price=input_price,
                output_price=output_price,
                template_path=template,
                context_length=context_length,
            )
        except CatalogAddRefused as refused:
            raise CommandError(" ".join(refused.message.split()), returncode=2) from None
        self.stdout.write(
            f"Added {entry.name}: {entry.architecture} {entry.quantization}, {entry.n_layers} layers, "
            f"context {entry.context_length}, vocabulary {entry.vocab_size}; {per_million(entry.input_price_ucents)} "
            f"in, {per_million(entry.output_price_ucents)} out per million tokens; sha256 {entry.sha256}; "
            f"counted with {entry.tokenizer}"
        )
