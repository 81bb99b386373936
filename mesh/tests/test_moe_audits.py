"""An MoE coordinator's answers audited as any host's (issue 29): the coordinator draws every
token by the specified sampler from the engine's logits and streams the text as llama.cpp's
stream writes it, so the gateway's verifier (llama.cpp, one prefill pass over the same file)
passes its honest answers and fails a cheat's. On the tiny Qwen 3 MoE with its real
vocabulary: sampled answers, an answer cut at a stop string, junk and another seed's draws,
answers under a response_format's grammar (drawn as a single-machine host draws under one), and
answers to text they resume (healed as a host heals it: a cut word, a grammar continuation)."""

from __future__ import annotations

import json
import random
from collections.abc import Generator
from pathlib import Path

import pytest

from mahout.moe.runner import MoeRunner, MoeSlot
from protocol.rendering import ChatFormat, chat_fragments
from scorer.errors import RequestRejected
from scorer.verify import Verifier
from testkit.formats import file_format

N_CTX = 256


@pytest.fixture(scope="module")
def runner(qwen3moe_file: Path) -> Generator[MoeRunner, None, None]:
    found = MoeRunner(qwen3moe_file, n_slots=1, n_ctx=N_CTX)
    yield found
    found.close()


@pytest.fixture(scope="module")
def verifier(qwen3moe_file: Path) -> Generator[Verifier, None, None]:
    with Verifier(qwen3moe_file, threads=1, n_ctx=N_CTX) as found:
        yield found


@pytest.fixture(scope="module")
def fmt(qwen3moe_file: Path) -> ChatFormat:
    return file_format(qwen3moe_file, adds_bos=False)


def job(
    fmt: ChatFormat, ask: str, *, temperature: float, seed: int, stop: list[str] | None = None, max_tokens: int = 24
) -> dict:
    """A chat job as the gateway sends it to a host."""
    messages = [{"role": "user", "content": ask}]
    return {
        "kind": "chat",
        "messages": messages,
        "fragments": [list(f) for f in chat_fragments(fmt, messages)],
        "end_of_turn": list(fmt.end_of_turn),
        "continuation": False,
        "params": {"max_tokens": max_tokens, "temperature": temperature, "top_p": 1.0, "stop": stop, "seed": seed},
    }


def answer(slot: MoeSlot, asked: dict) -> dict:
    """What the coordinator reports: the text it streamed, its tokens, finish reason and seed."""
    text = "".join(slot.stream(asked))
    return {"token_ids": list(slot.token_ids), "text": text, "finish_reason": slot.finish_reason, "seed": slot.seed}


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, 1), (0.8, 2), (1.2, 3)])
def test_an_honest_coordinators_answer_passes_the_gateways_audit(runner, verifier, fmt, temperature, seed) -> None:  # noqa: ANN001
    asked = job(fmt, "Tell me about elephants.", temperature=temperature, seed=seed)
    reported = answer(runner.slot(), asked)
    assert len(reported["token_ids"]) > 4
    audit = verifier.audit(asked, **reported)
    assert audit.passed and not audit.misses and audit.checked == len(reported["token_ids"]), audit


def test_an_answer_cut_at_a_stop_string_ends_where_llama_cpp_ends_it_and_passes(runner, verifier, fmt) -> None:  # noqa: ANN001
    free = answer(runner.slot(), job(fmt, "Name some animals.", temperature=0.0, seed=4, max_tokens=32))
    stop = free["text"][len(free["text"]) // 2 :][:3]
    assert stop.strip(), free
    asked = job(fmt, "Name some animals.", temperature=0.0, seed=4, stop=[stop], max_tokens=32)
    cut = answer(runner.slot(), asked)
    assert cut["finish_reason"] == "stop" and cut["text"] == free["text"][: free["text"].index(stop)]
    assert len(cut["token_ids"]) < len(
        free["token_ids"]
    )  # the token that completed the stop string is the last reported
    assert verifier.audit(asked, **cut).passed


def test_junk_and_another_seeds_draws_fail(runner, verifier, fmt) -> None:  # noqa: ANN001
    asked = job(fmt, "Tell me about elephants.", temperature=0.8, seed=5)
    honest = answer(runner.slot(), asked)
    other = answer(runner.slot(), {**asked, "params": {**asked["params"], "seed": 6}})
    audit = verifier.audit(asked, **{**other, "seed": 5})
    assert not audit.passed and "seeded draw" in audit.reason, audit
    rng = random.Random(7)
    words = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor".split()
    junk = runner.tokenizer.encode(" ".join(rng.choice(words) for _ in range(24)))[1:25]
    audit = verifier.audit(asked, token_ids=junk, text=runner.tokenizer.decode(junk), finish_reason="length", seed=5)
    assert not audit.passed and len(audit.misses) >= len(junk) // 3, audit
    assert verifier.audit(asked, **honest).passed


SCHEMA = {
    "type": "json_schema",
    "schema": {
        "type": "object",
        "properties": {"animal": {"enum": ["elephant", "mouse"]}},
        "required": ["animal"],
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize(
    ("response_format", "temperature", "seed"), [(SCHEMA, 0.0, 8), (SCHEMA, 0.9, 9), ({"type": "json_object"}, 0.7, 10)]
)
def test_a_response_formats_grammar_is_followed_and_its_answer_passes_the_audit(
    runner, verifier, fmt, response_format, temperature, seed
) -> None:  # noqa: ANN001
    asked = job(fmt, "Which animal is the largest? Answer in JSON.", temperature=temperature, seed=seed, max_tokens=64)
    asked["params"]["response_format"] = response_format
    reported = answer(runner.slot(), asked)
    free = answer(runner.slot(), {**asked, "params": {**asked["params"], "response_format": None}})
    assert reported["text"].lstrip().startswith("{") and not free["text"].lstrip().startswith("{"), (reported, free)
    if response_format is SCHEMA:  # short enough to finish: the whole answer is the schema's
        assert reported["finish_reason"] == "stop" and json.loads(reported["text"])["animal"] in ("elephant", "mouse")
    audit = verifier.audit(asked, **reported)
    assert audit.passed and not audit.misses and audit.checked == len(reported["token_ids"]), audit


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, 11), (0.9, 15)])
def test_a_continuation_under_a_grammar_writes_the_delivered_text_again_and_passes_the_audit(
    runner, verifier, fmt, temperature, seed
) -> None:  # noqa: ANN001
    """As a single-machine host does (mahout 0.7.0): the delivered text (`rewrite`) is written
    again under the grammar and the healer's mask, not streamed, then the answer goes on; the
    verifier replays exactly that. Text no grammar of the schema allows is refused, never fed on."""
    asked = job(fmt, "Which animal is the largest? Answer in JSON.", temperature=temperature, seed=seed, max_tokens=64)
    asked["params"]["response_format"] = SCHEMA
    delivered = '{"animal": "ele'
    again = {**asked, "continuation": True, "rewrite": delivered}
    slot = runner.slot()
    reported = answer(slot, again)
    assert json.loads(delivered + reported["text"]) == {"animal": "elephant"}
    assert slot.completion_tokens == runner.tokenizer.count(
        reported["text"]
    )  # the new text's tokens, not the rewrite's
    audit = verifier.audit(again, **reported)
    assert audit.passed and not audit.misses and audit.checked > 0, audit
    with pytest.raises(RequestRejected):
        "".join(runner.slot().stream({**asked, "continuation": True, "rewrite": '{"plant": '}))


