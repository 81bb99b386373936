"""A ring whose two stages are each behind its own home router (issue 33, seed 000).

    sudo .venv/bin/python bench/ring_nat.py [--rtt-ms 20-80] [--loss 0.5] [--tokens 32] [--prompts 3]

Starts a real gateway (daphne) on the simulated internet's public side (bench/netsim.py),
then forms the same two-stage ring (the shipped model, layers 0-8 and 9-17, on two owners'
machines, bridged from the public side by a third) three ways, each with fresh stage
processes, and generates `--prompts` greedy answers of `--tokens` tokens one after another:

- direct: both stages on this machine, dialled at their loopback addresses (the baseline);
- relay: both stages on this machine, reached through the gateway's ring relay (`--relay`);
- nat: each stage in its own home namespace behind NAT, over a home link (RTT, jitter, loss),
  reached only through the relay: nothing can dial into a home.

Prints, per way, the seconds from starting the stages to the first answer and the tokens/s
of the answers (the ring's decode speed), with the ratios to the direct baseline of the same
run, as JSON. Every answer must equal the direct one token for token.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import netsim  # noqa: E402 - bench/ is on the path as the script's own folder

PROMPTS = ["The capital of France is", "Elephants remember", "A ring of stages"]


def answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def setup_django(tmp: Path) -> None:
    os.environ.update(
        {
            "DJANGO_SETTINGS_MODULE": "config.settings",
            "SQLITE_PATH": str(tmp / "ring.sqlite3"),
            "ELEPHANT_VAR_DIR": str(tmp / "var"),
            "ALLOWED_HOSTS": f"127.0.0.1,localhost,{netsim.GATEWAY_IP}",
            "RING_ALLOW_PRIVATE_STAGES": "1",  # the direct baseline's stages listen on loopback
        }
    )
    os.environ.pop("DATABASE_URL", None)
    os.environ.pop("REDIS_URL", None)  # one gateway process: its in-memory channel layer carries the relay
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def stage_command(server: str, token: str, ring: int, index: int, way: str, home: Path) -> list[str]:
    command = [
        sys.executable,
        "-m",
        "mahout",
        "stage",
        "--server",
        server,
        "--token",
        token,
        "--ring",
        str(ring),
        "--stage",
        str(index),
        "--bind",
        "127.0.0.1:0",
        "--n-ctx",
        "256",
        "--wait",
        "300",
        "--once",
        "--no-idle-detect",
        "--home",
        str(home),
        *(["--relay"] if way != "direct" else []),
    ]
    return ["ip", "netns", "exec", netsim.home_ns(index + 1), *command] if way == "nat" else command


def one_way(way: str, server: str, tmp: Path, args: argparse.Namespace) -> dict:
    """Form a fresh ring `way` and time its answers."""
    from catalog.models import CatalogModel
    from engine.gguf_loader import default_model_path
    from engine.tokenizer import Tokenizer
    from mahout.ring.api import RingApi
    from mahout.ring.rendezvous import bridge_connect
    from mesh.rings.services import StageSpec, ring_plan_create
    from testkit.personas import make_host

    assert CatalogModel.objects.filter(name="gemma-3-270m").exists()
    head, tail, bridge = (make_host(qualified=False, name=f"{way}-{name}") for name in ("a", "b", "bridge"))
    plan = ring_plan_create(
        model_name="gemma-3-270m",
        stages=[StageSpec(0, 9, head.host), StageSpec(9, 18, tail.host)],
        row_width=64,
        micro_batch=4,
        bridge_host=bridge.host,
    )
    started = time.monotonic()
    logs = [open(tmp / f"{way}-stage{i}.log", "w") for i in range(2)]
    stages = [
        subprocess.Popen(
            stage_command(server, host.token, plan.pk, i, way, tmp / f"{way}-home{i}"),
            cwd=ROOT,
            env=dict(os.environ),
            stdout=logs[i],
            stderr=subprocess.STDOUT,
        )
        for i, host in enumerate((head, tail))
    ]
    api = RingApi(server, bridge.token)
    tokenizer = Tokenizer(default_model_path())
    try:
        ring = bridge_connect(api, plan.pk, 2, keys=api.bridge_keys(plan.pk), timeout=300, say=lambda _line: None)
        answers, decode_s, formed_s = [], 0.0, None
        for prompt in PROMPTS[: args.prompts]:
            begun = time.monotonic()
            answers.append(ring.submit(tokenizer.encode(prompt), args.tokens).result())
            decode_s += time.monotonic() - begun
            formed_s = formed_s or round(time.monotonic() - started, 1)
        ring.close()
    finally:
        api.close()
        for stage in stages:
            stage.kill()
            stage.wait()
    tokens = sum(len(a) for a in answers)
    return {
        "first_answer_after_s": formed_s,
        "tokens": tokens,
        "tokens_per_s": round(tokens / decode_s, 2),
        "answers": answers,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rtt-ms", default="20-80", help="each home's round trip, drawn from this range")
    parser.add_argument("--loss", type=float, default=0.5, help="percent lost, each direction")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--port", type=int, default=8772)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="elephant-ring-nat-"))
    low, _, high = args.rtt_ms.partition("-")
    homes = netsim.up(2, (float(low), float(high or low)), 5.0, args.loss, seed=7)
    gateway = None
    try:
        setup_django(tmp)
        from catalog.models import CatalogModel
        from catalog.seed import catalog_seed
        from mesh.rings.layouts import layout_seed
        from mesh.rings.models import ModelLayout
        from testkit.stack import wait_until

        catalog_seed(CatalogModel)
        layout_seed(CatalogModel, ModelLayout)
        server = f"http://{netsim.GATEWAY_IP}:{args.port}"
        gateway = subprocess.Popen(
            [sys.executable, "-m", "daphne", "-b", netsim.GATEWAY_IP, "-p", str(args.port), "config.asgi:application"],
            cwd=ROOT,
            env=dict(os.environ),
            stdout=open(tmp / "gateway.log", "w"),
            stderr=subprocess.STDOUT,
        )
        wait_until(lambda: answers(f"{server}/healthz"), timeout=60, what="the gateway", interval=0.2)
        report = {way: one_way(way, server, tmp, args) for way in ("direct", "relay", "nat")}
    finally:
        if gateway is not None:
            gateway.kill()
        netsim.down()
    base = report["direct"]
    for way in ("relay", "nat"):
        report[way]["same_tokens_as_direct"] = report[way]["answers"] == base["answers"]
        report[way]["tokens_per_s_over_direct"] = round(report[way]["tokens_per_s"] / base["tokens_per_s"], 2)
    for way in report.values():
        del way["answers"]
    report["setup"] = {
        "homes_rtt_ms": sorted(home["rtt_ms"] for home in homes),
        "loss_pct": args.loss,
        "link": homes[0]["link"],
        "prompts": args.prompts,
        "tokens_each": args.tokens,
        "logs": str(tmp),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
