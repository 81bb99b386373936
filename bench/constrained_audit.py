"""Audits of constrained answers on the real model (issue 29): structured output, resumed text,
reported log-probabilities (`scorer.verify`; part 1 of `bench/trust.py` measures free text).

On the shipped Gemma 3 270M, a 1-thread host (LlamaRunner) and a 1-thread verifier (`--verifier-threads`), one run:

(a) the grammar matcher's cost: llama.cpp asked about every token of the vocabulary, and about
    the 1,024 likeliest, per call, over the states of real answers (ms);
(b) structured output (a JSON schema, and `json_object`), per temperature and top_p: the host's
    decode time a token under the grammar ÷ its free-text decode of the same prompts (taking
    turns), the share of draws settled without asking the grammar about every token, audit time
    ÷ generation time beside the same ratio for the free-text answers (the baseline), honest
    answers failed (false positives) and their misses; cheats caught:
    the honest tokens with another seed, the greedy answer to a sampled job, and the model's
    free-text answer (it breaks the grammar);
(c) continuations: a sampled chat answer cut mid-word, continued as the gateway sends it
    (`protocol.jobs.job_payload_build`), audited: honest ones failed, another seed caught;
(d) log-probabilities: the largest gap between an honest host's reported values and the
    verifier's (against LOGPROB_TOLERANCE), and invented values (each token's own value set
    to -0.05) caught.

    .venv/bin/python bench/constrained_audit.py [--jobs 6] [--max-tokens 48] [--verifier-threads 1]

Prints JSON; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "hobbies"],
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
}
ASKS = [
    "Describe a person as JSON.",
    "Invent a character for a story, as JSON.",
    "Give me a JSON record of a pet owner.",
    "Return a JSON object about a famous scientist.",
    "Make up a user profile in JSON.",
    "A JSON person, please.",
]
STORIES = [
    "Write a short story about a fox.",
    "Explain how rain forms.",
    "Describe your ideal holiday.",
    "Tell me about the history of tea.",
    "Write a letter to a friend.",
    "Explain photosynthesis to a child.",
]
SETTINGS = [(0.0, 1.0), (0.7, 1.0), (1.0, 0.9)]
FORMATS = [{"type": "json_schema", "name": "person", "schema": PERSON}, {"type": "json_object"}]


class Counted:
    """Counts the grammar's questions while `on`: steps drawn, and those that asked about every token."""

    def __init__(self) -> None:
        from mahout.runners.llama import GrammarSampler
        from scorer.llama import Grammar

        self.on, self.steps, self.whole, self.seconds = False, 0, 0, 0.0
        allowed, step = Grammar.allowed, GrammarSampler.__call__

        def counted_allowed(grammar, ids):  # type: ignore[no-untyped-def]
            self.whole += self.on and len(ids) == len(grammar._all)
            return allowed(grammar, ids)

        def counted_step(sampler, input_ids, scores):  # type: ignore[no-untyped-def]
            self.steps += self.on
            return step(sampler, input_ids, scores)

        Grammar.allowed, GrammarSampler.__call__ = counted_allowed, counted_step


def job(
    ask: str,
    *,
    temperature: float,
    top_p: float,
    seed: int,
    max_tokens: int,
    response_format: dict | None = None,
    logprobs: int | None = None,
    continuation: bool = False,
    delivered: str = "",
    delivered_tokens: int = 0,
) -> dict:
    from protocol.jobs import job_payload_build
    from testkit.formats import GEMMA

    params = {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "stop": None,
        "seed": seed,
        "response_format": response_format,
        "logprobs": logprobs,
    }
    return dict(
        job_payload_build(
            job_id=seed,
            model="gemma-3-270m",
            kind="chat",
            messages=[{"role": "user", "content": ask}],
            prompt=None,
            inputs=None,
            params=params,
            fmt=GEMMA,
            continuation=continuation,
            delivered=delivered,
            delivered_tokens=delivered_tokens,
        )
    )


def answer(runner, asked: dict) -> tuple[dict, list[dict], float]:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    pieces = list(runner.stream(asked))
    seconds = time.perf_counter() - started
    entries = [entry for piece in pieces for entry in getattr(piece, "logprobs", [])]
    reported = {
        "token_ids": list(runner.token_ids),
        "text": "".join(pieces),
        "finish_reason": runner.finish_reason,
        "seed": runner.seed,
    }
    return reported, entries, seconds


