"""The ring, measured side by side in one run (all on this machine, loopback, greedy).

1. A 2-stage ring (two stage processes, 1 torch thread each) serving one request, versus
   the single-process engine with the same total threads (2): decode tokens/s. And the
   same ring with 2 threads per stage: a lone request computes on one stage at a time
   (the other waits for its boundary), so it too keeps at most 2 cores busy.
2. The same ring with 4 requests in flight versus the 4 drained one at a time: tokens/s.
3. The engine versus llama-cpp-python on the same threads: decode tokens/s.
4. Per-stage hold/idle shares while the ring is starved (one request at a time) and
   saturated (many requests in flight).
Rings share the output head (head and tail each hold half of the vocabulary's rows and
compute their halves at once). Baseline in the same run: the same ring with the whole
output head at the tail (`--whole-output`), as rings were built before.

5. What the link handshake costs (every ring link and expert link is admitted with the
   gateway's secret): connection setup on loopback, dial to the first frame the dialer can
   use, with the handshake (challenge, hello with its HMAC proof, the listener's proof)
   versus the old unauthenticated hello, interleaved, median and p99.

6. (`--sampling-only`) What sampling costs a ring, one request: decode tokens/s at T 0.8
   with top_p 1 (each half's mass crosses the ring: two floats a row), top_p 0.9, with 5
   log-probabilities and under JSON's grammar (the tail's half of the logits goes to the head
   whole), against greedy, with the output head shared and whole at the tail (where they cost
   no transfer). No stop token ends a request, so each runs its whole budget (under the
   grammar, once the JSON is complete only an end of generation is allowed, drawn again).

7. (`--seal-only`) What sealing costs a ring (issue 32): the same 2-stage ring with its links
   sealed (AES-GCM after the handshake, as agents run) and with them in the clear (the stages
   run from `bench/unsealed.py`, the bridge's links likewise), one request's decode
   tokens/s and 4 requests in flight, sealed / clear.

Rounds alternate between the sides so machine noise hits both; medians are reported.
OMP_WAIT_POLICY=PASSIVE (set here, for the engine and the stage processes alike) stops idle
OpenMP workers from spinning on cores another stage needs.

    .venv/bin/python bench/ring.py [--rounds 3] [--tokens 32] [--handshake-only] [--sampling-only] [--seal-only]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP runtime

import torch  # noqa: E402
from unsealed import unsealed  # noqa: E402 - bench/unsealed.py, beside this script

from engine.generate import build_stages, generate  # noqa: E402
from engine.gguf_loader import default_model_path  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from mahout.link import HEADERS_ONLY, Link, accept, connect, listen, new_secret  # noqa: E402
from mahout.ring.local import ProcessRing, split_layers  # noqa: E402
from mahout.ring.membership import Limits  # noqa: E402

PROMPTS = [
    "Once upon a time, in a village at the edge of a great forest, there lived",
    "The history of the elephant is long and varied. Elephants live in families",
    "To make a good cup of tea, first boil the water, then",
    "The three largest cities in the world by population are",
]


def ring_decode_tps(ring: ProcessRing, prompt_ids: list[int], tokens: int, **sampling: object) -> float:
    """Decode tokens/s of one request alone: tokens after the first over the time after the first.
    `sampling`: temperature, top_p, logprobs (greedy when none)."""
    if sampling.get("grammar") == "json":
        sampling = {**sampling, "grammar": _json_grammar()}
    request = ring.bridge.submit(prompt_ids, tokens, seed=1234, stop_ids=[], **sampling)
    first = end = None
    for _ in request:
        end = time.perf_counter()
        first = first or end
    assert first is not None and end is not None
    return (len(request.tokens) - 1) / (end - first)


def ring_batch_tps(ring: ProcessRing, prompts: list[list[int]], tokens: int, *, in_flight: bool) -> float:
    """Generated tokens/s for all prompts: submitted together, or each after the previous ended."""
    started = time.perf_counter()
    if in_flight:
        requests = [ring.bridge.submit(p, tokens) for p in prompts]
        total = sum(len(r.result()) for r in requests)
    else:
        total = sum(len(ring.bridge.submit(p, tokens).result()) for p in prompts)
    return total / (time.perf_counter() - started)


def shares(before: list[dict], after: list[dict]) -> list[str]:
    out = []
    for b, a in zip(before, after, strict=True):
        hold, idle = a["hold_s"] - b["hold_s"], a["idle_s"] - b["idle_s"]
        total = hold + idle
        out.append(
            f"stage {a['stage']} [{a['start']},{a['end']}): hold {hold / total:.0%} idle {idle / total:.0%} "
            f"(max queue {a['max_queue_depth']})"
        )
    return out


def phases(ring: ProcessRing, prompts: list[list[int]], tokens: int) -> tuple[list[str], list[str]]:
    """Hold/idle shares while starved (one request at a time), then saturated (8 in flight)."""
    s0 = ring.bridge.stats()
    for prompt in prompts:
        ring.bridge.submit(prompt, tokens).result()
    s1 = ring.bridge.stats()
    for request in [ring.bridge.submit(prompts[i % 4], tokens) for i in range(8)]:
        request.result()
    s2 = ring.bridge.stats()
    return shares(s0, s1), shares(s1, s2)


def llama_decode_tps(llm, prompt_ids: list[int], tokens: int) -> float:  # type: ignore[no-untyped-def]
    llm.reset()
    first = end = None
    produced = 0
    for _ in llm.generate(prompt_ids, temp=0.0, top_k=1, reset=True):
        produced += 1
        end = time.perf_counter()
        first = first or end
        if produced >= tokens:
            break
    return (produced - 1) / (end - first)


def _listener(secret: str | None) -> tuple[socket.socket, threading.Thread]:
    """A stage's accept side: admit (or, with no secret, take the bare hello), then welcome."""
    server = listen()

    def serve() -> None:
        while True:
            try:
                sock, _ = server.accept()
            except OSError:
                return
            if secret is None:
                link = Link(sock, "plain", caps=HEADERS_ONLY)
                link.recv()  # the hello
            else:
                link = accept(sock, secret=secret, caps=HEADERS_ONLY)
            link.send({"type": "welcome", "stage": 0})
            link.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server, thread


