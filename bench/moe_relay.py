"""The expert relay's round trip: this tree (the worker's sealed link carried through the relay
as bytes) against a baseline checkout (e.g. the relay that carried unsealed frames), in one run.

Each side runs in its own process on its own tree, in turns (A B A B …, `--passes`): a daphne
gateway on a fresh SQLite file, an expert worker (`ExpertServer`, 8 experts of d_model 1024,
expert ffn 768) reached only through the gateway's relay (`RelayWorkerLink`), and the
coordinator's `RelayTransport` to it. As the side's own reference, the same worker is also
dialled directly (a sealed `TcpTransport` on loopback). Per batch of T rows (spread over 4
experts), the median milliseconds of a compute round trip over `--rounds` calls after 5
warm-up calls, relay and direct interleaved; then relay ÷ direct, and this tree ÷ baseline.
A batch that fails (`WorkerFailed`: its coordinator would compute it itself) prints as nan.

    git worktree add /tmp/elephant-base a945e8b
    .venv/bin/python bench/moe_relay.py [--baseline /tmp/elephant-base] [--rounds 40] [--passes 2]

Nothing is asserted: the figures go into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
ROWS = (1, 16, 48, 128)  # 128 rows x 4 experts: a 2 MiB frame, past daphne's 1 MiB WebSocket message
SHAPE = {
    "n_layers": 1,
    "d_model": 1024,
    "n_heads": 8,
    "n_kv_heads": 2,
    "head_dim": 128,
    "n_experts": 8,
    "n_experts_used": 4,
    "expert_ffn_dim": 768,
    "context_length": 512,
}


def _transport(relay_module, url: str, token: str, worker) -> object:  # type: ignore[no-untyped-def]
    """The coordinator's relay transport on either tree (a baseline's needs no secret)."""
    parameters = inspect.signature(relay_module.RelayTransport).parameters
    if "secret" in parameters:
        return relay_module.RelayTransport(url, token, worker.pk, worker.secret)
    return relay_module.RelayTransport(url, token, worker.pk)


def side(tree: Path, rounds: int) -> dict[str, dict[str, float]]:
    """One side's medians, {T: {"relay": ms, "direct": ms}} (run in a child on `tree`)."""
    tmp = Path(tempfile.mkdtemp(prefix="moe-relay-bench-"))
    os.environ.update(
        {
            "SQLITE_PATH": str(tmp / "db.sqlite3"),
            "ELEPHANT_VAR_DIR": str(tmp / "var"),
            "DJANGO_SETTINGS_MODULE": "config.settings",
        }
    )
    os.environ.pop("DATABASE_URL", None)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    import torch

    from engine.moe_loader import load_expert_slice, make_tiny_moe
    from mahout.moe import relay as relay_module
    from mahout.moe.coordinator import TcpTransport, WorkerFailed
    from mahout.moe.worker import ExpertServer, pack_rows, worker_caps
    from mesh.experts.models import ExpertWorker
    from mesh.experts.services import expert_model_register
    from testkit.personas import make_host
    from testkit.stack import Gateway

    torch.set_num_threads(1)
    path = make_tiny_moe(tmp / "model.gguf", seed=3, **SHAPE)
    coordinator, volunteer = make_host(qualified=False, name="coordinator"), make_host(qualified=False, name="worker")
    model = expert_model_register(name="bench-moe", gguf_path=path, slice_size=8, coordinator=coordinator.host)
    worker = ExpertWorker.objects.create(model=model, host=volunteer.host, layer=0, first=0, count=8)
    config, bank = load_expert_slice(path, 0, 0, 8)
    server = ExpertServer(
        bank,
        secret=worker.secret,
        caps=worker_caps(d_model=config.d_model, count=8, context_length=config.context_length),
    ).start()
    gateway = Gateway(dict(os.environ), tmp)
    link = relay_module.RelayWorkerLink(gateway.url, volunteer.token, worker.pk, server, out=lambda line: None).start()
    link.connected.wait(30)
    ways = {
        "relay": _transport(relay_module, gateway.url, coordinator.token, worker),
        "direct": TcpTransport(server.address, worker.secret),
    }
    medians: dict[str, dict[str, float]] = {}
    try:
        for t in ROWS:
            experts, counts, rows = pack_rows({e: torch.randn(t, config.d_model) for e in (0, 2, 5, 7)})
            header = {"type": "compute", "id": 1, "layer": 0, "experts": experts, "counts": counts}
            times: dict[str, list[float]] = {way: [] for way in ways}
            for i in range(rounds + 5):
                for way, transport in ways.items():
                    started = time.perf_counter()
                    try:
                        answer, _ = transport.request(header, rows, 30.0)  # type: ignore[attr-defined]
                    except WorkerFailed:  # e.g. a frame the gateway's WebSocket refuses: the coordinator computes it
                        times[way].append(math.nan)
                        continue
                    assert answer["type"] == "result", answer
                    if i >= 5:
                        times[way].append((time.perf_counter() - started) * 1000)
            medians[str(t)] = {way: statistics.median(values) for way, values in times.items()}  # nan: it failed
    finally:
        for transport in ways.values():
            transport.close()  # type: ignore[attr-defined]
        link.stop()
        server.close()
        gateway.stop()
    return medians


def run_side(tree: Path, rounds: int) -> dict[str, dict[str, float]]:
    """`side` in a child process whose imports come from `tree`."""
    result = subprocess.run(
        [sys.executable, __file__, "--side", str(tree), "--rounds", str(rounds)],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    if result.returncode != 0:
        raise SystemExit(f"the side on {tree} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="a checkout of the baseline (git worktree add DIR COMMIT)")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--passes", type=int, default=2, help="turns per side, alternating")
    parser.add_argument("--side", type=Path, help=argparse.SUPPRESS)  # the child's tree
    args = parser.parse_args()
    if args.side is not None:
        sys.path.insert(0, str(args.side))
        print(json.dumps(side(args.side, args.rounds)))
        return
    trees = {"this tree": HERE, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    runs: dict[str, list[dict[str, dict[str, float]]]] = {name: [] for name in trees}
    for _ in range(args.passes):
        for name, tree in trees.items():
            runs[name].append(run_side(tree, args.rounds))
    print(
        f"Expert batch round trip, median ms of {args.rounds} calls x {args.passes} passes (median of the passes), "
        f"d_model {SHAPE['d_model']}, 4 experts of 8, loopback"
    )
    print(f"{'side':>10} {'T':>4} {'relay ms':>9} {'direct ms':>10} {'relay ÷ direct':>15} {'relay ÷ baseline':>17}")
    for t in map(str, ROWS):
        ms = {
            name: {way: statistics.median(run[t][way] for run in found) for way in ("relay", "direct")}
            for name, found in runs.items()
        }
        for name in trees:
            versus = f"{ms[name]['relay'] / ms['baseline']['relay']:>17.2f}" if "baseline" in ms else f"{'-':>17}"
            print(
                f"{name:>10} {t:>4} {ms[name]['relay']:>9.2f} {ms[name]['direct']:>10.2f} "
                f"{ms[name]['relay'] / ms[name]['direct']:>15.2f} {versus}",
                flush=True,
            )


if __name__ == "__main__":
    main()