def audited(verifier, asked: dict, reported: dict, **extra: Any) -> tuple[Any, float]:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    result = verifier.audit(asked, **reported, **extra)
    return result, time.perf_counter() - started


def matcher_cost(runner, reported: dict, asked: dict) -> dict:  # type: ignore[no-untyped-def]
    """(a): every token, and the 1,024 likeliest, asked about at each state of an answer."""
    import numpy as np

    from scorer.llama import Grammar, grammar_for

    grammar = Grammar(runner._llm, grammar_for(asked["params"]["response_format"]))
    every, some = [], []
    ids = np.arange(runner._llm.n_vocab())
    try:
        for token in reported["token_ids"]:
            started = time.perf_counter()
            grammar.allowed(ids)
            every.append(time.perf_counter() - started)
            started = time.perf_counter()
            grammar.allowed(ids[:1024])
            some.append(time.perf_counter() - started)
            grammar.accept(token)
    finally:
        grammar.close()
    return {
        "every_token_ms": round(statistics.median(every) * 1000, 2),
        "likeliest_1024_ms": round(statistics.median(some) * 1000, 3),
        "states": len(every),
    }


def structured(runner, verifier, counted: Counted, args: argparse.Namespace) -> dict:  # type: ignore[no-untyped-def]
    """(b)"""
    rows = {}
    for temperature, top_p in SETTINGS:
        grammar_s = free_s = grammar_tokens = free_tokens = audit_s = free_audit_s = 0.0
        row = {
            "failed": 0,
            "misses": 0,
            "uncertain": 0,
            "checked": 0,
            "caught": {"wrong seed": 0, "greedy": 0, "free text": 0},
            "cheated": {"wrong seed": 0, "greedy": 0, "free text": 0},
        }
        steps = whole = 0
        for index in range(args.jobs):
            response_format = FORMATS[index % len(FORMATS)]
            asked = job(
                ASKS[index % len(ASKS)],
                temperature=temperature,
                top_p=top_p,
                seed=100 + index,
                max_tokens=args.max_tokens,
                response_format=response_format,
            )
            free_job = {**asked, "params": {**asked["params"], "response_format": None}}
            free, _, seconds = answer(runner, free_job)
            free_s, free_tokens = free_s + seconds, free_tokens + len(free["token_ids"])
            free_audit_s += audited(verifier, free_job, free)[1]
            counted.on, counted.steps, counted.whole = True, 0, 0
            honest, _, seconds = answer(runner, asked)
            counted.on = False
            steps, whole = steps + counted.steps, whole + counted.whole
            grammar_s, grammar_tokens = grammar_s + seconds, grammar_tokens + len(honest["token_ids"])
            result, spent = audited(verifier, asked, honest)
            audit_s += spent
            row["failed"] += not result.passed
            row["misses"] += len(result.misses)
            row["uncertain"] += result.uncertain
            row["checked"] += result.checked
            cheats = {"free text": {**free, "seed": honest["seed"]}}
            if temperature > 0:  # (greedy answers do not depend on the seed)
                greedy, _, _ = answer(runner, {**asked, "params": {**asked["params"], "temperature": 0.0}})
                cheats.update(
                    {"wrong seed": {**honest, "seed": honest["seed"] + 1}, "greedy": {**greedy, "seed": honest["seed"]}}
                )
            for name, cheat in cheats.items():
                if name != "wrong seed" and cheat["token_ids"] == honest["token_ids"]:
                    continue  # (the greedy answer is the honest one: nothing to catch)
                row["cheated"][name] += 1
                row["caught"][name] += not verifier.audit(asked, **cheat).passed
        row.update(
            {
                "decode_grammar_over_free": round((grammar_s / grammar_tokens) / (free_s / free_tokens), 2),
                "ms_per_token_grammar": round(grammar_s / grammar_tokens * 1000, 1),
                "ms_per_token_free": round(free_s / free_tokens * 1000, 1),
                "draws_asking_every_token": f"{whole} of {steps}",
                "audit_over_generation": round(audit_s / grammar_s, 2),
                "free_text_audit_over_generation": round(free_audit_s / free_s, 2),
                "audit_ms_per_token_grammar": round(audit_s / grammar_tokens * 1000, 1),
                "audit_ms_per_token_free": round(free_audit_s / free_tokens * 1000, 1),
            }
        )
        rows[f"T {temperature} top_p {top_p}"] = row
    return rows


