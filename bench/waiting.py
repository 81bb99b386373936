"""The waits issue 33 cut: how long a customer's stream stays silent when its host dies where
waiting buys nothing, on this checkout and on a baseline checkout, in the same run.

    git worktree add /tmp/elephant-before cc978b7
    .venv/bin/python bench/waiting.py --baseline /tmp/elephant-before [--rounds 1]

Each target is a real gateway (daphne, a fresh SQLite database, migrated by its own code)
with two hosts that speak the documented host API over HTTP only, as a host behind a
router may: a doomed one and a rescuer that answers any job it claims at once. The doomed
host claims the customer's streamed request first, then, by scenario:

    silent     dies before its first token (it claims, and nothing more)
    frozen     freezes before its first token but keeps reporting progress every 2 s
    restarted  dies before its first token, and its restarted process heartbeats at once
               (with a new boot id; a baseline gateway ignores it)
    whole      sends the whole answer, saying its generation ended (finish_reason), and
               dies before "complete" (a baseline gateway ignores the word)

and prints the customer's silence: from the doomed host's last word to the stream's next
text (or, for "whole", its end), per target, and this checkout's ÷ the baseline's. Both
gateways run with JOB_START_ALLOWANCE_SECONDS=60 (the baseline holds a frozen host that
reports progress until then; the default is 120).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.relay import Target  # noqa: E402 (after the path)
from protocol.catalog import MODEL_FILES  # noqa: E402
from testkit.simhost import drawn_ids  # noqa: E402

MODEL = "gemma-3-270m"
SCENARIOS = ("silent", "frozen", "restarted", "whole")
ANSWER = "Hello there."
ENV = {
    "JOB_START_ALLOWANCE_SECONDS": "60",
    "CANARY_ENABLED": "0",
    "AUDIT_ENABLED": "0",
    "HOST_MAX_FAILURES_PER_HOUR": "100000",
    "ROUTING_OFFER_SECONDS": "0.5",
}


class Host:
    """A host over HTTP: registered with figures that say it starts at once (as the shipped
    model's on a small machine), heartbeating from a thread until stopped."""

    def __init__(self, server: str, token: str, name: str) -> None:
        self.http = httpx.Client(
            base_url=f"{server}/hosts/api", headers={"Authorization": f"Bearer {token}"}, timeout=40
        )
        self.fingerprint, self.boot = name * 8, f"{name}-1"
        benchmark = {"prompt_tps": 500.0, "gen_tps": 40.0, "ttft_ms": 50.0, "memory_mb": 400.0, "load_ms": 300.0}
        self.http.post(
            "/qualifications",
            json={
                "model": MODEL,
                "fingerprint": self.fingerprint,
                "benchmark": benchmark,
                "machine": {},
                "sha256": MODEL_FILES[MODEL]["sha256"],
            },
        ).raise_for_status()
        self.heartbeat()
        self.stopped = threading.Event()
        threading.Thread(target=self._beat, daemon=True).start()

    def heartbeat(self) -> None:
        self.http.post(
            "/heartbeat", json={"fingerprint": self.fingerprint, "version": "0.7.0", "boot": self.boot}
        ).raise_for_status()

    def _beat(self) -> None:
        while not self.stopped.wait(3):
            try:
                self.heartbeat()
            except httpx.HTTPError:  # the gateway stopped after its round
                return

    def claim(self, wait: float = 20) -> dict | None:
        answer = self.http.post("/claim", json={"fingerprint": self.fingerprint, "wait": wait, "boot": self.boot})
        return answer.json()["job"] if answer.status_code == 200 else None

    def stop(self) -> None:
        self.stopped.set()


def rescue(host: Host, done: threading.Event) -> None:
    """Answer every job claimed at once, until `done`."""
    with contextlib.suppress(httpx.HTTPError):  # (a claim still waiting when the last round's gateway stops)
        while not done.is_set():
            job = host.claim(wait=1)
            if job is not None:
                host.http.post(f"/jobs/{job['id']}/tokens", json={"seq": 0, "text": ANSWER})
                host.http.post(
                    f"/jobs/{job['id']}/complete",
                    json={"finish_reason": "stop", "tokens": drawn_ids(job["model"], ANSWER)},
                )


def doom(host: Host, scenario: str, last_word: list[float]) -> None:
    """Claim the customer's job and die the scenario's way; `last_word` gets the time of the
    host's last message (a frozen host's progress reports go on from a thread of their own)."""
    job = host.claim()
    assert job is not None, "the doomed host claimed nothing"
    last_word.append(time.monotonic())
    if scenario == "whole":
        host.http.post(f"/jobs/{job['id']}/tokens", json={"seq": 0, "text": ANSWER, "finish_reason": "stop"})
        last_word[0] = time.monotonic()
    host.stop()
    if scenario == "restarted":
        host.boot = "doomed-2"
        host.heartbeat()
    if scenario == "frozen":
        threading.Thread(target=report_progress, args=(host, job["id"]), daemon=True).start()


def report_progress(host: Host, job_id: int) -> None:
    """Progress every 2 s until the gateway says the job is no longer this host's."""
    with contextlib.suppress(httpx.HTTPError):  # (the gateway stopped after its round)
        while host.http.post(f"/jobs/{job_id}/progress", json={"stage": "prefill"}).status_code == 200:
            time.sleep(2)


def round_(server: str, secret: str, tokens: tuple[str, str], scenario: str) -> float:
    """One request through one scenario: the customer's silence after the doomed host's last
    word, to the next text (to the stream's end for "whole")."""
    last_word: list[float] = []
    done = threading.Event()

    def hosts() -> None:
        doom(Host(server, tokens[0], "d"), scenario, last_word)
        rescuer = Host(server, tokens[1], "r")  # only now: the doomed host claims first
        try:
            rescue(rescuer, done)
        finally:
            rescuer.stop()

    threading.Thread(target=hosts, daemon=True).start()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": True}
    heard = None
    try:
        with (
            httpx.Client(timeout=120) as customer,
            customer.stream(
                "POST", f"{server}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {secret}"}
            ) as stream,
        ):
            for line in stream.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if chunk.get("error"):
                    raise SystemExit(f"{scenario}: the request failed: {chunk['error']}")
                text = "".join(choice.get("delta", {}).get("content") or "" for choice in chunk.get("choices", []))
                if text and heard is None and scenario != "whole":
                    heard = time.monotonic()
    finally:
        done.set()
    return (heard if heard is not None else time.monotonic()) - last_word[0]


