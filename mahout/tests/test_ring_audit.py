"""A ring's answer is audited as any host's (issue 29): a two-stage ring of the shipped model
(the PyTorch engine, its output head shared by the head and the tail) draws every token by
the specified sampler with the job's seed, and the llama.cpp verifier (`scorer.verify`, what
the gateway's workers and trusted scorers run) passes its honest answers at temperature 0.7
and 1.2, top_p 1 and below (the tail's half of the logits goes to the head whole), with no
miss, and fails junk and an answer drawn with another seed."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from mahout.ring.local import ThreadRing, split_layers
from mahout.ring.membership import Limits
from scorer.llama import PromptTokenizer
from scorer.verify import Verifier
from testkit.formats import rendered

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def verifier(model_path: Path) -> Iterator[Verifier]:
    with Verifier(model_path, threads=2, n_ctx=512) as verifier:
        yield verifier


@pytest.fixture(scope="module")
def vocab(model_path: Path) -> object:
    """The model's vocabulary, as a ring host's runner reads it (`mahout.ring.runner.RingRunner`)."""
    from llama_cpp import Llama

    return Llama(model_path=str(model_path), vocab_only=True, verbose=False)


@pytest.fixture(scope="module")
def ring(model_path: Path) -> Iterator[ThreadRing]:
    with ThreadRing(
        model_path, split_layers(18, 2), limits=Limits(micro_batch=2, row_width=16), slots=2, n_ctx=256
    ) as ring:
        assert all(agent.stage.shares_output for agent in ring.agents)
        yield ring


def job(kind: str, text: str, *, temperature: float, seed: int, top_p: float = 1.0) -> dict:
    chat = kind == "chat"
    return rendered(
        {
            "id": "job-1",
            "model": "gemma-3-270m",
            "kind": kind,
            "prompt": None if chat else text,
            "messages": [{"role": "user", "content": text}] if chat else None,
            "params": {
                "max_tokens": MAX_TOKENS,
                "temperature": temperature,
                "top_p": top_p,
                "stop": None,
                "seed": seed,
            },
        }
    )


def ring_answer(ring: ThreadRing, vocab, payload: dict, *, seed: int) -> dict:  # noqa: ANN001
    """What a ring host reports: the tokens the ring drew up to a stop, and their text."""
    tokens = PromptTokenizer(vocab)
    stops = {vocab.token_eos(), *tokens.single_ids(payload.get("end_of_turn") or [])}
    drawn = ring.bridge.submit(
        tokens.tokens(payload),
        MAX_TOKENS,
        stop_ids=sorted(stops),
        temperature=payload["params"]["temperature"],
        top_p=payload["params"]["top_p"],
        seed=seed,
    ).result()
    ids = [t for t in drawn if t not in stops]  # (the end of generation, if any, is reported too: `RingRunner`)
    return {
        "token_ids": drawn,
        "text": vocab.detokenize(ids).decode("utf-8", errors="replace"),
        "finish_reason": "stop" if len(ids) < len(drawn) else "length",
        "seed": payload["params"]["seed"],
    }


@pytest.mark.parametrize(
    ("kind", "text", "temperature", "top_p"),
    [
        ("chat", "Write a haiku about elephants.", 0.7, 1.0),
        ("completion", "The history of Rome begins", 0.7, 1.0),
        ("completion", "Dear Sir or Madam,\n\nI am writing to", 1.2, 1.0),
        ("chat", "Write a haiku about elephants.", 1.2, 0.9),
        ("completion", "The history of Rome begins", 1.0, 0.5),
    ],
)
def test_an_honest_rings_sampled_answer_passes_with_no_miss(
    ring, vocab, verifier, kind, text, temperature, top_p
) -> None:  # noqa: ANN001
    payload = job(kind, text, temperature=temperature, seed=4242, top_p=top_p)
    audit = verifier.audit(payload, **ring_answer(ring, vocab, payload, seed=4242))
    assert audit.passed and not audit.misses, audit
    assert audit.checked > 0


def test_junk_or_another_seeds_draw_from_a_ring_fails(ring, vocab, verifier) -> None:  # noqa: ANN001
    payload = job("completion", "The history of Rome begins", temperature=0.7, seed=99)
    other = ring_answer(ring, vocab, payload, seed=100)  # the ring's honest arithmetic, but not the job's draw
    assert not verifier.audit(payload, **other).passed
    junk_ids = random.Random(1).sample(range(1000, 200_000), MAX_TOKENS)
    junk = {
        "token_ids": junk_ids,
        "text": vocab.detokenize(junk_ids).decode("utf-8", errors="replace"),
        "finish_reason": "length",
        "seed": 99,
    }
    audit = verifier.audit(payload, **junk)
    assert not audit.passed and len(audit.misses) > MAX_TOKENS // 2


def test_a_ring_drawing_top_p_at_1_fails_a_top_p_jobs_audit(ring, vocab, verifier) -> None:  # noqa: ANN001
    """What a ring before mahout 0.5.0 did (it served top_p < 1 as 1): its answers miss."""
    asked = job("completion", "Dear Sir or Madam,\n\nI am writing to", temperature=1.5, seed=77, top_p=0.3)
    served = ring_answer(
        ring, vocab, job("completion", "Dear Sir or Madam,\n\nI am writing to", temperature=1.5, seed=77), seed=77
    )
    assert served["token_ids"] != ring_answer(ring, vocab, asked, seed=77)["token_ids"]
    assert not verifier.audit(asked, **served).passed


@pytest.mark.parametrize(("temperature", "top_p"), [(0.0, 1.0), (0.9, 1.0), (1.2, 0.9)])
def test_a_rings_log_probabilities_pass_the_audit_and_spell_its_text(
    ring, model_path, verifier, temperature, top_p
) -> None:  # noqa: ANN001
    """The ring runner streams pieces with their tokens' log-probabilities (the tail's log-softmax
    over the whole vocabulary, gathered at the head: the output head is shared here), as a
    single-machine host does; the verifier compares them with its own prefill's and passes."""
    from mahout.ring.runner import RingRunner

    runner = RingRunner(ring.bridge, model_path, n_ctx=256)
    payload = job("chat", "Write a haiku about elephants.", temperature=temperature, seed=31, top_p=top_p)
    payload["params"]["logprobs"] = 2
    pieces = list(runner.stream(payload))
    entries = [entry for piece in pieces for entry in piece.logprobs]
    text = "".join(pieces)
    assert text and "".join(entry["token"] for entry in entries) == text
    assert len(entries) == len(runner.token_ids) and all(len(entry["top_logprobs"]) == 2 for entry in entries)
    assert all(entry["logprob"] <= entry["top_logprobs"][0]["logprob"] + 1e-6 for entry in entries)
    answer = {"token_ids": runner.token_ids, "text": text, "finish_reason": runner.finish_reason, "seed": 31}
    audit = verifier.audit(payload, **answer, logprobs=entries)
    assert audit.passed and not audit.misses, audit
    forged = [{**entry, "logprob": entry["logprob"] - 3.0} for entry in entries]  # numbers the model did not compute
    assert not verifier.audit(payload, **answer, logprobs=forged).passed


SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "animal",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"animal": {"type": "string"}, "legs": {"type": "integer"}},
            "required": ["animal", "legs"],
            "additionalProperties": False,
        },
    },
}


def structured(response_format: dict, *, temperature: float, seed: int) -> dict:
    payload = job("chat", "Name an animal and its number of legs, as JSON.", temperature=temperature, seed=seed)
    payload["params"]["max_tokens"] = 48
    payload["params"]["response_format"] = (
        response_format
        if response_format.get("type") == "json_object"
        else {"type": "json_schema", "schema": response_format["json_schema"]["schema"]}
    )
    return payload


def ring_structured(ring: ThreadRing, model_path: Path, verifier: Verifier, payload: dict) -> str:
    """The ring runner's answer under the job's grammar, which the verifier must pass with every token checked."""
    from mahout.ring.runner import RingRunner

    runner = RingRunner(ring.bridge, model_path, n_ctx=256)
    text = "".join(runner.stream(payload))
    if runner.finish_reason == "stop":  # its end of generation is reported, as a single-machine host reports it
        from mahout.runners.llama import end_of_generation_ids

        assert runner.token_ids[-1] in {runner._vocab.token_eos(), *end_of_generation_ids(runner._vocab)}
    audit = verifier.audit(
        payload,
        token_ids=runner.token_ids,
        text=text,
        finish_reason=runner.finish_reason,
        seed=payload["params"]["seed"],
    )
    assert audit.passed and not audit.misses and audit.checked == len(runner.token_ids), audit
    return text if runner.finish_reason == "stop" else ""


@pytest.mark.parametrize(
    ("response_format", "temperature"),
    [
        ({"type": "json_object"}, 0.0),
        ({"type": "json_object"}, 0.9),
        (SCHEMA, 0.0),
        (SCHEMA, 1.1),
    ],
    ids=["object-greedy", "object-sampled", "schema-greedy", "schema-sampled"],
)
def test_a_ring_draws_under_a_response_formats_grammar_and_passes_the_audit(
    ring, model_path, verifier, response_format, temperature
) -> None:  # noqa: ANN001
    """The head picks (the output head is shared) under the grammar, by `select_masked` as a
    single-machine host does: the answer follows the format, and every token is the draw."""
    import json

    text = ring_structured(ring, model_path, verifier, structured(response_format, temperature=temperature, seed=8))
    if text:  # (ended by the grammar, not cut by max_tokens)
        value = json.loads(text)
        assert isinstance(value, dict)
        if response_format is SCHEMA:
            assert set(value) == {"animal", "legs"} and isinstance(value["legs"], int)


