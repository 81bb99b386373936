"""One stage of a control-plane ring, run by the host the plan assigns it to.

``python -m mahout stage --server URL --token TOKEN --ring ID --stage I``:

1. pull this host's assignment from the gateway (the layer range, the declared widths and
   the secrets of this stage's own links, `mahout.ring.keys`: its upstream's, its
   downstream's and, at the head and the tail, the bridge's);
2. load only that slice of the model;
3. bind a listening socket (``--bind``), report the address neighbours can dial
   (``--advertise``, or worked out from the bound socket) to the control plane; behind NAT
   (the gateway refuses that address as not public), or with ``--relay``, it reports the relay
   instead and holds a socket open to the gateway's ring relay, which carries every connection
   dialled to this stage (`mahout.ring.relay`, `stage_reach`);
4. dial the next stage at the address it reported (polling until it has; a clear error
   after ``--wait`` seconds), and serve: hidden states go agent to agent.

When a ring session ends (a neighbour or the bridge left) the stage tells the control plane
it left its address (`RingApi.leave`: its upstream and the bridge then wait for the next
report instead of dialling a socket that is gone), binds again, reports its new address and
rejoins, keeping its weights; ``--once`` exits instead. It clears its address on every way
out: the session ending, the owner coming back, a timeout, Ctrl-C and SIGTERM.

The machine stays its owner's (`mahout.owner`: `mahout pause`, ``--schedule``, the idle
detector unless ``--no-idle-detect``): a paused stage joins no ring, and a stage whose owner
comes back leaves its ring at once. It cannot finish or hand back the requests in flight
(each holds a cache row in every stage, and a middle stage cannot refuse a pass without
failing it), so they fail with the ring: the bridge reports their jobs failed and the
gateway continues each on another host from the text already streamed (seed 001). The
stages a bridge runs on its own machine (`LocalStages`) leave this to the bridge, which
stops claiming and lets the jobs in hand finish.

`LocalStages` runs the stages a host serves itself as such processes (``mahout ring``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mahout.credentials import TOKEN_ENV, credentials_resolve
from mahout.home import resolve_home
from mahout.owner import OwnerGuard, OwnerWatch, add_owner_arguments, owner_guard

if TYPE_CHECKING:
    import socket

    from mahout.ring.api import RingApi
    from mahout.ring.relay import StageRelay
    from mahout.ring.stage import StageAgent

__all__ = [
    "LocalStages",
    "StageNotAssigned",
    "add_parser",
    "address_not_public",
    "cmd_stage",
    "exit_on_sigterm",
    "find_assignment",
    "stage_reach",
]

ROOT = Path(__file__).resolve().parents[2]
OWNER_POLL_SECONDS = 1.0  # how often a stage asks whether its owner wants the machine
RELAY_WAIT_SECONDS = 10.0  # how long a relayed stage waits for its relay socket before reporting


class StageNotAssigned(LookupError):
    """The gateway does not assign that stage of that ring to this host."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    stage = commands.add_parser("stage", help="run one stage of a ring plan (on this machine) for the gateway")
    stage.add_argument(
        "--server", help="gateway URL, the control plane (default: from `mahout login`, or $MAHOUT_SERVER)"
    )
    stage.add_argument("--token", help="this host's token (visible in ps: prefer `mahout login` or $MAHOUT_TOKEN)")
    stage.add_argument("--ring", type=int, required=True, help="the ring plan's id")
    stage.add_argument("--stage", type=int, required=True, help="the stage's index in the plan")
    stage.add_argument(
        "--bind",
        default="0.0.0.0:0",
        help="HOST:PORT to listen on for the previous stage and the bridge (default 0.0.0.0:0, any port)",
    )
    stage.add_argument(
        "--advertise",
        default=None,
        help="HOST[:PORT] neighbours should dial (default: the bound address, or for a wildcard "
        "bind this machine's address on the route to the gateway)",
    )
    stage.add_argument(
        "--relay",
        action="store_true",
        help="be reached through the gateway's ring relay (every connection outbound); without it a "
        "stage whose address the gateway refuses as not public (behind NAT) uses the relay by itself",
    )
    stage.add_argument("--wait", type=float, default=300.0, help="seconds to wait for the next stage to be reachable")
    stage.add_argument("--threads", type=int, default=1, help="torch threads")
    stage.add_argument("--slots", type=int, default=None, help="requests in flight at once (default: 2 x micro-batch)")
    stage.add_argument("--n-ctx", type=int, default=1024)
    from engine.device import add_device_argument

    add_device_argument(stage)
    stage.add_argument(
        "--model", default=None, help="GGUF path (default: the file `mahout add` registered for the plan's model)"
    )
    stage.add_argument(
        "--evidence-mb",
        type=int,
        default=256,
        help="MiB kept of recent requests' evidence, for a failed audit's inquiry: on disk under --home "
        "(it outlives a restart) and as much again in memory for requests in flight (default 256; "
        "a stage that kept none of an inquired request is blamed)",
    )
    stage.add_argument("--once", action="store_true", help="exit when the ring session ends instead of rejoining")
    stage.add_argument("--home", help="state directory whose pause flag counts (default: $MAHOUT_HOME or ~/.mahout)")
    stage.add_argument("--bridged", action="store_true", help=argparse.SUPPRESS)  # the bridge here watches the owner
    add_owner_arguments(stage)