def measure(target: Target, tmp: Path, port: int, rounds: int) -> dict[str, list[float]]:
    target.env.update(ENV)
    server = target.start(port, tmp / f"{target.name}.log")
    try:
        silences: dict[str, list[float]] = {scenario: [] for scenario in SCENARIOS}
        for scenario in SCENARIOS:
            for index in range(rounds):
                tag = f"{scenario}{index}"
                secret = target.manage("create_customer", f"{tag}@bench.local", "--credit", "10")
                tokens = (
                    target.manage("create_host", f"{tag}-d@host.local", f"{tag}-d"),
                    target.manage("create_host", f"{tag}-r@host.local", f"{tag}-r"),
                )
                silences[scenario].append(round_(server, secret, tokens, scenario))
                print(f"  {target.name:9} {scenario:9} {silences[scenario][-1]:6.1f} s", flush=True)
        return silences
    finally:
        target.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout of the baseline commit (git worktree)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--port", type=int, default=8731)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-waiting-") as scratch:
        tmp = Path(scratch)
        results = {}
        for offset, (name, root) in enumerate((("this", ROOT), ("baseline", args.baseline.resolve()))):
            results[name] = measure(Target(name, root, tmp), tmp, args.port + offset, args.rounds)
    print(
        f"\n{'scenario':10} {'this (s)':>9} {'baseline (s)':>13} "
        f"{'ratio':>7}   (median silence of {args.rounds} round(s))"
    )
    for scenario in SCENARIOS:
        this, before = (statistics.median(results[name][scenario]) for name in ("this", "baseline"))
        print(f"{scenario:10} {this:9.1f} {before:13.1f} {this / before:7.2f}")


if __name__ == "__main__":
    main()
