"""Audits on the real model: the shipped Gemma 3 270M generates with LlamaRunner on one thread,
and a Verifier on two threads (one prefill pass against the host's one-token decode) checks
the answers; honest ones pass, each cheat fails."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from mahout.runners.llama import LlamaRunner
from scorer.verify import Unauditable, Verifier, auditable
from testkit.formats import rendered

MAX_TOKENS = 48


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
    kind: str,
    text: str,
    *,
    temperature: float,
    top_p: float = 1.0,
    seed: int | None = 7,
    stop: list[str] | None = None,
    max_tokens: int = MAX_TOKENS,
) -> dict:
    chat = kind == "chat"
    return rendered(
        {
            "id": "job-1",
            "model": "gemma-3-270m",
            "kind": kind,
            "prompt": None if chat else text,
            "messages": [{"role": "user", "content": text}] if chat else None,
            "params": {
                "max_tokens": max_tokens,
                "temperature": temperature,
                "top_p": top_p,
                "stop": stop,
                "seed": seed,
            },
        }
    )


def answer(runner: LlamaRunner, job: dict) -> dict:
    text = "".join(runner.stream(job))
    return {
        "token_ids": list(runner.token_ids),
        "text": text,
        "finish_reason": runner.finish_reason,
        "seed": runner.seed,
    }


class HonestAnswerTests:
    @pytest.mark.parametrize(
        ("kind", "text", "temperature", "top_p"),
        [
            ("chat", "Write a haiku about elephants.", 0.7, 1.0),
            ("completion", "The history of Rome begins", 0.7, 0.9),
            ("chat", "What is the capital of France?", 1.2, 1.0),
            ("completion", "Dear Sir or Madam,\n\nI am writing to", 1.2, 0.9),
            ("completion", "The history of Rome begins", 0.0, 1.0),
        ],
    )
    def test_it_passes_with_no_miss(self, runner, verifier, kind, text, temperature, top_p):
        honest = job(kind, text, temperature=temperature, top_p=top_p, seed=int(temperature * 100 + top_p * 10))
        audit = verifier.audit(honest, **answer(runner, honest))
        assert audit.passed and not audit.misses, audit
        assert audit.checked == len(runner.token_ids) > 0 and audit.matched + audit.uncertain == audit.checked

    def test_a_job_without_a_seed_is_sampled_with_one_the_host_reports(self, runner, verifier):
        honest = job("chat", "Tell me a joke about cats.", temperature=1.0, seed=None)
        reported = answer(runner, honest)
        assert isinstance(reported["seed"], int) and 0 <= reported["seed"] < 2**63
        assert verifier.audit(honest, **reported).passed

    def test_an_answer_cut_at_a_stop_string_passes(self, runner, verifier):
        runner._llm.reset()  # both from a cold cache: the same arithmetic, so the same greedy answer
        free = answer(runner, job("completion", "Once upon a time", temperature=0.0))
        stop = free["text"][len(free["text"]) // 2 :][:4]
        stopped = job("completion", "Once upon a time", temperature=0.0, stop=[stop])
        runner._llm.reset()
        reported = answer(runner, stopped)
        assert reported["finish_reason"] == "stop" and reported["text"] == free["text"][: free["text"].index(stop)]
        assert verifier.audit(stopped, **reported).passed

    def test_a_sample_of_the_tokens_checks_only_that_many(self, runner, verifier):
        honest = job("completion", "The elephant is", temperature=0.7)
        audit = verifier.audit(honest, **answer(runner, honest), sample=5)
        assert audit.passed and audit.checked == 5


@pytest.fixture(scope="module")
def sampled(runner: LlamaRunner) -> tuple[dict, dict]:
    """A sampled job and its honest answer."""
    asked = job("chat", "Explain photosynthesis to a child.", temperature=1.0, seed=99)
    return asked, answer(runner, asked)


class CheatTests:
    """Each cheat is caught on every answer here (bench/trust.py counts how often in general)."""

    def test_junk_tokens_fail(self, runner, verifier, sampled):
        asked, _ = sampled
        words = (
            "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor incididunt ut labore".split()
        )
        rng = random.Random(3)
        junk = runner._llm.tokenize(" ".join(rng.choice(words) for _ in range(MAX_TOKENS)).encode(), add_bos=False)[
            :MAX_TOKENS
        ]
        audit = verifier.audit(
            asked, token_ids=junk, text=runner._llm.detokenize(junk).decode(), finish_reason="length", seed=99
        )
        assert not audit.passed and len(audit.misses) > MAX_TOKENS // 2

    def test_a_greedy_answer_to_a_sampled_job_fails(self, runner, verifier, sampled):
        asked, _ = sampled
        greedy = answer(runner, {**asked, "params": {**asked["params"], "temperature": 0.0}})
        audit = verifier.audit(asked, **greedy)
        assert not audit.passed and audit.misses

    def test_the_honest_tokens_with_another_seed_fail(self, runner, verifier, sampled):
        asked, honest = sampled
        audit = verifier.audit(asked, **{**honest, "seed": honest["seed"] + 1})
        assert not audit.passed and audit.misses

    def test_a_truncated_answer_claiming_stop_fails(self, runner, verifier, sampled):
        asked, honest = sampled
        half = honest["token_ids"][: len(honest["token_ids"]) // 2]
        text = runner._llm.detokenize(half).decode("utf-8", errors="ignore")
        audit = verifier.audit(asked, token_ids=half, text=text, finish_reason="stop", seed=honest["seed"])
        assert not audit.passed and "cut short" in (audit.reason or "")

    def test_tokens_that_do_not_spell_the_delivered_text_fail(self, runner, verifier, sampled):
        asked, honest = sampled
        audit = verifier.audit(asked, **{**honest, "text": "Something else entirely."})
        assert audit.reason == "the token ids do not spell the delivered text"

    def test_a_byte_that_is_not_utf8_is_read_as_the_stream_dropped_it(self, runner, verifier, sampled):
        """At a high temperature an honest host can draw a lone byte token that is no UTF-8;
        its stream drops it (llama.cpp decodes with errors="ignore"), so the delivered text
        lacks it. That is not a spelling failure: the token is judged by its draw like any."""
        from scorer.verify import _as_streamed

        assert _as_streamed(" \U0001d453".encode() + b"\x8e gx") == " \U0001d453 gx".encode()
        assert (
            _as_streamed(b"ab\xe2\x86") == b"ab\xe2\x86"
        )  # an unfinished character at the end is held back, not dropped
        assert _as_streamed(b"\xe2 x\x8e\xe2\x86\x92") == " x\u2192".encode()
        asked, honest = sampled
        lone, ids, ended = verifier.vocab.pieces.index(b"\x8e"), honest["token_ids"], honest["finish_reason"] == "stop"
        tokens = [*ids[:5], lone, *(ids[5:] if ended else ids[5:-1])]  # the byte drawn 6th; "length" keeps its length
        text = runner._llm.detokenize(tokens[:-1] if ended else tokens).decode("utf-8", errors="ignore")
        assert "\ufffd" not in text and len(text.encode()) < len(runner._llm.detokenize(tokens))
        audit = verifier.audit(
            asked, token_ids=tokens, text=text, finish_reason=honest["finish_reason"], seed=honest["seed"]
        )
        assert audit.reason is not None and "not what the seeded draw selects" in audit.reason
        assert audit.misses and audit.misses[0][:2] == (5, lone)

    def test_after_a_byte_that_is_not_utf8_llamas_stream_drops_what_it_drops(self, runner, verifier):
        """After a byte that is no UTF-8, llama-cpp-python's stream yields nothing more until
        the end, then decodes each pending token alone: a character split over two of them is
        dropped whole (an honest host's answer at T 1.5 failed its audit so, job 278 of
        `bench/trust.py --honest`). The verifier's replay is checked against that stream itself,
        made to write chosen tokens by a logits processor."""
        import numpy as np

        from scorer.verify import _as_streamed, _llama_streamed

        pieces = verifier.vocab.pieces
        chosen = [
            pieces.index(b"to"),
            pieces.index(b"\xee"),
            pieces.index(b"\x86"),
            pieces.index(b"ollow"),
            pieces.index(b" ha"),
            pieces.index(b"\xef"),
            pieces.index(b"\x80"),
            pieces.index(b"\xb0"),
            pieces.index(b"x"),
        ]
        written = b"".join(pieces[t] for t in chosen)
        assert (
            _as_streamed(written) == "toollow ha\uf030x".encode()
        )  # an incremental decoder keeps the private-use character
        at = iter(chosen)

        def forced(_ids, scores):  # noqa: ANN001, ANN202
            out = np.full_like(scores, -np.inf)
            out[next(at, runner._llm.token_eos())] = 0.0
            return out

        from llama_cpp import LogitsProcessorList

        prompt = runner._llm.tokenize(b"Once upon a time", add_bos=True)
        runner._llm.reset()
        streamed = "".join(
            chunk["choices"][0]["text"]
            for chunk in runner._llm.create_completion(
                prompt=prompt,
                max_tokens=len(chosen),
                stream=True,
                temperature=0.0,
                logits_processor=LogitsProcessorList([forced]),
            )
        )
        runner._llm.reset()
        assert streamed.encode() == _llama_streamed([pieces[t] for t in chosen]) == b"toollow hax"

    def test_a_character_split_over_the_budget_is_finished_as_llamas_stream_finishes_it(self):
        """llama.cpp's stream does not stop for max_tokens while the text ends in what looks
        like an unfinished character (an honest host reported 49 tokens for max_tokens 48 at
        T 1.5); the verifier allows exactly what that rule generates, not a token more."""
        from scorer.verify import _length_end

        def spelled(*tail: bytes):  # noqa: ANN202
            pieces = [b"a"] * 47 + list(tail)
            return lambda tokens: b"".join(pieces[t] for t in tokens)

        assert _length_end(spelled(b"b", b"c"), list(range(49)), 48) == 48  # nothing split: the budget
        assert _length_end(spelled(b"\xf0\x9d", b"\x91\x93", b"b", b"c"), list(range(51)), 48) == 50
        assert _length_end(spelled(b"\xe2", b"\x86\x92", b"z", b"y"), list(range(51)), 48) == 50
        assert _length_end(spelled(b"b"), list(range(48)), 48) == 48

    def test_length_claimed_early_fails(self, runner, verifier, sampled):
        asked, honest = sampled
        half = [t for t in honest["token_ids"] if t != runner._llm.token_eos()][: MAX_TOKENS // 2]
        audit = verifier.audit(
            asked,
            token_ids=half,
            text=runner._llm.detokenize(half).decode("utf-8", errors="ignore"),
            finish_reason="length",
            seed=honest["seed"],
        )
        assert audit.reason and audit.reason.startswith("'length' after")

    def test_a_token_outside_the_vocabulary_fails(self, runner, verifier, sampled):
        asked, honest = sampled
        audit = verifier.audit(asked, **{**honest, "token_ids": [*honest["token_ids"][:3], 10**9]})
        assert audit.reason == "a reported token id is not in the model's vocabulary"


class AuditableTests:
    def test_every_chat_and_completion_job_is_audited(self, verifier):
        plain = job("chat", "Hello!", temperature=1.0)
        structured = {**plain, "params": {**plain["params"], "response_format": {"type": "json_object"}}}
        prefilled = rendered(
            {**plain, "messages": [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "One, tw"}]}
        )
        for audited in (
            plain,
            job("completion", "Hi", temperature=0.0),
            structured,
            {**plain, "continuation": True},
            prefilled,
        ):
            assert auditable(audited)
        embeddings = {"id": 1, "model": "gemma-3-270m", "kind": "embeddings", "input": ["Hi"], "continuation": False}
        assert not auditable(embeddings)
        with pytest.raises(Unauditable):
            verifier.audit(embeddings, token_ids=[1], text="", finish_reason="stop", seed=1)

    def test_a_grammar_this_machine_cannot_build_is_unauditable(self, verifier):
        plain = job("chat", "Hello!", temperature=1.0)
        unbuildable = {
            **plain,
            "params": {
                **plain["params"],
                "response_format": {
                    "type": "json_schema",
                    "name": "x",
                    "schema": {"type": "string", "maxLength": 10**6},
                },
            },
        }
        with pytest.raises(Unauditable, match="grammar cannot be built here"):
            verifier.audit(unbuildable, token_ids=[1], text="", finish_reason="stop", seed=1)


class SecondLookTests:
    def test_a_miss_of_the_batched_replay_is_looked_at_again_as_the_host_decoded(self, runner, verifier, monkeypatch):
        """Some CPUs' batched kernels move logits by about one (see `Verifier._second_look`): the
        replay's miss of an honest token is simulated, and the one-token decode clears it."""
        honest = job("chat", "Name three rivers.", temperature=1.0, seed=5)
        reported = answer(runner, honest)
        replay = Verifier._replay

        def drifted(self, prompt, answer, checked, far):
            audit = replay(self, prompt, answer, checked, far)
            for index in (0, 3, len(answer.tokens) - 1):  # as if the batch had moved these tokens' logits
                if all(index != missed for missed, _, _ in audit.misses):
                    audit.misses.append((index, answer.tokens[index], 0.2))
                    audit.matched -= 1  # (counted as matched or uncertain by the replay)
            return audit

        monkeypatch.setattr(Verifier, "_replay", drifted)
        audit = verifier.audit(honest, **reported)
        assert audit.passed and not audit.misses, audit
        assert audit.matched + audit.uncertain >= audit.checked - 3

    def test_a_cheats_misses_survive_the_second_look(self, runner, verifier, sampled):
        asked, honest = sampled
        other_seed = job("chat", "Explain photosynthesis to a child.", temperature=1.0, seed=12345)
        cheat = answer(runner, other_seed)
        audit = verifier.audit(asked, **{**cheat, "seed": 99})
        assert not audit.passed and audit.misses and "not what the seeded draw selects" in audit.reason
