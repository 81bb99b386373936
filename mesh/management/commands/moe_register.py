"""`moe_register PATH --name NAME --coordinator-host HOST`: put an MoE GGUF on sale and in the
expert market, coordinated by HOST (a name or an id).

Creates or updates the mesh `ExpertModel` (layers and expert count from the file, how it is
cut into slices, its replica targets) and the marketplace `CatalogModel` (kind chat), whose
tokens are counted with the model's own vocabulary, as its coordinator tokenizes: a real one
(Qwen 3 MoE's) enters the catalog as `catalog_add` takes any chat model (a vocabulary-only
copy, the file's chat template, the file pinned by sha256); the generated test model's byte
vocabulary is counted as bytes (tokenizer `bytes`, its exact count). The coordinator is bound
here, by the operator: only that host may report for the model and be handed its workers'
link secrets (a report from any other host is refused). It then serves the model with
`python -m mahout moe coordinator --model PATH --name NAME`. Run the command again to change
prices or targets (the bound coordinator stays) or, with --coordinator-host, to bind another.
"""

from __future__ import annotations

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser

from mesh.experts.services import MoeRefused, moe_model_publish
from mesh.management.hostref import host_by_ref


class Command(BaseCommand):
    help = "Register an MoE GGUF (qwen3moe) as a chat model of the catalog and of the expert market."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("path", help="the MoE GGUF the gateway cuts expert slices from (keep it in place)")
        parser.add_argument("--name", required=True, help="the model name customers and hosts use")
        parser.add_argument(
            "--coordinator-host",
            default=None,
            help="the host (name or id) that coordinates the model; needed for a new model",
        )
        parser.add_argument("--input-price", type=int, default=10, help="µ¢ per prompt token (default 10)")
        parser.add_argument("--output-price", type=int, default=40, help="µ¢ per generated token (default 40)")
        parser.add_argument("--slice-size", type=int, default=4, help="experts per slice handed to a volunteer")
        parser.add_argument(
            "--base-target", type=int, default=0, help="replicas per slice while the coordinator is quiet"
        )
        parser.add_argument("--boost", type=int, default=1, help="extra replicas per slice while it is saturated")
        parser.add_argument("--saturation-threshold", type=int, default=2, help="busy slots that mean saturated")

    def handle(self, *args: object, path: str, name: str, coordinator_host: str | None, **options: int) -> None:
        source = Path(path).resolve()
        if not source.is_file():
            raise CommandError(f"no such file: {source}")
        if (
            min(options["input_price"], options["output_price"], options["base_target"], options["boost"]) < 0
            or min(options["slice_size"], options["saturation_threshold"]) < 1
        ):
            raise CommandError("prices and targets must not be negative; slice size and threshold must be positive")
        coordinator = host_by_ref(coordinator_host) if coordinator_host else None
        try:
            expert_model, catalog = moe_model_publish(
                name=name,
                gguf_path=source,
                input_price_ucents=options["input_price"],
                output_price_ucents=options["output_price"],
                slice_size=options["slice_size"],
                base_target=options["base_target"],
                boost=options["boost"],
                saturation_threshold=options["saturation_threshold"],
                coordinator=coordinator,
            )
        except (MoeRefused, ValueError) as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(
            f"Registered {catalog.name}: {expert_model.n_layers} layers x {expert_model.n_experts} experts "
            f"({expert_model.n_experts_used} per token), context {catalog.context_length}, "
            f"{catalog.input_price_ucents}/{catalog.output_price_ucents} µ¢ per input/output token, coordinated by "
            f"host {expert_model.coordinator_id} ({expert_model.coordinator}). Serve it there with: "
            f"python -m mahout moe coordinator --server URL --token TOKEN --model {source} --name {catalog.name}"
        )