def _plain_dial(address: tuple[str, int]) -> None:
    """The old way: connect, say hello, read the welcome."""
    link = Link(socket.create_connection(address), "plain", caps=HEADERS_ONLY)
    link.send({"type": "hello", "role": "bridge"})
    link.recv()
    link.close()


def _secret_dial(address: tuple[str, int], secret: str) -> None:
    link = connect(address, secret=secret, hello={"role": "bridge"}, caps=HEADERS_ONLY, timeout=5)
    link.recv()
    link.close()


def handshake_cost(rounds: int) -> None:
    """Connection setup with and without the handshake, interleaved (ms: median, p99)."""
    secret = new_secret()
    plain_server, _ = _listener(None)
    auth_server, _ = _listener(secret)
    plain_address, auth_address = plain_server.getsockname()[:2], auth_server.getsockname()[:2]
    times: dict[str, list[float]] = {"plain": [], "handshake": []}
    try:
        for i in range(rounds + 20):  # the first 20 warm up
            for side in ("plain", "handshake") if i % 2 else ("handshake", "plain"):
                started = time.perf_counter()
                if side == "plain":
                    _plain_dial(plain_address)
                else:
                    _secret_dial(auth_address, secret)
                if i >= 20:
                    times[side].append((time.perf_counter() - started) * 1000)
    finally:
        plain_server.close()
        auth_server.close()
    stats = {side: (statistics.median(v), statistics.quantiles(v, n=100)[98]) for side, v in times.items()}
    (pm, pp), (hm, hp) = stats["plain"], stats["handshake"]
    print(
        f"5. link setup on loopback, {rounds} connections each: unauthenticated hello {pm:.3f} ms median "
        f"({pp:.3f} p99); handshake with HMAC-SHA256 proofs both ways {hm:.3f} ms median ({hp:.3f} p99) "
        f"-> +{hm - pm:.3f} ms per link, paid once per link (a ring session opens stages + 2; "
        f"a coordinator keeps its worker links open)"
    )


def _json_grammar() -> str:
    from llama_cpp.llama_grammar import JSON_GBNF

    return JSON_GBNF


SAMPLINGS = {
    "greedy": {},
    "T0.8": {"temperature": 0.8},
    "T0.8 top_p 0.9": {"temperature": 0.8, "top_p": 0.9},
    "T0.8 logprobs 5": {"temperature": 0.8, "logprobs": 5},
    "T0.8 json_object": {"temperature": 0.8, "grammar": "json"},
}