@pytest.mark.parametrize(("temperature", "seed", "logprobs"), [(0.0, 16, None), (0.8, 17, None), (1.1, 18, 2)])
def test_a_chat_ending_in_a_cut_word_is_healed_and_passes_the_audit(
    runner, verifier, fmt, temperature, seed, logprobs
) -> None:  # noqa: ANN001
    """A chat ending in an assistant turn mid-word (a failover continuation, or a customer's
    prefill): the coordinator drops the cut word's tokens and writes the word again under the
    healer's mask, as a host does, so its honest answer passes the verifier (before 0.7.0 it
    continued from the tokens as counted and was left unaudited)."""
    messages = [
        {"role": "user", "content": "Tell me about elephants."},
        {"role": "assistant", "content": "Elephants are the larg"},
    ]
    asked = {
        "kind": "chat",
        "messages": messages,
        "fragments": [list(f) for f in chat_fragments(fmt, messages)],
        "end_of_turn": list(fmt.end_of_turn),
        "continuation": True,
        "params": {
            "max_tokens": 24,
            "temperature": temperature,
            "top_p": 1.0,
            "stop": None,
            "seed": seed,
            "logprobs": logprobs,
        },
    }
    slot = runner.slot()
    pieces = list(slot.stream(asked))
    text = "".join(pieces)
    assert not text.startswith("larg") and not text.startswith("Elephants")
    entries = [entry for piece in pieces for entry in piece.logprobs] if logprobs else None
    audit = verifier.audit(
        asked,
        token_ids=list(slot.token_ids),
        text=text,
        finish_reason=slot.finish_reason,
        seed=slot.seed,
        logprobs=entries,
    )
    assert audit.passed and not audit.misses and audit.checked > 0, audit


@pytest.mark.parametrize(
    ("temperature", "seed", "response_format"), [(0.0, 12, None), (0.8, 13, None), (0.7, 14, SCHEMA)]
)
def test_log_probabilities_are_reported_per_token_and_pass_the_audits_comparison(
    runner, verifier, fmt, temperature, seed, response_format
) -> None:  # noqa: ANN001
    asked = job(fmt, "Tell me about elephants.", temperature=temperature, seed=seed, max_tokens=24)
    asked["params"].update(logprobs=3, response_format=response_format)
    slot = runner.slot()
    pieces = list(slot.stream(asked))
    entries = [entry for piece in pieces for entry in piece.logprobs]
    text = "".join(pieces)
    assert text and "".join(entry["token"] for entry in entries) == text  # the entries spell the text, piece by piece
    assert all("".join(e["token"] for e in piece.logprobs) == piece for piece in pieces)
    assert all(len(entry["top_logprobs"]) == 3 and entry["logprob"] <= 0 for entry in entries)
    assert entries[0]["logprob"] >= entries[0]["top_logprobs"][-1]["logprob"] or temperature > 0
    reported = {"token_ids": list(slot.token_ids), "text": text, "finish_reason": slot.finish_reason, "seed": slot.seed}
    assert reported == {
        **answer(runner.slot(), {**asked, "params": {**asked["params"], "logprobs": None}}),
        "text": text,
    }  # the same draws with or without them
    audit = verifier.audit(asked, **reported, logprobs=entries)
    assert audit.passed and not audit.misses, audit
    forged = [{**entry, "logprob": entry["logprob"] - 3.0} for entry in entries]
    assert not verifier.audit(asked, **reported, logprobs=forged).passed  # altered ones fail it
