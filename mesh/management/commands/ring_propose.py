"""`ring_propose MODEL --hosts A,B[,C…] [--bridge HOST] [--layer-mb MB]`: a ring plan split by
the hosts' advertised memory (one layer's MB read from the model's own file unless given);
prints the plan id and its stages."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError, CommandParser

from mesh.management.hostref import host_by_ref
from mesh.rings.services import PlanInvalid, ring_plan_propose


class Command(BaseCommand):
    help = "Propose a ring plan for MODEL over the named hosts, in proportion to their advertised memory."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("model")
        parser.add_argument("--hosts", required=True, help="comma-separated host names or ids, in stage order")
        parser.add_argument("--bridge", default=None, help="the host whose bridge feeds the ring")
        parser.add_argument(
            "--layer-mb",
            type=float,
            default=None,
            help="memory one layer takes on a stage (default: read from the model's weights file)",
        )
        parser.add_argument("--row-width", type=int, default=64)
        parser.add_argument("--micro-batch", type=int, default=4)

    def handle(self, *args: object, row_width: int, micro_batch: int, **options: object) -> None:
        hosts = [host_by_ref(name) for name in str(options["hosts"]).split(",") if name]
        bridge = host_by_ref(str(options["bridge"])) if options["bridge"] else None
        layer_mb = None if options["layer_mb"] is None else float(str(options["layer_mb"]))
        try:
            plan = ring_plan_propose(
                model_name=str(options["model"]),
                hosts=hosts,
                bridge_host=bridge,
                layer_mb=layer_mb,
                row_width=row_width,
                micro_batch=micro_batch,
            )
        except PlanInvalid as error:
            raise CommandError(str(error)) from None
        for stage in plan.stages.order_by("index"):
            self.stdout.write(f"stage {stage.index}: layers [{stage.start}, {stage.end}) on {stage.host}")
        self.stdout.write(str(plan.pk))