def sampling_cost(path: Path, prompt_ids: list[int], *, rounds: int, tokens: int) -> None:
    """6.: one request's decode tokens/s per sampling, shared and whole output head, alternated."""
    limits = Limits(micro_batch=2, row_width=64)
    even = split_layers(18, 2)
    rings = {"shared": dict(share_output=True), "whole at the tail": dict(share_output=False)}
    m: dict[tuple[str, str], list[float]] = {(r, s): [] for r in rings for s in SAMPLINGS}
    with (
        ProcessRing(path, even, limits=limits, threads=1, n_ctx=256, **rings["shared"]) as shared,
        ProcessRing(path, even, limits=limits, threads=1, n_ctx=256, **rings["whole at the tail"]) as whole,
    ):
        built = {"shared": shared, "whole at the tail": whole}
        for ring in built.values():
            ring_decode_tps(ring, prompt_ids, 4)  # warm-up
        for i in range(rounds):
            order = list(SAMPLINGS) if i % 2 == 0 else list(reversed(SAMPLINGS))
            for name, ring in built.items():
                for sampling in order:
                    m[(name, sampling)].append(ring_decode_tps(ring, prompt_ids, tokens, **SAMPLINGS[sampling]))
    print(
        f"6. sampling on a 2-stage ring (1 thread per stage), one request, {tokens} tokens, {rounds} rounds, medians:"
    )
    for name in rings:
        greedy = statistics.median(m[(name, "greedy")])
        cells = [
            f"{s} {statistics.median(m[(name, s)]):.2f} tok/s ({statistics.median(m[(name, s)]) / greedy:.2f})"
            for s in SAMPLINGS
        ]
        print(f"   output head {name}: " + "; ".join(cells))
    print("raw: " + ", ".join(f"{k[0]}/{k[1]}={[round(x, 2) for x in v]}" for k, v in m.items()))


