"""`python -m mahout moe coordinator|volunteer|worker`: take part in the expert market.

* `coordinator --server URL --token TOKEN --model PATH --name NAME [--slots 4] [--device auto|cpu|cuda[:N]] [--ctx N]`:
  serve the whole MoE model through the marketplace (qualify, claim, stream, complete),
  dispatching routed experts to the workers the control plane attaches when its slots are
  busy; the model and the experts it computes itself on a CUDA GPU when torch sees one.

* `volunteer --server URL --token TOKEN`: poll `/api/expert-volunteer` (an untrusted host serves on probation);
  when handed a (layer, expert-range) slice and its secret, download only it, serve it,
  register, heartbeat until retired. Everything is pulled (seed 004): by default the slice is
  served through the gateway's relay, over a connection the volunteer opens, so a machine
  behind NAT needs no inbound port and no flag. ``--direct`` (or ``--advertise``) has the
  coordinator dial ``--advertise`` instead, which must be a public address (the gateway
  refuses private ones unless its operator allows them).
* `worker --model PATH --layer L --first F --count C`: serve a slice from a local file, with
  its secret in ``MAHOUT_MOE_SECRET``.

Every role leaves the machine to its owner as `mahout run` does (`mahout.owner`: `mahout
pause`, ``--schedule``, the idle detector unless ``--no-idle-detect``): the coordinator stops
claiming and finishes the jobs in hand; the volunteer asks for no slice and gives up the one it
serves; the worker refuses batches, which its coordinator then computes itself.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path

from protocol.timing import CLAIM_WAIT_SECONDS, MOE_COORDINATOR_REPORT_SECONDS, MOE_WORKER_HEARTBEAT_SECONDS


def add_parser(commands: argparse._SubParsersAction) -> None:
    moe = commands.add_parser("moe", help="MoE expert market: volunteer a slice, or serve one")
    roles = moe.add_subparsers(dest="moe_command", required=True)
    volunteer = roles.add_parser("volunteer", help="ask the gateway for a slice of experts and serve it")
    volunteer.add_argument("--server", help="gateway URL (default: from `mahout login`, or $MAHOUT_SERVER)")
    volunteer.add_argument("--token", help="host token (visible in ps: prefer `mahout login` or $MAHOUT_TOKEN)")
    volunteer.add_argument("--workdir", default=None, help="where the downloaded slice is kept (default: a temp dir)")
    volunteer.add_argument("--listen", default="127.0.0.1", help="address the expert server binds")
    volunteer.add_argument(
        "--direct",
        action="store_true",
        help="let the coordinator dial this machine (needs an inbound port) instead of the relay",
    )
    volunteer.add_argument(
        "--advertise",
        default=None,
        help="with --direct: public address the coordinator should dial (default: --listen); implies --direct",
    )
    volunteer.add_argument(
        "--relay", action="store_true", help=argparse.SUPPRESS
    )  # the default since issue 16; still accepted
    volunteer.add_argument("--max-slices", type=int, default=None, help="exit after serving this many slices")
    volunteer.add_argument("--poll", type=float, default=1.0, help="seconds between volunteer polls")
    volunteer.add_argument(
        "--heartbeat", type=float, default=MOE_WORKER_HEARTBEAT_SECONDS, help="seconds between heartbeats"
    )
    volunteer.add_argument(
        "--home", help="state directory whose pause flag counts (default: $MAHOUT_HOME or ~/.mahout)"
    )
    from engine.device import add_device_argument
    from mahout.owner import add_owner_arguments

    add_device_argument(volunteer)
    coordinator = roles.add_parser("coordinator", help="serve a whole MoE model through the marketplace")
    coordinator.add_argument("--server", help="gateway URL (default: from `mahout login`, or $MAHOUT_SERVER)")
    coordinator.add_argument("--token", help="host token (visible in ps: prefer `mahout login` or $MAHOUT_TOKEN)")
    coordinator.add_argument(
        "--model", required=True, help="the MoE GGUF (qwen3moe), the file the catalog entry was registered from"
    )
    coordinator.add_argument(
        "--name", required=True, help="its name in the gateway's catalog (see manage.py moe_register)"
    )
    coordinator.add_argument("--slots", type=int, default=4, help="requests served at once")
    coordinator.add_argument("--threads", type=int, default=1, help="torch threads (default 1: workers share the CPUs)")
    coordinator.add_argument(
        "--report",
        type=float,
        default=MOE_COORDINATOR_REPORT_SECONDS,
        help="seconds between load reports to the control plane",
    )
    coordinator.add_argument(
        "--claim-wait", type=float, default=CLAIM_WAIT_SECONDS, help="seconds each claim long-polls"
    )
    coordinator.add_argument("--home", help="state directory (default: $MAHOUT_HOME or ~/.mahout)")
    coordinator.add_argument("--rebenchmark", action="store_true", help="ignore the cached benchmark")
    coordinator.add_argument(
        "--ctx",
        type=int,
        default=None,
        help="tokens of context per slot (default: the model's whole context); the KV cache "
        "holds this many for every slot, and a longer prompt is refused",
    )
    add_device_argument(coordinator)
    worker = roles.add_parser("worker", help="serve one slice of a local MoE GGUF")
    for name in ("--layer", "--first", "--count"):
        worker.add_argument(name, type=int, required=True)
    worker.add_argument("--model", required=True)
    worker.add_argument("--port", type=int, default=0)
    worker.add_argument("--home", help="state directory whose pause flag counts (default: $MAHOUT_HOME or ~/.mahout)")
    for role in (volunteer, coordinator, worker):
        add_owner_arguments(role)


def cmd_moe(args: argparse.Namespace, *, say: Callable[[str], None]) -> int:
    from mahout.home import resolve_home
    from mahout.owner import owner_guard

    if args.moe_command in ("coordinator", "volunteer"):
        import sys

        from mahout.credentials import credentials_resolve

        login = credentials_resolve(
            server=args.server,
            token=args.token,
            home=resolve_home(getattr(args, "home", None)),
            warn=lambda line: print(line, file=sys.stderr, flush=True),
        )
        args.server, args.token = login.server, login.token
    if args.moe_command == "coordinator":
        from mahout.moe.serve import serve_coordinator

        home = resolve_home(args.home)
        if args.ctx is not None and (refused := _ctx_refused(Path(args.model), args.ctx)):
            print(f"mahout moe: {refused}", file=sys.stderr, flush=True)
            return 2
        handled = serve_coordinator(
            server=args.server,
            token=args.token,
            model_path=Path(args.model),
            name=args.name,
            home=home,
            slots=args.slots,
            threads=args.threads,
            agent_interval_s=args.report,
            claim_wait=args.claim_wait,
            rebenchmark=args.rebenchmark,
            owner=owner_guard(args, home),
            device=args.device,
            n_ctx=args.ctx,
            out=say,
        )
        say(f"mahout moe: stopped after {handled} job(s)")
        return 0
    if args.moe_command == "worker":
        from mahout.moe.worker import main as worker_main

        return worker_main(
            [
                "--model",
                args.model,
                "--layer",
                str(args.layer),
                "--first",
                str(args.first),
                "--count",
                str(args.count),
                "--port",
                str(args.port),
                *_owner_argv(args),
            ]
        )
    import torch

    from mahout.moe.control import MeshClient, Volunteer

    torch.set_num_threads(1)
    client = MeshClient(args.server, args.token)
    with tempfile.TemporaryDirectory(prefix="mahout-moe-") as scratch:
        volunteer = Volunteer(
            client,
            Path(args.workdir or scratch),
            host=args.listen,
            advertise=args.advertise,
            relay=not (args.direct or args.advertise),
            poll_s=args.poll,
            heartbeat_s=args.heartbeat,
            out=say,
            device=args.device,
            owner=owner_guard(args, resolve_home(args.home)),
        )
        try:
            served = volunteer.run(max_slices=args.max_slices)
        except KeyboardInterrupt:
            served = 0
        finally:
            client.close()
    say(f"mahout moe: served {served} slice(s)")
    return 0


def _owner_argv(args: argparse.Namespace) -> list[str]:
    """The owner options and home, handed on to `python -m mahout.moe.worker`'s own parser."""
    argv = ["--idle-detect" if args.idle_detect else "--no-idle-detect", "--idle-threshold", str(args.idle_threshold)]
    if args.schedule is not None:
        argv += ["--schedule", args.schedule.text]
    return argv + (["--home", args.home] if args.home else [])


def _ctx_refused(model: Path, ctx: int) -> str | None:
    """Why `--ctx` cannot be this model's context per slot (None: it can)."""
    from engine.gguf_meta import open_gguf
    from engine.moe_gguf import read_moe_config

    if ctx < 1:
        return f"--ctx {ctx}: a context holds at least one token"
    limit = read_moe_config(open_gguf(model)).context_length
    return f"--ctx {ctx} is past {model.name}'s context length ({limit})" if ctx > limit else None
