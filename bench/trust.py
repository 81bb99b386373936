"""Verification's error rates on the real model: honest hosts never flagged, cheats caught.

**1. Every job checkable (issue 29; the default).** Hosts draw every token by the specified
sampler (`protocol.sampling`) and report the token ids and seed; a verifier recomputes the
logits of prompt + answer in one prefill pass and checks each token (`scorer.verify`). On the
shipped Gemma 3 270M, measured in one run:

(a) decode speed with the specified sampler ÷ llama.cpp's own sampler (what hosts ran before:
    its default chain at the job's temperature): the same prompts and max_tokens, temperature
    0.8, the two taking turns prompt by prompt so the machine's drift hits both alike;
(b) audit cost ÷ generation cost, per job (same model, same answer): a 1-thread verifier against
    the 1-thread host that generated it, and a 2-thread verifier;
(c) false positives: `--jobs` honest answers (LlamaRunner, 1 thread) over temperatures 0, 0.7,
    1.2, 1.5 and top_p 1 and 0.9, each audited by a verifier on 1 thread and one on 2 (prefill
    against the host's one-token decode: llama.cpp's batched and single-token kernels differ by
    ~0.1 in a logit, up to ~1). Counted: failed audits, misses, uncertain tokens, and the largest
    `tie_gap` any honest token needed not to miss (bisected; the margin against TIE_GAP);
(d) cheats, simulated at the token level on the same jobs, audited as (c): random tokens
    ("junk"), the greedy answer to a sampled job ("temperature ignored"), an answer sampled with
    another seed than the one reported ("wrong seed"), and the first half of the honest answer
    claiming "stop" ("truncated"). Per cheat: answers caught, misses per answer, and the first
    token that misses.

    .venv/bin/python bench/trust.py [--jobs 200] [--max-tokens 48] [--speed-prompts 8]

(c) alone at scale (`--honest N`): N honest answers, each audited once, spread over
`--workers` processes that differ in thread counts (worker k: the host on 1 + k % 2 threads,
its verifier on 2 - k % 2), the settings of (c) in turn. Counted: failed audits, misses,
uncertain tokens, and the reasons of any failure. `--first K` starts at job K of the same
sequence (a later run adds jobs an earlier one did not cover). Each worker prints its running
counts every 25 answers, so a run that is cut short still gives its figures.

    .venv/bin/python bench/trust.py --honest 2000 [--first 0] [--workers 2] [--max-tokens 48]

No Django in part 1. Prints JSON, then a markdown table; asserts nothing.

**2. Canaries (`--canaries`).** For every prompt of the canary corpus, the reference is computed as `manage.py
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

    .venv/bin/python bench/trust.py --canaries [--max-tokens 24] [--count 32]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scorer.verify import Audit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORDS = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor".split()

# Part 1: prompts a chat customer and a completion customer send (Gemma's template takes no system turn).
CHATS = [
    "Write a haiku about elephants.",
    "Explain photosynthesis to a child.",
    "What is the capital of France?",
    "Tell me a joke about cats.",
    "List three uses of copper.",
    "How do I boil an egg?",
    "🐘🎉 象は大きい。大象很大。코끼리는 크다.",
    "Summarise the plot of Hamlet in two sentences.",
]
COMPLETIONS = [
    "The elephant is the largest land animal. It",
    "Once upon a time, in a village by the sea,",
    "def fibonacci(n):\n",
    "The history of Rome begins",
    "Dear Sir or Madam,\n\nI am writing to",
    "1. Preheat the oven to 180 °C.\n2.",
]
SETTINGS = [(temperature, top_p) for temperature in (0.0, 0.7, 1.2, 1.5) for top_p in (1.0, 0.9)]
CHEATS = ("junk", "temperature ignored", "wrong seed", "truncated")


def job_for(index: int, *, max_tokens: int, temperature: float, top_p: float) -> dict:
    """The index-th job: chats and completions in turn, rendered as the gateway sends them."""
    from testkit.formats import rendered

    chat = index % 2 == 0
    body = {
        "id": f"job-{index}",
        "model": "gemma-3-270m",
        "kind": "chat" if chat else "completion",
        "messages": [{"role": "user", "content": CHATS[index // 2 % len(CHATS)]}] if chat else None,
        "prompt": None if chat else COMPLETIONS[index // 2 % len(COMPLETIONS)],
        "params": {
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "stop": None,
            "seed": 10_000 + index,
        },
    }
    return rendered(body)


def answer_of(runner, job: dict) -> dict:  # type: ignore[no-untyped-def]
    """What an honest host reports for `job`, and how long it took."""
    began = time.perf_counter()
    text = "".join(runner.stream(job))
    return {
        "token_ids": list(runner.token_ids),
        "text": text,
        "finish_reason": runner.finish_reason,
        "seed": runner.seed,
        "seconds": time.perf_counter() - began,
    }


def speed_phase(runner, *, prompts: int, max_tokens: int) -> dict:  # type: ignore[no-untyped-def]
    """(a): ms per generated token, streamed from a cold cache (the same prefill for both): the
    specified sampler as the runner installs it (a logits processor, llama.cpp then greedy)
    against llama.cpp's own chain at the job's temperature (what hosts ran before), taking
    turns prompt by prompt, the order alternating."""
    from llama_cpp import LogitsProcessorList

    from mahout.runners.llama import SpecifiedSampler

    llm, timed = runner._llm, {"specified": [0.0, 0], "llama.cpp": [0.0, 0]}
    for index in range(prompts):
        prompt = runner.prompt_tokens(job_for(2 * index + 1, max_tokens=max_tokens, temperature=0.8, top_p=1.0))
        for name in ("specified", "llama.cpp") if index % 2 else ("llama.cpp", "specified"):
            llm.reset()
            began = time.perf_counter()
            if name == "specified":
                sampler = SpecifiedSampler(seed=index, temperature=0.8, top_p=1.0)
                chunks = llm.create_completion(
                    prompt=prompt,
                    stream=True,
                    max_tokens=max_tokens,
                    temperature=0.0,
                    logits_processor=LogitsProcessorList([sampler]),
                )
            else:
                chunks = llm.create_completion(
                    prompt=prompt, stream=True, max_tokens=max_tokens, temperature=0.8, top_p=1.0, seed=index
                )
            for _ in chunks:
                pass
            timed[name][0] += time.perf_counter() - began
            timed[name][1] += llm.n_tokens - len(prompt) + 1  # the last token sampled is never evaluated
    ms = {name: 1000 * seconds / tokens for name, (seconds, tokens) in timed.items()}
    return {
        "ms_per_token": ms,
        "tokens": {name: tokens for name, (_, tokens) in timed.items()},
        "ratio": ms["llama.cpp"] / ms["specified"],
    }


class NeededGap:
    """Wraps `scorer.verify.token_check` to record, for each honest token that is not a match,
    the smallest tie_gap under which it would not miss (bisected): how close honest drift came."""

    def __init__(self) -> None:
        import scorer.verify as verify

        self.module, self.original, self.needed = verify, verify.token_check, [0.0]
        self.on = False

    def __enter__(self) -> NeededGap:
        self.module.token_check = self
        return self

    def __exit__(self, *_exc: object) -> None:
        self.module.token_check = self.original

    def __call__(self, logits, token, **kwargs):  # type: ignore[no-untyped-def]
        from protocol.sampling import MATCH, MISS

        check = self.original(logits, token, **kwargs)
        if self.on and check.verdict != MATCH:
            low, high = 0.0, 8.0
            if self.original(logits, token, **{**kwargs, "tie_gap": high}).verdict == MISS:
                self.needed.append(high)
                return check
            for _ in range(10):
                middle = (low + high) / 2
                low, high = (
                    (middle, high)
                    if self.original(logits, token, **{**kwargs, "tie_gap": middle}).verdict == MISS
                    else (low, middle)
                )
            self.needed.append(high)
        return check


def cheat_answers(runner, job: dict, honest: dict, rng: random.Random) -> dict[str, dict]:  # type: ignore[no-untyped-def]
    """Each cheat's report for `job` (those that differ from honesty for its parameters)."""
    params, llm = job["params"], runner._llm
    words = " ".join(rng.choice(WORDS) for _ in range(params["max_tokens"]))
    junk = llm.tokenize(words.encode(), add_bos=False)[: params["max_tokens"]]
    cheats = {
        "junk": {
            "token_ids": junk,
            "text": llm.detokenize(junk).decode("utf-8", errors="ignore"),
            "finish_reason": "length",
            "seed": params["seed"],
        }
    }
    if len(honest["token_ids"]) >= 4:
        half = honest["token_ids"][: len(honest["token_ids"]) // 2]
        cheats["truncated"] = {
            "token_ids": half,
            "text": llm.detokenize(half).decode("utf-8", errors="ignore"),
            "finish_reason": "stop",
            "seed": params["seed"],
        }
    if params["temperature"] > 0:
        greedy = answer_of(runner, {**job, "params": {**params, "temperature": 0.0}})
        cheats["temperature ignored"] = {**greedy, "seed": params["seed"]}
        other = answer_of(runner, {**job, "params": {**params, "seed": params["seed"] + 7919}})
        cheats["wrong seed"] = {**other, "seed": params["seed"]}
    return cheats


def audited(verifier, job: dict, answer: dict, sample: int | None = None) -> tuple[Audit, float]:  # type: ignore[no-untyped-def]
    began = time.perf_counter()
    audit = verifier.audit(
        job,
        token_ids=answer["token_ids"],
        text=answer["text"],
        finish_reason=answer["finish_reason"],
        seed=answer["seed"],
        sample=sample,
    )
    return audit, time.perf_counter() - began


def caught_by_sample(checked: int, misses: int, sample: int) -> float:
    """The chance that `sample` tokens drawn from `checked` include one of its `misses`."""
    if checked <= sample:
        return 1.0 if misses else 0.0
    return 1.0 - math.comb(checked - misses, sample) / math.comb(checked, sample)


def sampler_main(args: argparse.Namespace) -> None:
    """Part 1 (see the module's docstring)."""
    from engine.gguf_loader import default_model_path
    from mahout.runners.llama import LlamaRunner
    from protocol.sampling import TOLERANCE
    from scorer.verify import Verifier

    path = default_model_path()
    started = time.monotonic()
    runner = LlamaRunner(path, threads=1, n_ctx=2048)
    verifiers = {threads: Verifier(path, threads=threads, n_ctx=2048, tie_gap=args.tie_gap) for threads in (1, 2)}
    speed = speed_phase(runner, prompts=args.speed_prompts, max_tokens=64)
    print(f"speed done ({time.monotonic() - started:.0f} s)", flush=True)
    rng = random.Random(29)
    honest: dict[int, dict[str, Any]] = {
        threads: {"audits": 0, "failed": 0, "tokens": 0, "misses": 0, "uncertain": 0, "reasons": []}
        for threads in (1, 2)
    }
    by_setting: dict[str, dict[str, int]] = {}
    cost = {"generation_s": 0.0, "audit_s": 0.0, "sampled_audit_s": 0.0}
    cheats: dict[str, dict[str, Any]] = {
        name: {"answers": 0, "caught": 0, "misses": 0, "checked": 0, "first_miss": [], "by": {}, "sampled": 0.0}
        for name in CHEATS
    }
    with NeededGap() as needed:
        for index in range(args.jobs):
            temperature, top_p = SETTINGS[index % len(SETTINGS)]
            job = job_for(index, max_tokens=args.max_tokens, temperature=temperature, top_p=top_p)
            answer = answer_of(runner, job)
            cost["generation_s"] += answer["seconds"]
            cost["sampled_audit_s"] += audited(verifiers[1], job, answer, sample=args.sample)[1]
            setting = by_setting.setdefault(
                f"T={temperature:g} top_p={top_p:g}", {"tokens": 0, "matched": 0, "uncertain": 0, "misses": 0}
            )
            for threads, verifier in verifiers.items():
                needed.on = threads == 2  # the bisection's extra checks would be timed on the 1-thread verifier
                audit, seconds = audited(verifier, job, answer)
                needed.on = False
                if threads == 1:
                    cost["audit_s"] += seconds
                row = honest[threads]
                row["audits"] += 1
                row["failed"] += audit.reason is not None
                row["tokens"] += audit.checked
                row["misses"] += len(audit.misses)
                row["uncertain"] += audit.uncertain
                if audit.reason and len(row["reasons"]) < 3:
                    row["reasons"].append(audit.reason)
                for key, value in (
                    ("tokens", audit.checked),
                    ("matched", audit.matched),
                    ("uncertain", audit.uncertain),
                    ("misses", len(audit.misses)),
                ):
                    setting[key] += value
            for name, cheat in cheat_answers(runner, job, answer, rng).items():
                audit, _ = audited(verifiers[1 + index % 2], job, cheat)
                row = cheats[name]
                row["answers"] += 1
                row["caught"] += audit.reason is not None
                row["misses"] += len(audit.misses)
                row["checked"] += audit.checked
                row["sampled"] += (
                    1.0
                    if audit.reason and not audit.misses
                    else caught_by_sample(audit.checked, len(audit.misses), args.sample)
                )
                if audit.misses:
                    row["first_miss"].append(audit.misses[0][0])
                by = "spelling" if audit.reason and not audit.misses else "draws" if audit.reason else "passed"
                row["by"][by] = row["by"].get(by, 0) + 1
            if (index + 1) % 10 == 0:
                print(f"{index + 1} jobs ({time.monotonic() - started:.0f} s)", flush=True)
    for row in cheats.values():
        row["first_miss_median"] = statistics.median(row["first_miss"]) if row["first_miss"] else None
        row["sampled"] = row["sampled"] / row["answers"] if row["answers"] else None
        del row["first_miss"]
    gaps = sorted(needed.needed)
    result = {
        "jobs": args.jobs,
        "max_tokens": args.max_tokens,
        "tie_gap": args.tie_gap,
        "tolerance": TOLERANCE,
        "sample": args.sample,
        "speed": speed,
        "cost": cost,
        "audit_cost": cost["audit_s"] / cost["generation_s"],
        "sampled_audit_cost": cost["sampled_audit_s"] / cost["generation_s"],
        "honest": honest,
        "by_setting": by_setting,
        "honest_needed_tie_gap": {
            "tokens_not_matched": len(gaps) - 1,
            "max": gaps[-1],
            "p99": gaps[int(0.99 * (len(gaps) - 1))],
        },
        "cheats": cheats,
        "seconds": time.monotonic() - started,
    }
    print(json.dumps(result, indent=1))
    print()
    print(sampler_table(result))


def sampler_table(result: dict) -> str:
    speed, honest, cheats, needed = result["speed"], result["honest"], result["cheats"], result["honest_needed_tie_gap"]
    k = result["sample"]
    lines = [
        "| measure | result | floor | goal |",
        "|---|---|---|---|",
        f"| decode speed, specified sampler ÷ llama.cpp's own (T 0.8; {speed['ms_per_token']['specified']:.1f} against "
        f"{speed['ms_per_token']['llama.cpp']:.1f} ms/token, "
        f"{speed['tokens']['specified']} tokens) | {speed['ratio']:.3f} | ≥ 0.9 | ≥ 0.97 |",
        f"| audit cost ÷ generation cost ({result['max_tokens']} "
        f"tokens, 1 thread each): every token / {k} tokens drawn "
        f"| {result['audit_cost']:.3f} / {result['sampled_audit_cost']:.3f} | ≤ 0.15 | ≤ 0.05 |",
    ]
    for threads, row in honest.items():
        lines.append(
            f"| false positives, verifier on {threads} thread(s): failed audits of {row['audits']} honest answers "
            f"({row['tokens']} tokens: {row['misses']} misses, "
            f"{row['uncertain']} uncertain) | {row['failed']} | 0 | 0 |"
        )
    lines.append(
        "| largest tie_gap an honest token needed (of "
        f"{needed['tokens_not_matched']} not matched; p99 {needed['p99']:.3f}) "
        f"| {needed['max']:.3f} | < tie_gap {result['tie_gap']} | |"
    )
    for name, row in cheats.items():
        first = "—" if row["first_miss_median"] is None else f"{row['first_miss_median']:g}"
        sampled = "—" if row["sampled"] is None else f"{row['sampled']:.0%}"
        lines.append(
            f"| cheat caught: {name} (by {row['by']}; {row['misses']} of {row['checked']} tokens miss; median first "
            f"miss at token {first}; with {k} tokens drawn: {sampled}) | "
            f"{row['caught']}/{row['answers']} | every one | every one |"
        )
    return "\n".join(lines)


def honest_part(args: argparse.Namespace) -> dict:
    """One worker's share of `--honest`: jobs part, part + workers, ... (see the docstring)."""
    from engine.gguf_loader import default_model_path
    from mahout.runners.llama import LlamaRunner
    from scorer.verify import Verifier

    path = default_model_path()
    host_threads, verifier_threads = 1 + args.part % 2, 2 - args.part % 2
    runner = LlamaRunner(path, threads=host_threads, n_ctx=2048)
    verifier = Verifier(path, threads=verifier_threads, n_ctx=2048, tie_gap=args.tie_gap)
    row: dict[str, Any] = {
        "host_threads": host_threads,
        "verifier_threads": verifier_threads,
        "audits": 0,
        "failed": 0,
        "tokens": 0,
        "matched": 0,
        "misses": 0,
        "uncertain": 0,
        "reasons": [],
        "generation_s": 0.0,
        "audit_s": 0.0,
    }
    started = time.monotonic()
    for index in range(args.first + args.part, args.first + args.honest, args.workers):
        temperature, top_p = SETTINGS[index % len(SETTINGS)]
        job = job_for(index, max_tokens=args.max_tokens, temperature=temperature, top_p=top_p)
        answer = answer_of(runner, job)
        audit, seconds = audited(verifier, job, answer)
        row["generation_s"] += answer["seconds"]
        row["audit_s"] += seconds
        row["audits"] += 1
        row["failed"] += audit.reason is not None
        row["tokens"] += audit.checked
        row["matched"] += audit.matched
        row["misses"] += len(audit.misses)
        row["uncertain"] += audit.uncertain
        if audit.reason:
            line = f"job {index} (T={temperature:g} top_p={top_p:g}): {audit.reason}"
            print(f"worker {args.part}: failed {line}", file=sys.stderr, flush=True)
            if len(row["reasons"]) < 5:
                row["reasons"].append(line)
        if row["audits"] % 25 == 0:
            print(
                f"worker {args.part}: {row['audits']} audited (up to job {index}), {row['failed']} failed, "
                f"{row['tokens']} tokens checked, {row['matched']} matched, {row['uncertain']} uncertain, "
                f"{row['misses']} misses ({time.monotonic() - started:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    return row


def honest_main(args: argparse.Namespace) -> None:
    """`--honest N` (see the module's docstring): the workers in parallel, their counts summed."""
    import subprocess

    started = time.monotonic()
    children = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--honest",
                str(args.honest),
                "--workers",
                str(args.workers),
                "--first",
                str(args.first),
                "--part",
                str(part),
                "--max-tokens",
                str(args.max_tokens),
                "--tie-gap",
                str(args.tie_gap),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for part in range(args.workers)
    ]
    rows = []
    for child in children:
        out, _ = child.communicate()
        if child.returncode != 0:
            raise SystemExit(f"a worker failed (exit {child.returncode})")
        rows.append(json.loads(out.strip().splitlines()[-1]))
    total = {
        key: sum(row[key] for row in rows)
        for key in ("audits", "failed", "tokens", "matched", "misses", "uncertain", "generation_s", "audit_s")
    }
    result = {
        "honest": args.honest,
        "first": args.first,
        "max_tokens": args.max_tokens,
        "tie_gap": args.tie_gap,
        "workers": rows,
        "total": total,
        "audit_cost": total["audit_s"] / total["generation_s"],
        "seconds": time.monotonic() - started,
    }
    print(json.dumps(result, indent=1))
    print()
    print(
        "| host threads | verifier threads | audited answers | failed | tokens checked | matched | uncertain | misses |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in [*rows, {**total, "host_threads": "all", "verifier_threads": ""}]:
        print(
            f"| {row['host_threads']} | {row['verifier_threads']} | "
            f"{row['audits']} | {row['failed']} | {row['tokens']} | "
            f"{row['matched']} | {row['uncertain']} | {row['misses']} |"
        )


def setup() -> None:
    os.environ.setdefault("SQLITE_PATH", str(Path(tempfile.mkdtemp()) / "trust.sqlite3"))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django

    django.setup()


def job_of(item: dict) -> dict:
    from marketplace.lifecycle.canaries import canary_job
    from testkit.formats import GEMMA

    return canary_job(GEMMA, kind=item["kind"], messages=item.get("messages"), prompt=item.get("prompt"))


def llama_answer(llm, item: dict, max_tokens: int, **sampling: object) -> tuple[str, int]:  # type: ignore[no-untyped-def]
    from marketplace.lifecycle.canaries import job_tokens
    from protocol.jobs import job_stop_strings

    job = job_of(item)
    tokens = job_tokens(llm, job)
    out = llm.create_completion(prompt=tokens, max_tokens=max_tokens, stop=job_stop_strings(job), **sampling)
    return out["choices"][0]["text"], int(out["usage"]["completion_tokens"])


def smaller_model_answer(stages, llm, item: dict, max_tokens: int) -> tuple[str, int]:  # type: ignore[no-untyped-def]
    """The engine's greedy answer with some layers skipped (what a cheat passing off a
    cheaper model would send); tokenized and detokenized as llama.cpp does."""
    from engine.generate import generate
    from marketplace.lifecycle.canaries import job_tokens

    prompt = job_tokens(llm, job_of(item))
    ids = generate(stages, prompt, max_tokens, stop_ids=[llm.token_eos()]).token_ids
    ids = [i for i in ids if i != llm.token_eos()]
    return llm.detokenize(ids).decode("utf-8", errors="ignore"), len(ids)


def canaries_main(args: argparse.Namespace) -> None:
    """The canaries' error rates (see the module's docstring, part 2)."""
    setup()
    from django.conf import settings

    from catalog.tokenizer import shipped_model_path
    from marketplace.lifecycle.canaries import (
        REFERENCE_CTX,
        corpus,
        informative,
        reference_of,
        score_reason,
        verdict_reason,
    )
    from marketplace.models import CanaryReference
    from scorer.llama import load_llama
    from testkit.formats import GEMMA

    path = str(shipped_model_path())
    started = time.monotonic()
    reference_llm = load_llama(path, n_ctx=REFERENCE_CTX, threads=2, logits_all=True)
    kept = []
    for item in corpus()[: args.count]:
        reference = reference_of(
            reference_llm, item, fmt=GEMMA, max_tokens=args.max_tokens, tie_gap=settings.CANARY_TIE_GAP
        )
        if informative(item, reference):
            prompt = item.get("messages") if item["kind"] == "chat" else item["prompt"]
            row = CanaryReference(
                kind=item["kind"],
                prompt=prompt,
                max_tokens=args.max_tokens,
                text=reference.text,
                tokens=reference.tokens,
                exact_chars=reference.exact_chars,
                gaps=reference.gaps,
            )
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
        by_reference = [
            verdict_reason(row, text=text, completion_tokens=tokens) for (_, _, row), (text, tokens) in pairs
        ]
        # the gateway scores an answer that parted from the reference at a near-tie (`canary_score_pending`)
        full = [
            reason or (scored(row, text, tokens) if text != row.text else None)
            for reason, ((_, _, row), (text, tokens)) in zip(by_reference, pairs, strict=True)
        ]
        result = {"canaries": len(kept)}
        for name, reasons in (("reference_only", by_reference), ("scored", full)):
            caught = sum(1 for reason in reasons if reason)
            p = caught / len(kept)
            result[name] = {"failed": caught, "per_canary": p, f"per_host_over_{k}": 1 - (1 - p) ** k}
        p_scored = result["scored"]["per_canary"]
        # canaries go one at a time, every CANARY_PROBATION_SECONDS, the first at the host's first heartbeat:
        # caught on average at canary 1/p, then the worker's next tick reads it
        result["expected_detection_s"] = (
            round((1 / p_scored - 1) * settings.CANARY_PROBATION_SECONDS + settings.WATCHDOG_INTERVAL_SECONDS, 1)
            if p_scored
            else None
        )
        result["scored_answers"] = sum(
            1
            for reason, ((_, _, row), (text, _)) in zip(by_reference, pairs, strict=True)
            if reason is None and text != row.text
        )
        result["reasons"] = [reason for reason in full if reason][:3]
        return result

    results: dict[str, dict] = {}
    for threads in (1, 2, 3):
        llm = load_llama(path, n_ctx=2048, threads=threads)
        results[f"honest, {threads} thread(s)"] = rate(
            [llama_answer(llm, item, args.max_tokens, temperature=0.0, top_p=1.0) for item, _, _ in kept]
        )
        if threads == 1:
            results["temperature 1 (0 asked)"] = rate(
                [
                    llama_answer(llm, item, args.max_tokens, temperature=1.0, seed=500 + i)
                    for i, (item, _, _) in enumerate(kept)
                ]
            )
        llm.close()
    rng = random.Random(7)
    results["random words"] = rate([(" ".join(rng.choice(WORDS) for _ in range(12)), 12) for _ in kept])
    results["echo of the prompt"] = rate(
        [(item.get("prompt") or item["messages"][-1]["content"], ref.tokens) for item, ref, _ in kept]
    )
    results["cut short (the last quarter dropped)"] = rate(
        [(ref.text[: len(ref.text) * 3 // 4], max(1, ref.tokens * 3 // 4)) for _, ref, _ in kept]
    )
    results["more text than asked"] = rate(
        [(ref.text + " and then some more words", args.max_tokens + 6) for _, ref, _ in kept]
    )

    from engine.generate import build_stages
    from engine.gguf_loader import read_config
    from engine.gguf_meta import open_gguf

    n_layers = read_config(open_gguf(path)).n_layers
    skip = sorted(int(x) for x in args.skip.split(","))
    ranges = [(0, skip[0]), (skip[-1] + 1, n_layers)]
    stages = build_stages(path, ranges, n_rows=1, n_ctx=512)
    results[f"smaller model (layers {args.skip} of {n_layers} skipped)"] = rate(
        [smaller_model_answer(stages, reference_llm, item, args.max_tokens) for item, _, _ in kept]
    )
    scoring = {
        "scored": len(scored_s),
        "median_s": sorted(scored_s)[len(scored_s) // 2] if scored_s else None,
        "max_s": max(scored_s, default=None),
    }
    print(
        json.dumps(
            {
                "tie_gap": settings.CANARY_TIE_GAP,
                "kept": len(kept),
                "of": args.count,
                "references_s": references_s,
                "scoring": scoring,
                "results": results,
            },
            indent=2,
        )
    )
    for name, r in results.items():
        for judge in ("reference_only", "scored"):
            j = r[judge]
            print(
                f"{name:<44} {judge:<15} failed {j['failed']:>2}/{r['canaries']} canaries ({j['per_canary']:.0%}); "
                f"per host in probation: {j[f'per_host_over_{k}']:.1%}"
            )
        print(
            f"{name:<44} expected time from first canary to detection: {r['expected_detection_s']} s "
            "(+ the answer's own time)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--canaries", action="store_true", help="part 2: the canaries' error rates (Django)")
    parser.add_argument("--jobs", type=int, default=200, help="part 1: honest answers audited")
    parser.add_argument("--max-tokens", type=int, default=None, help="part 1: 48; part 2: 24")
    parser.add_argument("--speed-prompts", type=int, default=8, help="part 1: prompts timed by each sampler")
    parser.add_argument("--tie-gap", type=float, default=None, help="part 1: the verifier's tie_gap (default TIE_GAP)")
    parser.add_argument("--sample", type=int, default=16, help="part 1: tokens a sampled audit checks (AUDIT_TOKENS)")
    parser.add_argument("--count", type=int, default=32, help="part 2: canary prompts")
    parser.add_argument("--skip", default="8,9", help="part 2: layers the smaller-model cheat skips")
    parser.add_argument("--honest", type=int, default=0, help="part 1 (c) alone: this many honest answers audited")
    parser.add_argument("--first", type=int, default=0, help="with --honest: the first job's index in the sequence")
    parser.add_argument("--workers", type=int, default=2, help="with --honest: processes, thread counts differing")
    parser.add_argument("--part", type=int, default=None, help=argparse.SUPPRESS)  # a worker's index
    args = parser.parse_args()
    if args.honest:
        from protocol.sampling import TIE_GAP

        args.max_tokens = args.max_tokens or 48
        args.tie_gap = TIE_GAP if args.tie_gap is None else args.tie_gap
        if args.part is None:
            honest_main(args)
        else:
            print(json.dumps(honest_part(args)))
    elif args.canaries:
        args.max_tokens = args.max_tokens or 24
        canaries_main(args)
    else:
        from protocol.sampling import TIE_GAP

        args.max_tokens = args.max_tokens or 48
        args.tie_gap = TIE_GAP if args.tie_gap is None else args.tie_gap
        sampler_main(args)


if __name__ == "__main__":
    main()
