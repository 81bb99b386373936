"""Command line: ``mahout login|run|logs|benchmark|pause|resume|status|ring|stage|moe``
(``python -m mahout …`` in a checkout)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from mahout import command_name
from mahout.credentials import NoCredentials, credentials_resolve, credentials_save
from mahout.home import is_paused, resolve_home, set_paused
from mahout.logfile import log_path, open_log
from mahout.owner import add_owner_arguments

if TYPE_CHECKING:
    from mahout.catalog import CatalogFile

LOGGED_COMMANDS = ("run", "ring", "stage", "moe", "benchmark", "add", "install-service")  # to the home's log file too
_log = logging.getLogger("mahout.cli")
_log.propagate = False
# Until a command opens the log file, its lines go nowhere but the terminal: without a handler,
# logging's last resort would print each warning to stderr a second time.
_log.addHandler(logging.NullHandler())


def say(line: str) -> None:
    """Print a status line at once (stdout may be a pipe to a supervisor), and log it."""
    print(line, flush=True)
    _log.info(line)


def warn(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
    _log.warning(line)


def _add_home(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--home", help="state directory (default: $MAHOUT_HOME or ~/.mahout)")


def _add_threads(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=None, help="CPU threads per model (default: half the CPUs)")


def _models(text: str) -> list[str]:
    """``--models`` as a list of names (checked against the home's models once it is known)."""
    from mahout.catalog import split_models

    try:
        return split_models(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _served(names: list[str], home: Path) -> list[str]:
    """`names` when this home can serve each (shipped, or added with `mahout add`); ModelUnavailable otherwise."""
    from mahout.catalog import ModelUnavailable, known_models, parse_models

    try:
        return parse_models(",".join(names), known_models(home))
    except ValueError as exc:
        raise ModelUnavailable(str(exc)) from None


def _gpu_layers(text: str) -> str | int:
    from mahout.gpu import parse_gpu_layers

    try:
        return parse_gpu_layers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: must be auto or a number of layers (0: none)") from exc


def _slots(text: str) -> int:
    """Jobs at once: 1 to the most a heartbeat may report (`protocol.catalog.MAX_SLOTS`)."""
    from protocol.catalog import MAX_SLOTS

    value = _positive(text)
    if value > MAX_SLOTS:
        raise argparse.ArgumentTypeError(f"at most {MAX_SLOTS} jobs at once (a heartbeat reporting more is refused)")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of MB, not {text}")
    return value


def _add_models(parser: argparse.ArgumentParser) -> None:
    from mahout.catalog import CATALOG, DEFAULT_MODELS

    known, default = ", ".join(CATALOG), ", ".join(DEFAULT_MODELS)
    parser.add_argument(
        "--models",
        type=_models,
        default=list(DEFAULT_MODELS),
        help=f"comma-separated models to serve: shipped ({known}) or any catalog model whose file "
        f"`mahout add` recorded (default: {default})",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand."""
    parser = argparse.ArgumentParser(prog="mahout", description="Elephant host client")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="serve jobs for the gateway")
    run.add_argument(
        "--server",
        help="gateway base URL, e.g. http://127.0.0.1:8000 (default: from `mahout login`, or $MAHOUT_SERVER)",
    )
    run.add_argument("--token", help="host token (visible in ps: prefer `mahout login` or $MAHOUT_TOKEN)")
    add_owner_arguments(run)  # --idle-detect, --idle-threshold, --schedule: as every command that serves others' work
    run.add_argument("--max-jobs", type=int, default=None, help="exit after this many jobs")
    run.add_argument("--once", action="store_true", help="make one claim attempt, then exit")
    run.add_argument("--rebenchmark", action="store_true", help="ignore the cached benchmark")
    run.add_argument(
        "--memory-budget-mb",
        type=_positive,
        default=None,
        help="memory for loaded models; the least recently used is unloaded to fit (default: half the RAM)",
    )
    run.add_argument(
        "--slots",
        type=_slots,
        default=_slots(os.environ["MAHOUT_SLOTS"]) if os.environ.get("MAHOUT_SLOTS") else None,
        help="jobs a chat model serves at once from one load (default: $MAHOUT_SLOTS, else the number "
        "its benchmark measured best on this machine)",
    )
    bench = commands.add_parser("benchmark", help="find and benchmark the models (default: the shipped chat model)")
    bench.add_argument("--rebenchmark", action="store_true", help="ignore the cached benchmark")
    status = commands.add_parser(
        "status", help="show this host's state, its current job and its earnings (when logged in)"
    )
    status.add_argument("--json", action="store_true", help="print the local state and the gateway's answers as JSON")
    status.add_argument("--server")
    status.add_argument("--token")
    service = commands.add_parser(
        "install-service", help="start mahout with the machine (systemd user unit / launchd agent)"
    )
    service.add_argument("--no-enable", action="store_true", help="write the unit only; enable it yourself")
    service.add_argument(
        "run_args",
        nargs=argparse.REMAINDER,
        help="options for `mahout run` after --, e.g. -- --schedule 22:00-08:00 --threads 4",
    )
    add = commands.add_parser("add", help="serve a model file the gateway's catalog sells (matched by its sha256)")
    add.add_argument("path", type=Path, help="a model file, e.g. ~/models/gemma-3-270m-Q4_K_M.gguf")
    add.add_argument(
        "--server",
        help="gateway whose catalog to match (default: from `mahout login`, or $MAHOUT_SERVER; "
        "none: the files mahout ships knowing)",
    )
    add.add_argument("--token", help="host token (prefer `mahout login` or $MAHOUT_TOKEN)")
    logs = commands.add_parser("logs", help="print the end of what `run` said (the home's log file); -f: and follow it")
    logs.add_argument(
        "-f", "--follow", action="store_true", help="keep printing lines as they are written (Ctrl-C stops)"
    )
    logs.add_argument("-n", "--lines", type=int, default=50, help="how many of the last lines to print (default: 50)")
    login = commands.add_parser("login", help="check a host token with the gateway and keep it in the home (mode 0600)")
    login.add_argument("--server", required=True, help="gateway base URL")
    login.add_argument("--token-stdin", action="store_true", help="read the token from standard input (no prompt)")
    for sub in (run, bench):
        _add_threads(sub)
        _add_models(sub)
        sub.add_argument(
            "--gpu-layers",
            type=_gpu_layers,
            default="auto",
            help="model layers on the GPU: auto (default: every layer that fits its free memory), "
            "a number, or 0 for none",
        )
    from mahout.ring.cli import add_parser as add_ring_parser
    from mahout.ring.member import add_parser as add_stage_parser

    add_ring_parser(commands)
    add_stage_parser(commands)
    from mahout.moe.cli import add_parser as add_moe_parser  # the MoE expert market

    add_moe_parser(commands)
    for sub in (
        run,
        bench,
        status,
        login,
        logs,
        add,
        service,
        commands.add_parser("pause", help="stop claiming new jobs"),
        commands.add_parser("resume", help="claim jobs again"),
    ):
        _add_home(sub)
    return parser


def cmd_run(args: argparse.Namespace) -> int:
    """Qualify the chosen models and serve until stopped; exit 2 when one cannot fit the budget."""
    from mahout.api import HostApi
    from mahout.host import default_threads, gpu_setup, start_host
    from mahout.idle import IdleDetector
    from mahout.loader import BudgetError
    from mahout.presence import presence

    home = resolve_home(args.home)
    models = _served(args.models, home)
    login = credentials_resolve(server=args.server, token=args.token, home=home, warn=warn)
    idle = IdleDetector(args.idle_threshold) if args.idle_detect else None
    api = HostApi(login.server, login.token)
    try:
        api.me()  # before minutes of assembling and benchmarking: a rotated or revoked token is refused at once
        loop = start_host(
            api,
            home,
            args.threads or default_threads(),
            models=models,
            memory_budget_mb=args.memory_budget_mb,
            idle=idle,
            rebenchmark=args.rebenchmark,
            out=say,
            gpu=gpu_setup(args.gpu_layers, out=say),
            slots=args.slots,
        )
        loop.schedule = args.schedule
        say(
            f"mahout: serving {', '.join(loop.models.qualified)} for {login.server} "
            f"(loaded: {', '.join(loop.models.loaded()) or 'none'}; memory budget {loop.models.budget_mb} MB; "
            f"{loop.slots} job(s) at once)"
        )
        with presence(login.server, login.token, out=say) as socket:
            api.use_socket(socket)
            handled = loop.run(max_jobs=args.max_jobs, once=args.once)
    except BudgetError as exc:
        warn(f"mahout: error: {exc}")
        return 2
    finally:
        api.close()
    if loop.upgrade_required:
        warn(f"mahout: error: {loop.upgrade_required}")
        return 3
    say(f"mahout: stopped after {handled} job(s)")
    return 0


def cmd_benchmark(args: argparse.Namespace) -> int:
    """Benchmark the chosen models; per model a line naming the weights, then the result as JSON."""
    from mahout.host import benchmark_model, default_threads, gpu_setup

    home = resolve_home(args.home)
    models = _served(args.models, home)
    gpu = gpu_setup(args.gpu_layers, out=say)
    for name in models:
        model = benchmark_model(
            name, home, args.threads or default_threads(), rebenchmark=args.rebenchmark, out=say, gpu=gpu
        )
        say(f"mahout: model {model.path} sha256 {model.sha256}")
        say(json.dumps({"model": name, "fingerprint": model.fingerprint, **model.benchmark}))
    return 0


def cmd_install_service(args: argparse.Namespace) -> int:
    """Write the service that runs `mahout run` at startup; needs `mahout login` first (the token
    is not in the unit)."""
    from mahout.autostart import install_service
    from mahout.credentials import credentials_path

    home = resolve_home(args.home)
    if not credentials_path(home).is_file():
        warn(
            "mahout: error: log in first (mahout login --server URL): the service reads the token from the home, "
            "never from its unit file"
        )
        return 2
    run_args = [arg for arg in args.run_args if arg != "--"]
    try:
        build_parser().parse_args(["run", *run_args])  # a bad option fails now, not at the next boot
        installed = install_service(home, run_args, enable=not args.no_enable)
    except RuntimeError as exc:
        warn(f"mahout: error: {exc}")
        return 2
    say(f"mahout: wrote {installed.path}" + ("; enabled and started" if installed.started else ""))
    for line in [*installed.next, f"{command_name()} logs -f  # what it says, as it says it"]:
        say(f"mahout: next: {line}")
    return 0


def cmd_add(args: argparse.Namespace) -> int:
    """Hash a model file; when the catalog sells it, record it in the home under the catalog's
    name, so `run --models NAME` serves it from where it is."""
    from mahout.catalog import CATALOG, DEFAULT_MODELS, catalog_match, file_sha256
    from mahout.model_files import model_add

    path = args.path.expanduser()
    if not path.is_file():
        warn(f"mahout: error: {path} is not a file")
        return 2
    home = resolve_home(args.home)
    files, source = _catalog_for_add(args, home)
    say(f"mahout: hashing {path} ({path.stat().st_size / 1e6:.0f} MB)")
    sha256 = file_sha256(path)
    matches = catalog_match(sha256, files)
    if not matches:
        sold = "; ".join(entry.describe() for entry in files) or "nothing"
        warn(
            f"mahout: error: {path} (sha256 {sha256}) is no catalog model's file, so it cannot be served "
            f"(another quantisation or another model, perhaps). {source} sells: {sold}"
        )
        return 2
    servable = [entry for entry in matches if entry.kind == "chat" or entry.name in CATALOG]
    if not servable:
        names = ", ".join(entry.name for entry in matches)
        warn(
            f"mahout: error: {path} is the catalog's {names}, an embeddings model; mahout serves embeddings only "
            f"with the model it ships ({', '.join(n for n, spec in CATALOG.items() if spec.kind == 'embeddings')})"
        )
        return 2
    for entry in servable:
        model_add(home, entry.name, path, sha256, entry=entry.record())
        serve = f"{command_name()} run" + ("" if entry.name in DEFAULT_MODELS else f" --models {entry.name}")
        say(
            f"mahout: {path} is the catalog's {entry.name} ({entry.quantization or 'quantisation unknown'}, "
            f"sha256 {sha256[:16]}…); `{serve}` serves it from there."
        )
    return 0


def _catalog_for_add(args: argparse.Namespace, home: Path) -> tuple[list[CatalogFile], str]:
    """The catalog to match a file against, and who says so: the gateway's (logged in), or the
    files mahout ships knowing when there is no login or no answer. A refused token raises."""
    from mahout.api import HostApi, HostApiError, ServerUnavailable
    from mahout.catalog import catalog_listing, offline_catalog

    offline = "The catalog as mahout knows it offline"
    try:
        login = credentials_resolve(server=args.server, token=args.token, home=home, warn=warn)
    except NoCredentials:
        say(
            "mahout: not logged in, so matching only the files mahout ships knowing; "
            f"`{command_name()} login --server URL` matches the gateway's whole catalog"
        )
        return offline_catalog(), offline
    api = HostApi(login.server, login.token, retries=1)
    try:
        return catalog_listing(api.catalog()), f"The catalog at {login.server}"
    except ServerUnavailable as exc:
        say(f"mahout: {login.server} did not answer ({exc}); matching only the files mahout ships knowing")
    except HostApiError as exc:
        if exc.status != 404:  # 404: a gateway from before the catalog endpoint
            raise
        say(f"mahout: {login.server} lists no catalog to hosts; matching only the files mahout ships knowing")
    finally:
        api.close()
    return offline_catalog(), offline


def cmd_login(args: argparse.Namespace) -> int:
    """Check the token with the gateway (GET /hosts/api/me), then keep it where `run` finds it."""
    import getpass

    from mahout.api import HostApi

    token = (
        sys.stdin.readline().strip() if args.token_stdin else getpass.getpass("Host token (from My machines): ").strip()
    )
    if not token:
        warn("mahout: error: no token given")
        return 2
    api = HostApi(args.server.rstrip("/"), token, retries=1)
    try:
        me = api.me()  # a refused token raises HostApiError: main says why, nothing is saved
    finally:
        api.close()
    path = credentials_save(resolve_home(args.home), args.server, token)
    say(
        f"mahout: logged in as host {me.get('name')!r} (id {me.get('id')}) at {args.server.rstrip('/')}; "
        f"token kept in {path} (readable by you only). Start serving with: {command_name()} run"
    )
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    """Print the last lines of the home's log file; with --follow, then every line written to it
    until Ctrl-C. Exit 1 when there is no log and nothing to follow."""
    import threading

    from mahout.logfile import follow, tail

    path = log_path(resolve_home(args.home))
    if not path.is_file() and not args.follow:
        warn(f"mahout: no log at {path} yet: `{command_name()} run` writes one")
        return 1
    for line in tail(path, args.lines):
        print(line, flush=True)
    if args.follow:
        try:
            follow(path, lambda line: print(line, flush=True), stop=threading.Event())
        except KeyboardInterrupt:
            pass
    return 0


def cmd_pause(args: argparse.Namespace) -> int:
    set_paused(resolve_home(args.home), True)
    say("mahout: paused (no new jobs will be claimed)")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    set_paused(resolve_home(args.home), False)
    say("mahout: resumed")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Print local state; when logged in (or given the gateway and token) also the server's view."""
    from mahout.model_files import SHIPPED_MODEL, model_path, recorded_sha256

    home = resolve_home(args.home)
    local = {
        "home": str(home),
        "paused": is_paused(home),
        "model": str(model_path(home, SHIPPED_MODEL)),
        "model_assembled": recorded_sha256(home) is not None,
    }
    say(
        json.dumps(local)
        if args.json
        else f"mahout: home {home}; pause flag {'set' if local['paused'] else 'off'}; "
        f"model {'assembled' if local['model_assembled'] else 'not assembled yet'}"
    )
    try:
        login = credentials_resolve(server=args.server, token=args.token, home=home, warn=warn)
    except NoCredentials:
        if not args.json:
            say("mahout: not logged in (mahout login --server URL), so no state from the gateway")
        return 0  # not logged in: the local state is all there is
    from mahout.api import HostApi

    api = HostApi(login.server, login.token, retries=1)
    try:
        me, earnings = api.me(), api.earnings()
    finally:
        api.close()
    if args.json:
        say(json.dumps({"me": me, "earnings": earnings}))
        return 0
    for line in status_lines(login.server, me, earnings):
        say(line)
    return 0


def status_lines(server: str, me: dict, earnings: dict) -> list[str]:
    """The gateway's view of this host, for a person: state, current jobs, earnings."""
    state = me.get("status", "unknown")
    if me.get("maintenance_reason"):
        state += f" ({me['maintenance_reason']})"
    lines = [f"mahout: host {me.get('name')!r} (id {me.get('id')}) at {server}: {state}"]
    jobs = me.get("active_jobs") or []
    lines += [
        f"mahout: running job {job['id']} ({job['model']}) since {job.get('claimed_at') or '?'}" for job in jobs
    ] or ["mahout: no job running"]
    pending = int(earnings.get("balance_ucents") or 0)
    lines.append(
        f"mahout: earned today {_usd(earnings.get('today_ucents'))}; pending {_usd(pending)} "
        f"(payable now {_usd(earnings.get('payable_ucents'))}, still vesting {_usd(earnings.get('unvested_ucents'))})"
    )
    return lines


def _usd(ucents: int | None) -> str:
    """µ¢ as dollars (1 USD = 100,000,000 µ¢), to the micro-cent."""
    return f"${int(ucents or 0) / 100_000_000:.8f}"


def cmd_ring(args: argparse.Namespace) -> int:
    """Serve the shipped model as a ring of layer-sliced stage processes (see mahout.ring.cli)."""
    from mahout.ring.cli import cmd_ring as run_ring

    return run_ring(args, say=say)


def cmd_stage(args: argparse.Namespace) -> int:
    """Run one stage of a ring plan on this machine, found through the gateway (see mahout.ring.member)."""
    from mahout.ring.member import cmd_stage as run_stage

    return run_stage(args, say=say)


def cmd_moe(args: argparse.Namespace) -> int:
    """Take part in the MoE expert market (see mahout.moe.cli)."""
    from mahout.moe.cli import cmd_moe as run_moe

    return run_moe(args, say=say)


COMMANDS = {
    "run": cmd_run,
    "login": cmd_login,
    "logs": cmd_logs,
    "add": cmd_add,
    "install-service": cmd_install_service,
    "benchmark": cmd_benchmark,
    "pause": cmd_pause,
    "resume": cmd_resume,
    "status": cmd_status,
    "ring": cmd_ring,
    "stage": cmd_stage,
}
COMMANDS["moe"] = cmd_moe  # the MoE expert market (mahout.moe), kept as its own block


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; API refusals and an unreachable server exit with code 2 and one line."""
    from mahout.api import HostApiError, ServerUnavailable
    from mahout.catalog import ModelUnavailable

    args = build_parser().parse_args(argv)
    if args.command in LOGGED_COMMANDS:
        open_log(resolve_home(getattr(args, "home", None)), _log)
    try:
        return COMMANDS[args.command](args)
    except (HostApiError, ServerUnavailable, NoCredentials, ModelUnavailable) as exc:
        warn(f"mahout: error: {exc}{refusal_hint(exc, args.command)}")
        return 2


def refusal_hint(exc: Exception, command: str) -> str:
    """What to do about a refused token (401: unknown, rotated or revoked; 403: the host banned or
    its owner's account deactivated), appended to the error line; "" for any other error."""
    from mahout.api import HostApiError

    if not isinstance(exc, HostApiError) or exc.status not in (401, 403):
        return ""
    if command == "login":
        return " (copy the token again from My machines: a rotated or revoked one is refused)"
    return (
        f" (this token may have been rotated, revoked or banned: see My machines, then "
        f"`{command_name()} login --server URL`)"
    )


if __name__ == "__main__":
    sys.exit(main())
