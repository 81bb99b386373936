"""Audits of constrained answers on the real model: structured output (the grammar replayed),
continuations (what the host fed rebuilt, its healing replayed) and reported log-probabilities.
The shipped Gemma 3 270M generates with LlamaRunner on one thread; a Verifier on two threads
checks; honest answers pass and each cheat fails. Jobs are built as the gateway builds them
(`protocol.jobs.job_payload_build`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mahout.runners.llama import LlamaRunner
from protocol.jobs import job_payload_build
from scorer.healing import healing
from scorer.llama import count_tokens
from scorer.verify import Verifier
from testkit.formats import GEMMA

PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age"],
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
}
SCHEMA = {"type": "json_schema", "name": "person", "schema": PERSON}
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def runner(model_path: Path) -> Iterator[LlamaRunner]:
    runner = LlamaRunner(model_path, threads=1, n_ctx=1024)
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def verifier(model_path: Path) -> Iterator[Verifier]:
    with Verifier(model_path, threads=2, n_ctx=1024) as verifier:
        yield verifier


def job(
    ask: str,
    *,
    temperature: float,
    top_p: float = 1.0,
    seed: int = 7,
    response_format: dict | None = None,
    logprobs: int | None = None,
    delivered: str = "",
    delivered_tokens: int = 0,
    max_tokens: int = MAX_TOKENS,
) -> dict:
    """A chat job as the gateway sends it: a continuation of `delivered` when there is some."""
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
            job_id=1,
            model="gemma-3-270m",
            kind="chat",
            messages=[{"role": "user", "content": ask}],
            prompt=None,
            inputs=None,
            params=params,
            fmt=GEMMA,
            continuation=bool(delivered),
            delivered=delivered,
            delivered_tokens=delivered_tokens,
        )
    )


def answer(runner: LlamaRunner, asked: dict) -> tuple[dict, list[dict]]:
    """What the host reports (its tokens, text, finish reason, seed) and its log-probability entries."""
    pieces = list(runner.stream(asked))
    reported = {
        "token_ids": list(runner.token_ids),
        "text": "".join(pieces),
        "finish_reason": runner.finish_reason,
        "seed": runner.seed,
    }
    return reported, [entry for piece in pieces for entry in getattr(piece, "logprobs", [])]


@pytest.fixture(scope="module")
def structured(runner: LlamaRunner) -> tuple[dict, dict]:
    """A sampled job under a JSON schema and its honest answer."""
    asked = job("Describe a person as JSON.", temperature=0.7, seed=21, response_format=SCHEMA)
    return asked, answer(runner, asked)[0]


class StructuredOutputAuditTests:
    def test_an_honest_answer_under_a_json_schema_passes(self, verifier, structured):
        asked, honest = structured
        assert honest["text"].lstrip().startswith("{")
        audit = verifier.audit(asked, **honest)
        assert audit.passed and not audit.misses, audit
        assert audit.checked == len(honest["token_ids"]) and audit.matched + audit.uncertain == audit.checked

    def test_an_honest_answer_under_json_object_and_top_p_passes(self, runner, verifier):
        asked = job(
            "Give me a JSON record of a pet.",
            temperature=1.0,
            top_p=0.9,
            seed=3,
            response_format={"type": "json_object"},
        )
        audit = verifier.audit(asked, **answer(runner, asked)[0])
        assert audit.passed and not audit.misses, audit

    def test_the_honest_tokens_with_another_seed_fail(self, verifier, structured):
        asked, honest = structured
        audit = verifier.audit(asked, **{**honest, "seed": honest["seed"] + 1})
        assert not audit.passed and audit.misses and "not what the seeded draw selects" in audit.reason

    def test_a_daemonic_process_builds_the_grammar_without_the_fence(self, verifier, structured, monkeypatch):
        """A Celery prefork worker is daemonic: multiprocessing refuses it the fence's child."""
        import multiprocessing

        from scorer import llama

        monkeypatch.setattr(llama._FENCE, "convert", lambda *_args, **_kwargs: pytest.fail("the fence was asked"))
        monkeypatch.setattr(multiprocessing.current_process(), "daemon", True)
        asked, honest = structured
        assert verifier.audit(asked, **honest).passed

    def test_an_answer_that_ignores_the_grammar_fails_at_its_first_forbidden_token(self, runner, verifier, structured):
        asked, honest = structured
        free, _ = answer(
            runner, {**asked, "params": {**asked["params"], "response_format": None}}
        )  # the model's own prose
        audit = verifier.audit(asked, **{**free, "seed": honest["seed"]})
        assert not audit.passed and "grammar forbids" in audit.reason, audit
        index, token, margin = audit.misses[0]
        assert margin == float("inf") and free["token_ids"][index] == token

    def test_an_end_of_generation_before_the_json_is_whole_fails(self, runner, verifier, structured):
        asked, honest = structured
        cut = honest["token_ids"][:4] + [runner._llm.token_eos()]
        text = runner._llm.detokenize(cut[:-1]).decode()
        audit = verifier.audit(asked, token_ids=cut, text=text, finish_reason="stop", seed=honest["seed"])
        assert not audit.passed and audit.reason.startswith("token 4 ") and "grammar forbids" in audit.reason

    def test_a_forbidden_token_past_the_last_token_drawn_still_fails(self, runner, verifier, structured, monkeypatch):
        """A sampled audit prefills only up to its last drawn token; the grammar still reads the rest."""
        import scorer.verify

        class FirstTokens:  # the draw, made predictable: the first tokens
            def sample(self, population: list[int], k: int) -> list[int]:
                return population[:k]

        monkeypatch.setattr(scorer.verify.random, "SystemRandom", FirstTokens)
        asked, honest = structured
        cut = honest["token_ids"][:4] + [runner._llm.token_eos()]
        text = runner._llm.detokenize(cut[:-1]).decode()
        audit = verifier.audit(asked, token_ids=cut, text=text, finish_reason="stop", seed=honest["seed"], sample=1)
        assert (
            audit.checked == 1
            and not audit.passed
            and audit.reason.startswith("token 4 ")
            and "grammar forbids" in audit.reason
        )
        sampled = verifier.audit(asked, **honest, sample=2)
        assert sampled.passed and sampled.checked == 2, sampled


