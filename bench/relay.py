"""The relay under a pool of streams: many customers, one synthetic host, one gateway process.

A synthetic host (`testkit.simhost --stream-batches`, its own process, speaking the
documented host API) streams timestamped 5-word batches every 50 ms into C concurrent
`AsyncOpenAI` chat streams. Each batch's first word is `@SEQ:SENT_AT`, so the reader times
every batch (push → customer) and checks the text: every batch exactly once, in order.

    .venv/bin/python bench/relay.py [--streams 25] [--batches 100] [--socket ws-claims|ws|http]
        [--baseline DIR [--baseline-path http|ws|ws-claims]] [--heavy 20]

`--heavy N` sends N requests with a `minItems: 1e7` schema (a good key) a second into each
round, from a child process, and reports their statuses and slowest answer beside the streams' chunk delays.

Reports, per C: offered and relayed batches/s, chunk delay p50/p99/max, batches lost,
duplicated or reordered, gateway CPU per 1,000 batches, and the load generator's CPU
(this process and the synthetic host: they share the machine with the gateway).
Each gateway gets a fresh SQLite file, or with DATABASE_URL a fresh PostgreSQL database
beside it (pair it with REDIS_URL). `--baseline DIR` measures a baseline checkout too
(`git worktree add DIR COMMIT`), alternating with this one, and prints the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MARK = re.compile(r" @(\d+):(\d+\.\d+)")
TICKS = os.sysconf("SC_CLK_TCK")


class Target:
    """One gateway under test: a checkout (this one, or a baseline's git worktree) with its
    own database, migrated by its own code, its customer and host made by its own commands."""

    def __init__(self, name: str, root: Path, tmp: Path) -> None:
        self.name, self.root, self.env = (
            name,
            root,
            dict(
                os.environ,
                QUEUE_TIMEOUT_SECONDS="60",
                HOST_PROBATION_MAX_JOBS="64",  # one host runs every stream
                MAHOUT_UNVERSIONED_ALLOWED="1",
            ),
        )  # the synthetic host says "sim"
        base_url = os.environ.get("DATABASE_URL")
        if base_url:
            database = f"elephant_relay_{name}_{os.getpid()}"
            self.env["DATABASE_URL"] = base_url.rsplit("/", 1)[0] + "/" + database
            admin = base_url.rsplit("/", 1)[0] + "/postgres"
            subprocess.run(
                [
                    sys.executable,
                    "-c",
                    f"import psycopg; c = psycopg.connect({admin!r}, autocommit=True); "
                    f"c.execute('DROP DATABASE IF EXISTS {database}'); c.execute('CREATE DATABASE {database}')",
                ],
                check=True,
            )
        else:
            self.env["SQLITE_PATH"] = str(tmp / f"{name}.sqlite3")
        self.manage("migrate", "--noinput")
        self.gateways: list[subprocess.Popen] = []

    def manage(self, *argv: str) -> str:
        """Run a management command of this checkout; its last line (a key or a token)."""
        done = subprocess.run(
            [sys.executable, "manage.py", *argv], cwd=self.root, env=self.env, capture_output=True, text=True
        )
        if done.returncode:
            raise SystemExit(f"{self.name}: manage.py {' '.join(argv)} failed:\n{done.stderr}")
        return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""

    def start(self, port: int, log: Path, workers: int = 1) -> str:
        """One daphne on `port`, or `workers` of them behind HAProxy on `port` (as `WORKERS=N make run`)."""

        def daphne(listen: int) -> subprocess.Popen:
            return subprocess.Popen(
                [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(listen), "config.asgi:application"],
                cwd=self.root,
                env=self.env,
                stdout=open(f"{log}.{listen}", "w"),
                stderr=subprocess.STDOUT,
            )

        if workers <= 1:
            self.gateways = [daphne(port)]
        else:
            from config.balancer import haproxy_config

            backends = [port + 1 + index for index in range(workers)]
            self.gateways = [daphne(backend) for backend in backends]
            config = Path(f"{log}.haproxy.cfg")
            config.write_text(haproxy_config(port=port, backends=backends))
            try:
                self.balancer = subprocess.Popen(
                    ["haproxy", "-db", "-f", str(config)], stdout=open(f"{log}.haproxy", "w"), stderr=subprocess.STDOUT
                )
            except OSError:  # no HAProxy (apt-get install haproxy): leave no gateway behind
                self.stop()
                raise
        server = f"http://127.0.0.1:{port}"
        import httpx

        for _ in range(300):
            try:
                if httpx.get(f"{server}/v1/models", timeout=1).status_code == 401:
                    if workers > 1:
                        time.sleep(2)  # every backend passed its health check
                    return server
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"{self.name}: the gateway never answered (see {log})")

    def cpu(self) -> float:
        return sum(cpu_seconds(gateway.pid) for gateway in self.gateways)

    def stop(self) -> None:
        for gateway in self.gateways:
            gateway.terminate()
            gateway.wait(timeout=10)
        if getattr(self, "balancer", None) is not None:
            self.balancer.terminate()
            self.balancer.wait(timeout=10)
            self.balancer = None


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


def check_text(text: str, batches: int) -> tuple[list[int], int, int, int]:
    """The batch numbers in the order they arrived, and how many were lost, duplicated, reordered."""
    seqs = [int(m.group(1)) for m in MARK.finditer(text)]
    lost = len(set(range(batches)) - set(seqs))
    duplicated = len(seqs) - len(set(seqs))
    reordered = sum(1 for a, b in zip(seqs, seqs[1:], strict=False) if b < a)
    return seqs, lost, duplicated, reordered


async def text_pieces(client, door: str):  # type: ignore[no-untyped-def]
    """A stream's text as it arrives, through the chat door or the Responses API's."""
    if door == "responses":
        events = await client.responses.create(model="gemma-3-270m", input="relay", max_output_tokens=3000, stream=True)
        async for event in events:
            if event.type == "response.output_text.delta" and event.delta:
                yield event.delta
        return
    chunks = await client.chat.completions.create(
        model="gemma-3-270m",
        messages=[{"role": "user", "content": "relay"}],
        max_tokens=3000,
        stream=True,
    )
    async for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            yield chunk.choices[0].delta.content


async def one_stream(
    client,
    batches: int,
    delays: list[float],
    rates: list[float],  # type: ignore[no-untyped-def]
    door: str = "chat",
) -> tuple[str, str | None]:
    """Read one stream; each batch's delay is the time its mark arrived minus when it was sent;
    its steady rate is the batches after the first over the time from the first to the last."""
    text, seen, first, last = "", 0, 0.0, 0.0
    try:
        async for piece in text_pieces(client, door):
            now = time.time()
            first, last = first or now, now
            text += piece
            marks = list(MARK.finditer(text))
            for mark in marks[seen:]:
                delays.append(now - float(mark.group(2)))
            seen = len(marks)
    except Exception as error:  # noqa: BLE001 — a failed stream is counted, not fatal to the bench
        return text, f"{type(error).__name__}: {error}"
    if seen > 1 and last > first:
        rates.append((seen - 1) / (last - first))
    return text, None


HEAVY = {
    "type": "json_schema",
    "json_schema": {  # issue 30's attack: 2.5 s and 170 MB of grammar before its limits
        "name": "many",
        "schema": {"type": "array", "items": {"type": "string"}, "minItems": 10_000_000},
    },
}


async def heavy_child_start(server: str, secret: str, count: int) -> asyncio.subprocess.Process:
    """A child process that will send the heavy requests: made in this one, they would hold up
    its own reading of the streams and count as the gateway's delay. It is started, and has
    imported and connected, before the round begins."""
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--heavy-child",
        server,
        secret,
        str(count),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert child.stdout is not None
    await child.stdout.readline()  # "ready"
    return child


async def heavy_schemas(child: asyncio.subprocess.Process, answers: list[tuple[int, float]]) -> None:
    """A second into the round, the child sends its `count` heavy requests at once (a good key)."""
    await asyncio.sleep(1.0)
    out, _ = await child.communicate(b"go\n")
    answers.extend((status, seconds) for status, seconds in json.loads(out))


def heavy_child(server: str, secret: str, count: int) -> None:
    """The child's part: connect, say ready, wait for "go", send `count` heavy requests at once,
    print [[status, seconds], ...]."""
    import httpx

    body = {
        "model": "gemma-3-270m",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 1,
        "response_format": HEAVY,
    }
    answers: list[tuple[int, float]] = []

    async def one(http: httpx.AsyncClient) -> None:
        started = time.monotonic()
        try:
            status = (
                await http.post(
                    f"{server}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {secret}"}
                )
            ).status_code
        except httpx.HTTPError:
            status = 0
        answers.append((status, time.monotonic() - started))

    async def fire() -> None:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=count + 1), timeout=120) as http:
            await http.get(f"{server}/healthz")
            print("ready", flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            await asyncio.gather(*(one(http) for _ in range(count)))

    asyncio.run(fire())
    print(json.dumps(answers))


async def pool_round(server: str, secret: str, streams: int, batches: int, heavy: int = 0, door: str = "chat") -> dict:
    import httpx
    import openai

    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=streams + 4), timeout=120)
    client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=secret, max_retries=0, http_client=http)
    delays: list[float] = []
    rates: list[float] = []
    answers: list[tuple[int, float]] = []
    child = await heavy_child_start(server, secret, heavy) if heavy else None
    started = time.monotonic()
    results = await asyncio.gather(
        *(one_stream(client, batches, delays, rates, door) for _ in range(streams)),
        *([heavy_schemas(child, answers)] if child else []),
    )
    results = results[:streams]
    elapsed = time.monotonic() - started
    await http.aclose()
    totals = {"lost": 0, "duplicated": 0, "reordered": 0}
    errors = [error for _, error in results if error]
    for text, _ in results:
        _, lost, duplicated, reordered = check_text(text, batches)
        totals["lost"] += lost
        totals["duplicated"] += duplicated
        totals["reordered"] += reordered
    return {
        "elapsed_s": elapsed,
        "relayed": len(delays),
        "delays": delays,
        "steady_per_s": sum(rates),
        "errors": errors,
        "heavy": answers,
        **totals,
    }


def start_simhost(
    server: str, token: str, streams: int, args: argparse.Namespace, log: Path, *, socket: bool, socket_claims: bool
) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "testkit.simhost",
        "--server",
        server,
        "--token",
        token,
        "--model",
        "gemma-3-270m",
        "--loaded",
        "gemma-3-270m",
        "--slots",
        str(streams),
        "--stream-batches",
        str(args.batches),
        "--interval",
        str(args.interval),
        "--wait",
        "2",
        *(["--socket"] if socket else []),
        *(["--socket-claims"] if socket_claims else []),
    ]
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=dict(os.environ), stdout=subprocess.PIPE, stderr=open(log, "w"), text=True
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # its first line says it registered
        if json.loads(line).get("ready"):
            break
    return proc


def measure(args: argparse.Namespace, target: Target, server: str, tmp: Path, streams: int) -> dict:
    tag = f"{target.name}-{streams}-{time.time_ns()}"
    secret = target.manage("create_customer", f"{tag}@bench.local", "--credit", "1000")
    token = target.manage("create_host", f"{tag}@host.local", tag)
    path = args.socket if target.name == "head" else args.baseline_path
    socket = path in ("ws", "ws-claims")
    sim = start_simhost(
        server, token, streams, args, tmp / f"simhost-{tag}.log", socket=socket, socket_claims=path == "ws-claims"
    )
    try:
        time.sleep(1.5)  # its long-polls are waiting
        asyncio.run(
            pool_round(server, secret, 1, 2, door=args.current_door)
        )  # warm-up, not measured: the gateway loads its tokenizer
        gateway_cpu, sim_cpu = target.cpu(), cpu_seconds(sim.pid)
        own_cpu, children_cpu = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        rounds = [
            asyncio.run(pool_round(server, secret, streams, args.batches, args.heavy, args.current_door))
            for _ in range(args.rounds)
        ]
        own_after, children_after = (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN),
        )
        gateway_used, sim_used = target.cpu() - gateway_cpu, cpu_seconds(sim.pid) - sim_cpu
    finally:
        sim.terminate()
        sim.wait(timeout=10)
    elapsed = sum(r["elapsed_s"] for r in rounds)
    relayed = sum(r["relayed"] for r in rounds)
    offered = streams * args.batches * args.rounds
    delays = [d for r in rounds for d in r["delays"]]
    return {
        "gateway": target.name,
        "host_path": path,
        "workers": args.current_workers,
        "streams": streams,
        "offered_batches_per_s": streams / args.interval,
        "relayed_batches_per_s": relayed / elapsed,
        "steady_batches_per_s": statistics.mean(r["steady_per_s"] for r in rounds),
        "steady_share": statistics.mean(r["steady_per_s"] for r in rounds) / (streams / args.interval),
        "relayed_share": relayed / offered,
        "stream_s_ideal": args.batches * args.interval,
        "round_s": elapsed / args.rounds,
        "delay_ms_p50": pct(delays, 0.5) * 1000,
        "delay_ms_p99": pct(delays, 0.99) * 1000,
        "delay_ms_max": max(delays) * 1000 if delays else float("nan"),
        "lost": sum(r["lost"] for r in rounds),
        "duplicated": sum(r["duplicated"] for r in rounds),
        "reordered": sum(r["reordered"] for r in rounds),
        "errors": [e for r in rounds for e in r["errors"]][:5],
        **(
            {
                "heavy_statuses": sorted({status for r in rounds for status, _ in r["heavy"]}),
                "heavy_answer_s_max": max((t for r in rounds for _, t in r["heavy"]), default=0.0),
            }
            if args.heavy
            else {}
        ),
        "gateway_cpu_ms_per_batch": gateway_used / max(relayed, 1) * 1000,
        "gateway_cpu_share": gateway_used / elapsed,
        "load_generator_cpu_share": (
            sim_used
            + own_after.ru_utime
            + own_after.ru_stime
            - own_cpu.ru_utime
            - own_cpu.ru_stime
            + children_after.ru_utime
            + children_after.ru_stime
            - children_cpu.ru_utime
            - children_cpu.ru_stime
        )
        / elapsed,
    }


def main() -> None:
    if sys.argv[1:2] == ["--heavy-child"]:
        heavy_child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--streams", type=int, action="append", help="concurrent streams (repeatable; default 1, 5, 25)"
    )
    parser.add_argument("--batches", type=int, default=100, help="batches per stream")
    parser.add_argument("--interval", type=float, default=0.05)
    parser.add_argument(
        "--heavy",
        type=int,
        default=0,
        help="also send this many requests with issue 30's heavy schema (minItems 1e7) a second into each round",
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--door",
        choices=["chat", "responses"],
        action="append",
        help="the customers' API (repeatable: each measured in turn, same gateway; default chat)",
    )
    parser.add_argument(
        "--socket",
        choices=["http", "ws", "ws-claims"],
        default="ws-claims",
        help="how the synthetic host reaches this checkout: batches over HTTP, batches on its WebSocket, "
        "or batches and claims on its WebSocket (mahout's path)",
    )
    parser.add_argument(
        "--baseline-path",
        choices=["http", "ws", "ws-claims"],
        default="http",
        help="the same for the baseline (whatever its code supports)",
    )
    parser.add_argument(
        "--baseline", type=Path, help="a checkout of the baseline commit (git worktree): measured alternately"
    )
    parser.add_argument(
        "--workers", type=int, action="append", help="gateway processes behind HAProxy (repeatable; default 1)"
    )
    parser.add_argument("--port", type=int, default=8766)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="elephant-relay-"))
    targets = [Target("head", ROOT, tmp)] + ([Target("base", args.baseline.resolve(), tmp)] if args.baseline else [])
    results = []
    for streams in args.streams or [1, 5, 25]:
        for workers in args.workers or [1]:
            args.current_workers = workers
            for target in targets if streams % 2 else list(reversed(targets)):  # alternate who goes first
                server = target.start(args.port, tmp / f"gateway-{target.name}.log", workers)
                try:
                    for door in args.door or ["chat"]:
                        args.current_door = door
                        results.append({**measure(args, target, server, tmp, streams), "door": door})
                finally:
                    target.stop()
    print(
        json.dumps(
            {
                "database": "postgresql" if os.environ.get("DATABASE_URL") else "sqlite",
                "batches": args.batches,
                "interval": args.interval,
                "host_path": args.socket,
                "results": results,
            },
            indent=2,
        )
    )
    for r in results:
        print(
            f"{r['gateway']:>4}/{r['host_path']:<9} {r['door']:<9} W={r['workers']} "
            f"C={r['streams']:>3}: offered {r['offered_batches_per_s']:.0f}/s, relayed "
            f"{r['steady_batches_per_s']:.0f}/s steady "
            f"({r['steady_batches_per_s'] / r['offered_batches_per_s']:.0%} of offered), "
            f"{r['relayed_batches_per_s']:.0f}/s over the round "
            f"({r['relayed_share']:.0%} arrived), round {r['round_s']:.1f} s (ideal "
            f"{r['stream_s_ideal']:.1f}), delay p50/p99/max {r['delay_ms_p50']:.0f}/{r['delay_ms_p99']:.0f}/"
            f"{r['delay_ms_max']:.0f} ms, lost/dup/reordered "
            f"{r['lost']}/{r['duplicated']}/{r['reordered']}, gateway CPU "
            f"{r['gateway_cpu_ms_per_batch']:.2f} ms per batch "
            f"({r['gateway_cpu_share']:.0%} of a core), load generator "
            f"{r['load_generator_cpu_share']:.0%}"
            + (
                f"; {args.heavy} heavy schemas answered {r['heavy_statuses']}, "
                f"the slowest in {r['heavy_answer_s_max']:.2f} s"
                if args.heavy
                else ""
            )
        )
    by_workers = {(r["gateway"], r["streams"], r["workers"]): r for r in results}
    for (name, streams, workers), r in by_workers.items():
        one = by_workers.get((name, streams, 1))
        if workers > 1 and one is not None:
            print(
                f"{name} C={streams:>3}: W={workers} / W=1 relayed "
                f"{r['steady_batches_per_s'] / one['steady_batches_per_s']:.2f}x (steady)"
            )
    for head, base in zip(results[::2], results[1::2], strict=False):
        if args.baseline and head["streams"] == base["streams"]:
            a, b = (head, base) if head["gateway"] == "head" else (base, head)
            print(
                f"C={a['streams']:>3}: head / base relayed "
                f"{a['steady_batches_per_s'] / b['steady_batches_per_s']:.2f}x (steady), "
                f"CPU per batch {b['gateway_cpu_ms_per_batch'] / a['gateway_cpu_ms_per_batch']:.1f}x less"
            )


if __name__ == "__main__":
    main()