def test_a_ring_whose_tail_holds_the_whole_output_head_follows_the_grammar_there(model_path, verifier) -> None:  # noqa: ANN001
    from engine.generate import build_stages

    stages = build_stages(model_path, split_layers(18, 2), n_rows=2, n_ctx=256, share_output=False)
    with ThreadRing(
        model_path, split_layers(18, 2), limits=Limits(micro_batch=2, row_width=16), stages=stages
    ) as whole:
        assert not any(agent.stage.shares_output for agent in whole.agents) and whole.agents[1].picks
        ring_structured(whole, model_path, verifier, structured(SCHEMA, temperature=0.8, seed=3))


def test_a_stage_without_the_vocabulary_fails_a_grammar_request_and_serves_on(model_path) -> None:  # noqa: ANN001
    from mahout.ring.bridge import RingError

    with ThreadRing(
        model_path, split_layers(18, 2), limits=Limits(micro_batch=2, row_width=16), slots=2, n_ctx=128
    ) as bare:
        for agent in bare.agents:
            agent.vocab_path = None
        with pytest.raises(RingError, match="follows no grammar"):
            bare.bridge.submit([2, 651, 3355], 4, grammar='root ::= "{}"').result()
        assert len(bare.bridge.submit([2, 651, 3355], 4).result()) == 4  # the ring serves on


@pytest.mark.parametrize(("temperature", "logprobs"), [(0.0, None), (0.8, None), (1.2, 3)])
def test_an_honest_rings_answer_to_text_it_resumes_heals_the_cut_word_and_passes(
    ring, verifier, model_path, temperature, logprobs
) -> None:  # noqa: ANN001
    """A chat ending in an assistant turn mid-word: a single-machine host heals the cut word (it
    writes the word's tokens again under a mask), and the verifier replays that. The ring's
    runner cuts the word off the prompt as the host does and the stage that picks writes it again
    under the same mask (over the whole vocabulary), so the honest ring's answer passes; the
    customer does not get the word twice."""
    from mahout.ring.runner import RingRunner

    payload = rendered(
        {
            "id": "job-2",
            "model": "gemma-3-270m",
            "kind": "chat",
            "prompt": None,
            "messages": [
                {"role": "user", "content": "Describe elephants."},
                {"role": "assistant", "content": "Elephants are the larg"},
            ],
            "params": {
                "max_tokens": MAX_TOKENS,
                "temperature": temperature,
                "top_p": 1.0,
                "stop": None,
                "seed": 11,
                "logprobs": logprobs,
            },
        }
    )
    runner = RingRunner(ring.bridge, model_path, n_ctx=256)
    pieces = list(runner.stream(payload))
    text = "".join(pieces)
    assert not text.startswith("larg") and not text.startswith("Elephants")
    entries = [entry for piece in pieces for entry in getattr(piece, "logprobs", [])] if logprobs else None
    audit = verifier.audit(
        payload, token_ids=runner.token_ids, text=text, finish_reason=runner.finish_reason, seed=11, logprobs=entries
    )
    assert audit.passed and not audit.misses, audit
    assert audit.checked > 0


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_ring_continues_an_answer_under_a_grammar_by_writing_the_delivered_text_again(
    ring, model_path, verifier, temperature
) -> None:  # noqa: ANN001
    """A host died mid-answer under a `response_format`: the continuation carries the delivered
    text apart (`rewrite`), since the grammar starts at the start of the answer. The ring's
    picking stage writes it again under the grammar and the healer's mask together (unstreamed),
    then goes on: the customer gets only the rest, the whole is valid JSON, and the audit (which
    replays the same) passes."""
    import json

    from mahout.ring.runner import RingRunner

    first = structured(SCHEMA, temperature=temperature, seed=21)
    runner = RingRunner(ring.bridge, model_path, n_ctx=256)
    whole = "".join(runner.stream(first))
    assert runner.finish_reason == "stop", whole  # (48 tokens hold the object)
    delivered = whole[: len(whole) // 2]  # where the first host died: mid-token, as likely as not
    again = {
        **first,
        "id": "job-3",
        "continuation": True,
        "rewrite": delivered,
        "params": {**first["params"], "max_tokens": 40},
    }
    rest = "".join(runner.stream(again))
    value = json.loads(delivered + rest)
    assert set(value) == {"animal", "legs"} and isinstance(value["legs"], int)
    assert runner.completion_tokens == len(runner._vocab.tokenize(rest.encode(), add_bos=False, special=True))
    audit = verifier.audit(
        again, token_ids=runner.token_ids, text=rest, finish_reason=runner.finish_reason, seed=again["params"]["seed"]
    )
    assert audit.passed and not audit.misses and audit.checked > 0, audit
