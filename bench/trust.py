"""Verification's error rates on the real model: honest hosts never flagged, cheats caught.

For every prompt of the canary corpus, the reference is computed as `manage.py
canary_references` computes it (llama-cpp-python, 2 threads, greedy, log-probabilities);
prompts that check too little are dropped, as there. Then each "host" answers every kept
canary and the verdict is counted:

- honest: the shipped model, greedy, with 1, 2 and 3 threads (llama.cpp's sums run in
  another order, so the logits differ in their last digits): false positives;
- cheats: random words; an echo of the prompt; temperature 1 when 0 was asked (a new seed
  per canary); the answer cut short (the first half); more text than asked; and a *smaller
  model* — the engine (PyTorch Gemma 3) running the shipped weights with two layers
  skipped, greedy.

Each answer is judged twice: by the reference alone (the answer may part from it only at a
near-tie, and nothing after the parting is checked) and as the gateway judges it, where an
answer that parted is then read under the real model token by token (`score_reason`).

Canary volume and cost per host are in BENCHMARKS.md (worked out from the settings); the
expected time from a host's first canary to its detection is printed per cheat.

A host in probation answers CANARY_TRUST_AFTER canaries drawn at random; it is caught when
one of them fails, so per host the detection rate is 1 − (1 − p)^k for a per-canary rate p.

    .venv/bin/python bench/trust.py [--max-tokens 24] [--count 32]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORDS = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor".split()


def setup() -> None:
    os.environ.setdefault("SQLITE_PATH", str(Path(tempfile.mkdtemp()) / "trust.sqlite3"))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django

    django.setup()


def job_of(item: dict) -> dict:
    from marketplace.canaries import canary_job
    from testkit.formats import GEMMA

    return canary_job(GEMMA, kind=item["kind"], messages=item.get("messages"), prompt=item.get("prompt"))


def llama_answer(llm, item: dict, max_tokens: int, **sampling: object) -> tuple[str, int]:  # type: ignore[no-untyped-def]
    from marketplace.canaries import job_tokens
    from protocol.jobs import job_stop_strings

    job = job_of(item)
    tokens = job_tokens(llm, job)
    out = llm.create_completion(prompt=tokens, max_tokens=max_tokens, stop=job_stop_strings(job), **sampling)
    return out["choices"][0]["text"], int(out["usage"]["completion_tokens"])


def smaller_model_answer(stages, llm, item: dict, max_tokens: int) -> tuple[str, int]:  # type: ignore[no-untyped-def]
    """The engine's greedy answer with some layers skipped (what a cheat passing off a
    cheaper model would send); tokenized and detokenized as llama.cpp does."""
    from engine.generate import generate
    from marketplace.canaries import job_tokens

    prompt = job_tokens(llm, job_of(item))
    ids = generate(stages, prompt, max_tokens, stop_ids=[llm.token_eos()]).token_ids
    ids = [i for i in ids if i != llm.token_eos()]
    return llm.detokenize(ids).decode("utf-8", errors="ignore"), len(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--count", type=int, default=32)
    parser.add_argument("--skip", default="8,9", help="layers the smaller-model cheat skips")
    args = parser.parse_args()
    setup()
    from django.conf import settings

    from catalog.tokenizer import shipped_model_path
    from mahout.runners.llama import load_llama
    from marketplace.canaries import REFERENCE_CTX, corpus, informative, reference_of, score_reason, verdict_reason
    from marketplace.models import CanaryReference

    path = str(shipped_model_path())
    started = time.monotonic()
    reference_llm = load_llama(path, n_ctx=REFERENCE_CTX, threads=2, logits_all=True)
    kept = []
    for item in corpus()[: args.count]:
        reference = reference_of(reference_llm, item, max_tokens=args.max_tokens, tie_gap=settings.CANARY_TIE_GAP)
        if informative(item, reference):
            prompt = item.get("messages") if item["kind"] == "chat" else item["prompt"]
            row = CanaryReference(kind=item["kind"], prompt=prompt, max_tokens=args.max_tokens, text=reference.text,
                                  tokens=reference.tokens, exact_chars=reference.exact_chars, gaps=reference.gaps)
            kept.append((item, reference, row))
    references_s = time.monotonic() - started

    k = settings.CANARY_TRUST_AFTER
    scored_s: list[float] = []

    def scored(row, text: str, tokens: int) -> str | None:  # type: ignore[no-untyped-def]
        began = time.monotonic()
        reason = score_reason(reference_llm, row, text=text, completion_tokens=tokens)
        scored_s.append(time.monotonic() - began)
        return reason

    def rate(answers: list[tuple[str, int]]) -> dict:
        pairs = list(zip(kept, answers, strict=True))
        by_reference = [verdict_reason(row, text=text, completion_tokens=tokens) for (_, _, row), (text, tokens) in pairs]
        # the gateway scores an answer that parted from the reference at a near-tie (`canary_score_pending`)
        full = [reason or (scored(row, text, tokens) if text != row.text else None)
                for reason, ((_, _, row), (text, tokens)) in zip(by_reference, pairs, strict=True)]
        result = {"canaries": len(kept)}
        for name, reasons in (("reference_only", by_reference), ("scored", full)):
            caught = sum(1 for reason in reasons if reason)
            p = caught / len(kept)
            result[name] = {"failed": caught, "per_canary": p, f"per_host_over_{k}": 1 - (1 - p) ** k}
        p_scored = result["scored"]["per_canary"]
        # canaries go one at a time, every CANARY_PROBATION_SECONDS, the first at the host's first heartbeat:
        # caught on average at canary 1/p, then the worker's next tick reads it
        result["expected_detection_s"] = (round((1 / p_scored - 1) * settings.CANARY_PROBATION_SECONDS
                                                + settings.WATCHDOG_INTERVAL_SECONDS, 1) if p_scored else None)
        result["scored_answers"] = sum(1 for reason, ((_, _, row), (text, _)) in zip(by_reference, pairs, strict=True)
                                       if reason is None and text != row.text)
        result["reasons"] = [reason for reason in full if reason][:3]
        return result

    results: dict[str, dict] = {}
    for threads in (1, 2, 3):
        llm = load_llama(path, n_ctx=2048, threads=threads)
        results[f"honest, {threads} thread(s)"] = rate([llama_answer(llm, item, args.max_tokens, temperature=0.0, top_p=1.0)
                                                       for item, _, _ in kept])
        if threads == 1:
            results["temperature 1 (0 asked)"] = rate([llama_answer(llm, item, args.max_tokens, temperature=1.0, seed=500 + i)
                                                      for i, (item, _, _) in enumerate(kept)])
        llm.close()
    rng = random.Random(7)
    results["random words"] = rate([(" ".join(rng.choice(WORDS) for _ in range(12)), 12) for _ in kept])
    results["echo of the prompt"] = rate([(item.get("prompt") or item["messages"][-1]["content"], ref.tokens)
                                          for item, ref, _ in kept])
    results["cut short (the last quarter dropped)"] = rate([(ref.text[: len(ref.text) * 3 // 4], max(1, ref.tokens * 3 // 4))
                                                            for _, ref, _ in kept])
    results["more text than asked"] = rate([(ref.text + " and then some more words", args.max_tokens + 6) for _, ref, _ in kept])

    from engine.generate import build_stages
    from engine.gguf_loader import read_config
    from engine.gguf_meta import open_gguf

    n_layers = read_config(open_gguf(path)).n_layers
    skip = sorted(int(x) for x in args.skip.split(","))
    ranges = [(0, skip[0]), (skip[-1] + 1, n_layers)]
    stages = build_stages(path, ranges, n_rows=1, n_ctx=512)
    results[f"smaller model (layers {args.skip} of {n_layers} skipped)"] = rate(
        [smaller_model_answer(stages, reference_llm, item, args.max_tokens) for item, _, _ in kept])
    scoring = {"scored": len(scored_s), "median_s": sorted(scored_s)[len(scored_s) // 2] if scored_s else None,
               "max_s": max(scored_s, default=None)}
    print(json.dumps({"tie_gap": settings.CANARY_TIE_GAP, "kept": len(kept), "of": args.count, "references_s": references_s,
                      "scoring": scoring, "results": results}, indent=2))
    for name, r in results.items():
        for judge in ("reference_only", "scored"):
            j = r[judge]
            print(f"{name:<44} {judge:<15} failed {j['failed']:>2}/{r['canaries']} canaries ({j['per_canary']:.0%}); "
                  f"per host in probation: {j[f'per_host_over_{k}']:.1%}")
        print(f"{name:<44} expected time from first canary to detection: {r['expected_detection_s']} s "
              "(+ the answer's own time)")


if __name__ == "__main__":
    main()