def find_assignment(assignments: list[dict], ring_id: int, index: int) -> dict:
    """This host's assignment for stage `index` of ring `ring_id`."""
    for assignment in assignments:
        if assignment["ring"] == ring_id and assignment["stage"] == index:
            return assignment
    mine = ", ".join(f"ring {a['ring']} stage {a['stage']}" for a in assignments) or "none"
    raise StageNotAssigned(f"the gateway does not assign stage {index} of ring {ring_id} to this host (yours: {mine})")


def exit_on_sigterm() -> Any:
    """Make SIGTERM raise SystemExit (so ``finally`` blocks run); returns the previous handler,
    or None off the main thread. While the host loops run they handle SIGTERM themselves."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(143))


def cmd_stage(args: argparse.Namespace, say: Callable[[str], None] = print) -> int:
    """Serve one stage of a ring plan until stopped (or, with ``--once``, one ring session)."""
    import torch

    from engine.gguf_loader import load_stage
    from engine.model import Stage
    from mahout.api import HostApi
    from mahout.catalog import ModelUnavailable
    from mahout.link import LinkClosed, listen
    from mahout.ring.api import RingApi
    from mahout.ring.evidence import EvidenceStore, EvidenceUploader
    from mahout.ring.keys import StageKeys
    from mahout.ring.membership import Limits
    from mahout.ring.model import ring_model
    from mahout.ring.rendezvous import RendezvousTimeout, dial_stage, parse_address
    from mahout.ring.stage import StageAgent

    if args.evidence_mb < 1:
        say(f"mahout: error: --evidence-mb must be at least 1, not {args.evidence_mb}")
        return 2
    exit_on_sigterm()  # so the `finally` that clears the stage's address runs
    home = resolve_home(args.home)
    login = credentials_resolve(
        server=args.server, token=args.token, home=home, warn=lambda line: print(line, file=sys.stderr, flush=True)
    )
    guard = None if args.bridged else owner_guard(args, home)
    args.server = login.server
    api = RingApi(login.server, login.token)
    uploader: EvidenceUploader | None = None
    try:
        try:
            plan = find_assignment(api.assignment(), args.ring, args.stage)
        except StageNotAssigned as exc:
            say(f"mahout: error: {exc}")
            return 2
        torch.set_num_threads(args.threads)
        start, end, n_stages = plan["start"], plan["end"], len(plan["stages"])
        try:
            path = args.model or ring_model(plan["model"], home).path
        except ModelUnavailable as exc:
            say(f"mahout: error: stage {args.stage} of ring {args.ring}: {exc}")
            return 2
        config, weights = load_stage(path, start, end, share_output=True)
        if config.n_layers != plan["n_layers"]:
            say(f"mahout: error: the plan is for {plan['n_layers']} layers, this model has {config.n_layers}")
            return 2
        limits = Limits(micro_batch=plan["micro_batch"], row_width=plan["row_width"])
        keys = StageKeys.from_wire(args.stage, n_stages, plan["links"])
        caps = limits.frame_caps(d_model=config.d_model, n_ctx=args.n_ctx)
        bind = parse_address(args.bind, default_host="0.0.0.0")
        # kept across ring sessions and restarts: an inquiry may come after the ring re-formed
        evidence = EvidenceStore(
            args.evidence_mb * 2**20, spool=home / "evidence" / f"ring-{args.ring}-stage-{args.stage}"
        )
        uploader = EvidenceUploader(
            HostApi(login.server, login.token), evidence, ring_id=args.ring, stage=args.stage, say=say
        ).start()
        while True:
            if guard is not None:
                _wait_until_free(guard, args.stage, say)
            server = listen(*bind)
            stage = Stage(
                config,
                weights,
                start,
                end,
                n_rows=args.slots or 2 * limits.micro_batch,
                n_ctx=args.n_ctx,
                device=args.device,
            )
            agent = StageAgent(
                stage,
                limits=limits,
                keys=keys,
                server=server,
                vocab_path=path,
                evidence=evidence,
                dial_next=lambda: dial_stage(
                    api,
                    args.ring,
                    keys.downstream_index,
                    secret=keys.downstream,
                    caps=caps,
                    timeout=args.wait,
                    hello=keys.hello(),
                    name="next",
                    say=say,
                ),
            )

            reach = stage_reach(
                api,
                args,
                server,
                say=say,
                start_relay=lambda local: _relay_for(login.server, login.token, args, local, say),
            )
            if reach is None:
                agent.close()
                return 2
            address, relay, reported = reach
            say(
                f"mahout: stage {args.stage} of ring {args.ring}, layers [{start}, {end}), "
                f"listening on {server.getsockname()[0]}:{server.getsockname()[1]}, advertised as {address}"
            )
            threading.Thread(
                target=lambda a=agent: say(f"mahout: stage {args.stage} READY") if a.ready.wait() else None,
                daemon=True,
            ).start()
            watch = _leave_when_the_owner_returns(guard, agent, args.stage, say) if guard is not None else None
            try:
                agent.serve()
            except RendezvousTimeout as exc:
                say(f"mahout: error: {exc}")
                return 1
            except LinkClosed as exc:
                say(f"mahout: stage {args.stage}: {exc}")
            finally:
                if watch is not None:
                    watch.stop()
                _leave_address(api, args.ring, args.stage, reported, say)
                if relay is not None:
                    relay.stop()
            say(f"mahout: stage {args.stage}: the ring session ended" + ("" if args.once else "; rejoining"))
            if args.once:
                return 0
    finally:
        if uploader is not None:
            uploader.stop()
            uploader.store.flush()  # what ended here is on disk before the process goes
        api.close()


def address_not_public(exc: Exception) -> bool:
    """Whether the gateway refused a reported address as not public (a ring of several owners'
    machines dials only public addresses, `mesh.rings.services`): the stage is behind NAT."""
    from mahout.api import HostApiError

    return isinstance(exc, HostApiError) and (exc.code == "address_not_public" or "is not public" in exc.message)


def stage_reach(
    api: RingApi,
    args: argparse.Namespace,
    server: socket.socket,
    *,
    start_relay: Callable[[tuple[str, int]], StageRelay],
    say: Callable[[str], None] = print,
) -> tuple[str, StageRelay | None, str] | None:
    """Report where neighbours reach this stage: (the address reported, its relay socket or
    None, the address as the gateway answered it); None after saying why it cannot be reported.
    `start_relay(local)` opens the relay socket carrying connections to `local`, the bound one.

    ``--relay``: through the gateway's ring relay. Otherwise its own address (``--advertise``,
    or worked out from the bound socket); when the gateway refuses that as not public, the
    stage is behind NAT and falls back to the relay by itself, as expert workers use theirs
    (`mahout.moe`), so a ring of strangers' machines behind home routers forms with no flag.
    An address given with ``--advertise`` is not replaced: its refusal says what to do."""
    from mahout.api import HostApiError
    from mahout.ring.relay import RELAY_ADDRESS
    from mahout.ring.rendezvous import advertised_address

    if not args.relay:
        address = advertised_address(server, args.advertise, args.server)
        try:
            return address, None, str(api.report_address(args.ring, args.stage, address).get("address") or address)
        except HostApiError as exc:
            if not address_not_public(exc):
                raise
            if args.advertise:
                say(
                    f"mahout: error: {exc.message} (behind NAT, leave "
                    "out --advertise or give --relay: the stage is then "
                    "reached through the gateway's ring relay)"
                )
                return None
            say(
                f"mahout: stage {args.stage}: the gateway does not let "
                f"neighbours dial {address} (not public: behind NAT); "
                "reached through the gateway's ring relay instead"
            )
    relay = start_relay(server.getsockname()[:2])
    try:
        return (
            RELAY_ADDRESS,
            relay,
            str(api.report_address(args.ring, args.stage, RELAY_ADDRESS).get("address") or RELAY_ADDRESS),
        )
    except BaseException:
        relay.stop()
        raise


def _relay_for(
    server: str, token: str, args: argparse.Namespace, local: tuple[str, int], say: Callable[[str], None]
) -> StageRelay:
    """This stage's end of the gateway's ring relay, carrying connections to `local`; waited
    for a little, so its first neighbours are not dialling into nothing."""
    from mahout.ring.relay import StageRelay

    relay = StageRelay(server, token, args.ring, args.stage, local, out=say).start()
    if not relay.connected.wait(RELAY_WAIT_SECONDS):
        say(f"mahout: stage {args.stage}: the ring relay is not connected yet; retrying in the background")
    return relay


def _leave_address(api: RingApi, ring_id: int, index: int, address: str, say: Callable[[str], None]) -> None:
    """Tell the control plane this stage no longer listens at `address`; if it cannot be
    told, neighbours find the address dead when they dial it (they read it again, then time out)."""
    from mahout.api import HostApiError, ServerUnavailable

    try:
        api.leave(ring_id, index, address)
    except (HostApiError, ServerUnavailable) as exc:
        say(f"mahout: stage {index}: could not clear its address {address} ({exc})")


def _wait_until_free(guard: OwnerGuard, index: int, say: Callable[[str], None]) -> None:
    """Block while the owner wants the machine: a paused stage joins no ring."""
    said = None
    while (reason := guard.reason()) is not None:
        if reason != said:
            say(f"mahout: stage {index}: paused ({reason}): not joining the ring until free")
            said = reason
        time.sleep(OWNER_POLL_SECONDS)
    if said is not None:
        say(f"mahout: stage {index}: resumed: joining the ring")


def _leave_when_the_owner_returns(
    guard: OwnerGuard, agent: StageAgent, index: int, say: Callable[[str], None]
) -> OwnerWatch:
    """Close `agent` (ending the ring session) as soon as the owner wants the machine back."""

    def on_change(reason: str | None) -> None:
        if reason:
            say(f"mahout: stage {index}: paused ({reason}): leaving the ring; its requests in flight fail over")
            agent.close()

    return OwnerWatch(guard, on_change, poll_s=OWNER_POLL_SECONDS).start()


class LocalStages:
    """The stages of a ring this host runs itself, as ``python -m mahout stage`` processes.

    Their output goes to this process's stdout. `revive()` restarts any that exited (each
    rejoins by itself while it lives); `close()` stops them all.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        ring_id: int,
        indices: list[int],
        *,
        bind_host: str,
        say: Callable[[str], None] = print,
    ) -> None:
        self.args, self.ring_id, self.bind_host, self.say = args, ring_id, bind_host, say
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        for index in indices:
            self._start(index)

    def _start(self, index: int) -> None:
        a = self.args
        command = [
            sys.executable,
            "-m",
            "mahout",
            "stage",
            "--server",
            a.server,
            "--ring",
            str(self.ring_id),
            "--stage",
            str(index),
            "--bind",
            f"{self.bind_host}:0",
            "--threads",
            str(a.threads),
            "--n-ctx",
            str(a.n_ctx),
            "--wait",
            str(a.wait),
            *(["--model", str(a.model)] if a.model else []),
            *(["--advertise", a.advertise] if a.advertise else []),
            *(["--relay"] if a.relay else []),
            "--bridged",
        ]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            TOKEN_ENV: a.token,
        }  # the token in the environment, not on a command line every user can read
        self.procs[index] = subprocess.Popen(command, cwd=ROOT, env=env)

    def revive(self) -> None:
        for index, proc in list(self.procs.items()):
            if proc.poll() is not None:
                self.say(f"mahout: local stage {index} exited with code {proc.returncode}; restarting it")
                self._start(index)

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs.values()]

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