def continuations(runner, verifier, args: argparse.Namespace) -> dict:  # type: ignore[no-untyped-def]
    """(c)"""
    from scorer.llama import count_tokens

    row = {"jobs": 0, "failed": 0, "checked": 0, "misses": 0, "other seed caught": 0, "audit_over_generation": 0.0}
    generation = audit_s = 0.0
    for index in range(args.jobs):
        first, _, _ = answer(
            runner,
            job(
                STORIES[index % len(STORIES)], temperature=0.9, top_p=1.0, seed=200 + index, max_tokens=args.max_tokens
            ),
        )
        cut = first["text"][: len(first["text"]) // 2].rstrip()[:-1]  # mid-word, most of the time
        asked = job(
            STORIES[index % len(STORIES)],
            temperature=0.9,
            top_p=1.0,
            seed=300 + index,
            max_tokens=args.max_tokens,
            continuation=True,
            delivered=cut,
            delivered_tokens=count_tokens(runner._llm, cut),
        )
        honest, _, seconds = answer(runner, asked)
        result, spent = audited(verifier, asked, honest)
        generation, audit_s = generation + seconds, audit_s + spent
        row["jobs"] += 1
        row["failed"] += not result.passed
        row["checked"] += result.checked
        row["misses"] += len(result.misses)
        row["other seed caught"] += not verifier.audit(asked, **{**honest, "seed": honest["seed"] + 1}).passed
    row["audit_over_generation"] = round(audit_s / generation, 2)
    return row


def logprobs(runner, verifier, args: argparse.Namespace) -> dict:  # type: ignore[no-untyped-def]
    """(d): the gaps of honest entries recorded as the verifier computes them."""
    from scorer import verify

    gaps: list[float] = []
    recording = [False]
    original = verify._logprob_gap

    def recorded(logits, entry, token):  # type: ignore[no-untyped-def]
        gap = original(logits, entry, token)
        if recording[0]:
            gaps.append(gap)
        return gap

    verify._logprob_gap = recorded
    failed = caught = 0
    try:
        for index in range(args.jobs):
            asked = job(
                STORIES[index % len(STORIES)],
                temperature=[0.0, 0.8, 1.2][index % 3],
                top_p=1.0,
                seed=400 + index,
                max_tokens=args.max_tokens,
                logprobs=3,
            )
            honest, entries, _ = answer(runner, asked)
            recording[0] = True
            failed += not verifier.audit(asked, **honest, logprobs=entries).passed
            recording[0] = False
            invented = [{**entry, "logprob": -0.05} for entry in entries]
            caught += not verifier.audit(asked, **honest, logprobs=invented).passed
    finally:
        verify._logprob_gap = original
    return {
        "jobs": args.jobs,
        "honest failed": failed,
        "invented caught": caught,
        "entries": len(gaps),
        "largest honest gap": round(max(gaps), 4),
        "median honest gap": round(statistics.median(gaps), 5),
        "tolerance": verify.LOGPROB_TOLERANCE,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=6, help="answers per setting")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--verifier-threads", type=int, default=1, help="the host runs on 1")
    args = parser.parse_args()
    from engine.gguf_loader import default_model_path
    from mahout.runners.llama import LlamaRunner
    from scorer.verify import Verifier

    path = default_model_path()
    counted = Counted()
    runner = LlamaRunner(path, threads=1, n_ctx=1024)
    with Verifier(path, threads=args.verifier_threads, n_ctx=1024) as verifier:
        _ = verifier.vocab  # built once (about 3 s), not charged to the first continuation's audit
        first = job(ASKS[0], temperature=0.7, top_p=1.0, seed=1, max_tokens=args.max_tokens, response_format=FORMATS[0])
        result: dict[str, Any] = {"matcher": matcher_cost(runner, answer(runner, first)[0], first)}
        result["structured"] = structured(runner, verifier, counted, args)
        result["continuations"] = continuations(runner, verifier, args)
        result["logprobs"] = logprobs(runner, verifier, args)
    runner.close()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
