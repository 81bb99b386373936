"""``python -m mahout ring``: serve a model as a ring of layer-sliced stages (the shipped
Gemma 3 270M, or with ``--name`` any chat model of the catalog whose file `mahout add` registered
and whose architecture the engine runs).

Without ``--server`` it starts N stage processes on loopback (neighbours' addresses given
by hand), completes one prompt greedily and prints the text (and, on stderr, each stage's
hold/idle seconds). With ``--server`` and ``--token`` the stages find each other through
the control plane (`mahout.ring.member`, `mahout.ring.rendezvous`) and the bridge acts as
one mahout host: it claims jobs through the normal host API and feeds them to the ring.
``--stages N`` makes a ring of this host's own; ``--ring ID`` serves an operator's plan,
whose stages on other hosts run there as ``python -m mahout stage``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mahout.model_files import SHIPPED_MODEL
from mahout.owner import add_owner_arguments

if TYPE_CHECKING:
    from mahout.ring.local import ProcessRing

__all__ = ["add_parser", "cmd_ring"]


def add_parser(commands: argparse._SubParsersAction) -> None:
    ring = commands.add_parser("ring", help="serve a model as a pipeline of layer-sliced stages")
    ring.add_argument(
        "--stages", type=int, default=None, help="stage processes (at least two); with --ring, the plan's"
    )
    ring.add_argument("--prompt", help="complete this text and exit")
    ring.add_argument("--max-tokens", type=int, default=32)
    ring.add_argument("--threads", type=int, default=1, help="torch threads per stage")
    ring.add_argument("--micro-batch", type=int, default=4, help="rows per pass")
    ring.add_argument("--row-width", type=int, default=64, help="tokens per row (longer prompts are fed in chunks)")
    ring.add_argument("--n-ctx", type=int, default=1024)
    ring.add_argument(
        "--name",
        default=SHIPPED_MODEL,
        help="the catalog model to serve (default: %(default)s); its file is the one `mahout add` registered",
    )
    ring.add_argument("--model", default=None, help="GGUF path of that model (default: the file of --name)")
    ring.add_argument("--server", help="gateway URL: serve jobs as a mahout host")
    ring.add_argument("--token", help="host token (with --server)")
    ring.add_argument("--max-jobs", type=int, default=None, help="with --server: exit after this many jobs")
    ring.add_argument(
        "--parallel",
        type=int,
        default=None,
        help="with --server: jobs served at once, each in flight in the ring (default: the micro-batch)",
    )
    ring.add_argument("--home", help="mahout state directory (with --server)")
    ring.add_argument(
        "--ring",
        type=int,
        default=None,
        help="with --server: serve this ring plan (its stages and widths); run here the stages it gives this host",
    )
    ring.add_argument("--report-every", type=float, default=10.0, help="with --server: seconds between stats reports")
    ring.add_argument(
        "--bind",
        default=None,
        help="with --server: host the local stages listen on (default 127.0.0.1 when every stage runs "
        "here, else 0.0.0.0)",
    )
    ring.add_argument("--advertise", default=None, help="with --server: HOST the local stages advertise")
    ring.add_argument(
        "--relay",
        action="store_true",
        help="with --server: the local stages are reached through the gateway's ring relay (they fall back "
        "to it by themselves when the gateway refuses their address as not public)",
    )
    ring.add_argument(
        "--wait",
        type=float,
        default=300.0,
        help="with --server: seconds to wait for the stages to report reachable addresses",
    )
    ring.add_argument("--bench-tokens", type=int, default=32, help="with --server: tokens of the qualifying benchmark")
    add_owner_arguments(ring)


def _refuse(message: str) -> int:
    print(f"mahout: error: {message}", file=sys.stderr, flush=True)
    return 2


def cmd_ring(args: argparse.Namespace, say: Callable[[str], None] = print) -> int:
    if args.token and not args.server:
        return _refuse("--token needs --server")
    if args.ring is not None and not args.server:
        return _refuse("--ring needs --server (and the host's token: `mahout login`, $MAHOUT_TOKEN or --token)")
    if args.stages is None and args.ring is None:
        return _refuse("give --stages N (or --ring ID with --server)")
    if args.stages is not None and args.stages < 2:
        return _refuse("a pipeline needs at least two stages")
    if args.server is None and args.prompt is None:
        return _refuse("give --prompt TEXT, or --server URL (logged in with `mahout login`)")
    args.parallel = max(1, args.parallel or args.micro_batch)
    if args.server:
        from mahout.credentials import NoCredentials, credentials_resolve
        from mahout.home import resolve_home
        from mahout.ring.serve import serve_ring

        try:
            login = credentials_resolve(
                server=args.server,
                token=args.token,
                home=resolve_home(args.home),
                warn=lambda line: print(line, file=sys.stderr, flush=True),
            )
        except NoCredentials as exc:
            return _refuse(str(exc))
        args.server, args.token = login.server, login.token

        return serve_ring(args, say=say)
    from engine.gguf_loader import open_gguf, read_config
    from mahout.catalog import ModelUnavailable
    from mahout.home import resolve_home
    from mahout.ring.local import ProcessRing, split_layers
    from mahout.ring.membership import Limits
    from mahout.ring.model import ring_model

    try:
        model_path = ring_model(args.name, resolve_home(args.home), args.model).path
    except ModelUnavailable as exc:
        return _refuse(str(exc))
    ranges = split_layers(read_config(open_gguf(model_path)).n_layers, args.stages)
    limits = Limits(micro_batch=args.micro_batch, row_width=args.row_width)
    started = time.perf_counter()
    with ProcessRing(model_path, ranges, limits=limits, threads=args.threads, n_ctx=args.n_ctx) as ring:
        print(
            f"mahout: ring of {len(ranges)} stages {ranges} ready in {time.perf_counter() - started:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        return _complete(ring, model_path, args, say)


def _complete(ring: ProcessRing, model_path: str | Path, args: argparse.Namespace, say: Callable[[str], None]) -> int:
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(model_path)
    prompt_ids = tokenizer.encode(args.prompt)
    started = time.perf_counter()
    request = ring.bridge.submit(prompt_ids, args.max_tokens, stop_ids=[tokenizer.eos_id])
    tokens = request.result()
    seconds = time.perf_counter() - started
    text_ids = [t for t in tokens if t != tokenizer.eos_id]
    say(tokenizer.decode(text_ids))
    print(f"mahout: {len(tokens)} tokens in {seconds:.2f} s ({request.finish_reason})", file=sys.stderr, flush=True)
    for stage in ring.bridge.stats():
        print(
            f"mahout: stage {stage['stage']} layers [{stage['start']}, {stage['end']}): "
            f"held {stage['hold_s']:.2f} s, idle {stage['idle_s']:.2f} s, {stage['batches']} batches",
            file=sys.stderr,
            flush=True,
        )
    return 0