def seal_cost(path: Path, prompts: list[list[int]], *, rounds: int, tokens: int) -> None:
    """7.: the same ring sealed and in the clear, one request and 4 in flight, alternated."""
    limits = Limits(micro_batch=2, row_width=64)
    even = split_layers(18, 2)
    m: dict[tuple[str, str], list[float]] = {
        (side, load): [] for side in ("sealed", "clear") for load in ("one", "four")
    }
    with contextlib.ExitStack() as stack:
        sealed = stack.enter_context(ProcessRing(path, even, limits=limits, threads=1, n_ctx=256))
        with unsealed():  # the bridge's links too
            clear = stack.enter_context(
                ProcessRing(
                    path,
                    even,
                    limits=limits,
                    threads=1,
                    n_ctx=256,
                    stage_module=("bench.unsealed", "mahout.ring.stage"),
                )
            )
        for ring, sealing in ((sealed, True), (clear, False)):  # what each side's bridge really sends
            assert all((link._outbound is not None) == sealing for link in (ring.bridge._head, ring.bridge._tail))
        rings = {"sealed": sealed, "clear": clear}
        for ring in rings.values():
            ring_decode_tps(ring, prompts[0], 4)  # warm-up
        for i in range(rounds):
            for side in ("sealed", "clear") if i % 2 == 0 else ("clear", "sealed"):
                m[(side, "one")].append(ring_decode_tps(rings[side], prompts[0], tokens))
                m[(side, "four")].append(ring_batch_tps(rings[side], prompts, tokens, in_flight=True))
    med = {k: statistics.median(v) for k, v in m.items()}
    print(
        f"7. sealing on a 2-stage ring (1 thread per stage), {tokens} tokens, {rounds} rounds, medians: "
        f"one request {med[('sealed', 'one')]:.2f} tok/s sealed, {med[('clear', 'one')]:.2f} in the clear "
        f"-> sealed / clear {med[('sealed', 'one')] / med[('clear', 'one')]:.3f}; 4 in flight "
        f"{med[('sealed', 'four')]:.2f} vs {med[('clear', 'four')]:.2f} tok/s "
        f"-> {med[('sealed', 'four')] / med[('clear', 'four')]:.3f} (floor 0.9)"
    )
    print("raw: " + ", ".join(f"{k[0]}/{k[1]}={[round(x, 2) for x in v]}" for k, v in m.items()))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--handshake-rounds", type=int, default=500)
    parser.add_argument("--handshake-only", action="store_true", help="measure only the link handshake (5.)")
    parser.add_argument("--sampling-only", action="store_true", help="measure only what sampling costs a ring (6.)")
    parser.add_argument(
        "--seal-only", action="store_true", help="measure only what sealing its links costs a ring (7.)"
    )
    args = parser.parse_args()
    if args.handshake_only:
        handshake_cost(args.handshake_rounds)
        return 0
    path = default_model_path()
    tokenizer = Tokenizer(path)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    if args.sampling_only:
        sampling_cost(path, prompts[0], rounds=args.rounds, tokens=args.tokens)
        return 0
    if args.seal_only:
        seal_cost(path, prompts, rounds=args.rounds, tokens=args.tokens)
        return 0
    # Micro-batch 2: four requests are two micro-batches, so both stages work at once (with one
    # micro-batch of 4 the pass bounces between the stages like a lone request).
    limits = Limits(micro_batch=2, row_width=64)
    print(
        f"model {path.name}; prompts of {[len(p) for p in prompts]} "
        f"tokens; {args.tokens} tokens each; {args.rounds} rounds"
    )

    (full,) = build_stages(path, [(0, 18)], n_rows=1, n_ctx=256)

    def engine_tps(threads: int) -> float:
        torch.set_num_threads(threads)
        return generate([full], prompts[0], args.tokens).decode_tokens_per_s

    from scorer.llama import load_llama

    llm = load_llama(path, n_ctx=256, threads=1)
    keys = ("ring1", "ring2", "eng2", "eng1", "alone", "packed", "llama1", "w_ring1", "w_alone", "w_packed")
    m: dict[str, list[float]] = {k: [] for k in keys}
    even = split_layers(18, 2)
    with (
        ProcessRing(path, even, limits=limits, threads=1, n_ctx=256) as ring,
        ProcessRing(path, even, limits=limits, threads=2, n_ctx=256) as ring_2t,
        ProcessRing(path, even, limits=limits, threads=1, n_ctx=256, share_output=False) as whole,
    ):
        ring_decode_tps(ring, prompts[0], 4)  # warm-up
        ring_decode_tps(ring_2t, prompts[0], 4)
        ring_decode_tps(whole, prompts[0], 4)
        for _ in range(args.rounds):
            m["ring1"].append(ring_decode_tps(ring, prompts[0], args.tokens))
            m["eng2"].append(engine_tps(2))
            m["w_ring1"].append(ring_decode_tps(whole, prompts[0], args.tokens))
            m["ring2"].append(ring_decode_tps(ring_2t, prompts[0], args.tokens))
            m["alone"].append(ring_batch_tps(ring, prompts, args.tokens, in_flight=False))
            m["packed"].append(ring_batch_tps(ring, prompts, args.tokens, in_flight=True))
            m["eng1"].append(engine_tps(1))
            m["llama1"].append(llama_decode_tps(llm, prompts[0], args.tokens))
            m["w_alone"].append(ring_batch_tps(whole, prompts, args.tokens, in_flight=False))
            m["w_packed"].append(ring_batch_tps(whole, prompts, args.tokens, in_flight=True))
        starved, saturated = phases(ring, prompts, args.tokens)
        w_starved, w_saturated = phases(whole, prompts, args.tokens)
    med = {k: statistics.median(v) for k, v in m.items()}
    best = max(med["eng1"], med["eng2"])
    print(
        f"1. 2-stage ring (2 processes x 1 thread), one request: {med['ring1']:.2f} tok/s decode; "
        f"engine 2 threads: {med['eng2']:.2f}, 1 thread: {med['eng1']:.2f} "
        f"tok/s -> ratio {med['ring1'] / med['eng2']:.2f} "
        f"vs 2 threads, {med['ring1'] / best:.2f} vs the better engine setting (target >= 0.85)"
    )
    print(
        f"   the same ring with 2 threads per stage (2 cores in use at a time), one request: {med['ring2']:.2f} tok/s "
        f"-> ratio {med['ring2'] / med['eng2']:.2f} vs the engine with 2 threads"
    )
    print(
        f"2. same ring, 4 requests in flight: {med['packed']:.2f} "
        f"tok/s; drained one at a time: {med['alone']:.2f} tok/s "
        f"-> ratio {med['packed'] / med['alone']:.2f} (target >= 1.4)"
    )
    print(
        f"   baseline, whole output head at the tail: one request {med['w_ring1']:.2f} tok/s "
        f"(ratio {med['w_ring1'] / med['eng2']:.2f} vs the engine with 2 threads; sharing gains "
        f"{med['ring1'] / med['w_ring1']:.2f}x); in flight {med['w_packed']:.2f}, drained {med['w_alone']:.2f} tok/s "
        f"-> ratio {med['w_packed'] / med['w_alone']:.2f}; shared in "
        f"flight vs whole in flight {med['packed'] / med['w_packed']:.2f}"
    )
    print(
        f"3. engine, 1 thread: {med['eng1']:.2f} tok/s decode; llama-cpp-python, 1 thread: {med['llama1']:.2f} tok/s "
        f"-> ratio {med['eng1'] / med['llama1']:.2f} (target >= 0.33)"
    )
    print("4. shared output head, starved (one request at a time): " + "; ".join(starved))
    print("   shared output head, saturated (8 requests in flight, micro-batch 2): " + "; ".join(saturated))
    print("   whole output head at the tail, starved: " + "; ".join(w_starved))
    print("   whole output head at the tail, saturated: " + "; ".join(w_saturated))
    handshake_cost(args.handshake_rounds)
    print("raw: " + ", ".join(f"{k}={[round(x, 2) for x in v]}" for k, v in m.items()))
    llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