@pytest.fixture(scope="module")
def continued(runner: LlamaRunner) -> tuple[dict, dict]:
    """A sampled chat answer cut mid-word, continued by another attempt as the gateway sends it."""
    first, _ = answer(runner, job("Write a short story about a fox.", temperature=0.9, seed=5, max_tokens=32))
    delivered = first["text"][: len(first["text"]) // 2].rstrip()[:-1]
    asked = job(
        "Write a short story about a fox.",
        temperature=0.9,
        seed=6,
        delivered=delivered,
        delivered_tokens=count_tokens(runner._llm, delivered),
        max_tokens=24,
    )
    return asked, answer(runner, asked)[0]


class ContinuationAuditTests:
    def test_an_honest_continuation_passes_with_its_new_tokens_checked(self, verifier, continued):
        asked, honest = continued
        assert asked["continuation"] and asked["messages"][-1]["role"] == "assistant"
        audit = verifier.audit(asked, **honest)
        assert audit.passed and not audit.misses, audit
        assert 0 < audit.checked <= len(honest["token_ids"]) and audit.matched + audit.uncertain == audit.checked

    def test_the_honest_tokens_with_another_seed_fail(self, verifier, continued):
        asked, honest = continued
        audit = verifier.audit(asked, **{**honest, "seed": honest["seed"] + 1})
        assert not audit.passed and audit.misses

    def test_a_junk_continuation_that_writes_the_cut_word_again_fails(self, runner, verifier, continued):
        asked, honest = continued
        _, healer = healing(asked, verifier._prompt.tokens(asked), verifier.vocab)
        rewritten = healer.dropped if healer else b""
        junk_text = " lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor"
        junk = runner._llm.tokenize(rewritten + junk_text.encode(), add_bos=False)[: asked["params"]["max_tokens"]]
        text = runner._llm.detokenize(junk)[len(rewritten) :].decode()
        audit = verifier.audit(
            asked, token_ids=[*junk, runner._llm.token_eos()], text=text, finish_reason="stop", seed=honest["seed"]
        )
        # (how many of its tokens miss depends on the CPU's drift: half of 10 on an AVX-512 Xeon)
        assert not audit.passed and "seeded draw" in audit.reason and len(audit.misses) >= audit.checked // 3, audit

    def test_a_continuation_that_does_not_write_the_cut_word_again_fails(self, runner, verifier, continued):
        asked, honest = continued
        _, healer = healing(asked, verifier._prompt.tokens(asked), verifier.vocab)
        rewritten = healer.dropped if healer else b""
        assert rewritten, "the delivered text ends mid-word: the continuation must write its last token again"
        text = (
            "And then the fox slept." if rewritten.startswith(b" ") else " And then the fox slept."
        )  # (never the cut word's start)
        tokens = runner._llm.tokenize(text.encode(), add_bos=False)
        audit = verifier.audit(asked, token_ids=tokens, text=text, finish_reason="length", seed=honest["seed"])
        assert audit.reason == "the token ids do not write again the text the job resumes"

    def test_an_honest_continuation_under_a_grammar_passes_and_its_rewritten_start_is_not_checked(
        self, runner, verifier, structured
    ):
        asked, honest = structured
        delivered = honest["text"][: len(honest["text"]) // 2]
        again = job(
            "Describe a person as JSON.",
            temperature=0.7,
            seed=8,
            response_format=SCHEMA,
            delivered=delivered,
            delivered_tokens=count_tokens(runner._llm, delivered),
        )
        assert again["rewrite"] == delivered
        reported, _ = answer(runner, again)
        audit = verifier.audit(again, **reported)
        assert audit.passed and not audit.misses, audit
        assert audit.checked < len(reported["token_ids"])


@pytest.fixture(scope="module")
def with_logprobs(runner: LlamaRunner) -> tuple[dict, dict, list[dict]]:
    asked = job("Name three rivers.", temperature=0.9, seed=13, logprobs=3)
    reported, entries = answer(runner, asked)
    return asked, reported, entries


class LogprobAuditTests:
    def test_honest_log_probabilities_pass(self, verifier, with_logprobs):
        asked, reported, entries = with_logprobs
        assert entries and len(entries[0]["top_logprobs"]) == 3
        assert verifier.audit(asked, **reported, logprobs=entries).passed

    def test_invented_log_probabilities_fail_with_the_token_and_gap(self, verifier, with_logprobs):
        asked, reported, entries = with_logprobs
        invented = [
            {**entry, "top_logprobs": [{**top, "logprob": -0.01} for top in entry["top_logprobs"]]} for entry in entries
        ]
        audit = verifier.audit(asked, **reported, logprobs=invented)
        assert not audit.passed and not audit.misses
        assert audit.reason.startswith(
            f"{len(entries)} reported log-probabilities are not the model's (the first at token 0, off by"
        )

    def test_an_entry_that_is_not_numbers_fails(self, verifier, with_logprobs):
        asked, reported, entries = with_logprobs
        audit = verifier.audit(asked, **reported, logprobs=[{**entries[0], "logprob": "high"}, *entries[1:]])
        assert not audit.passed and "off by inf" in audit.reason

    def test_entries_are_not_compared_when_the_job_did_not_ask_for_them(self, verifier, with_logprobs):
        asked, reported, entries = with_logprobs
        plain = {**asked, "params": {**asked["params"], "logprobs": None}}
        assert verifier.audit(plain, **reported, logprobs=[{**entry, "logprob": -50.0} for entry in entries]).passed
