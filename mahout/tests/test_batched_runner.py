"""BatchedLlamaRunner on the shipped Gemma 3 270M: several jobs at once, each answered as
LlamaRunner answers it alone.

Where the arithmetic allows it, and on this llama.cpp it allows more than one might expect:
with ggml's plain weight layout (see ``weights_unpacked``) a decoded token's logits do not
depend on the sequences decoded beside it (measured bit-identical at 1 to 8 rows), so a job
whose prompt is read in one piece gets LlamaRunner's logits exactly at every step: the same
greedy and sampled tokens, log-probabilities and text. A prompt read in several pieces does
not: llama.cpp's logits depend on how a prompt is cut into passes (0.5 to 1.0 of a logit at
the prompt's end on this model, measured over every cut of a 15-token prompt), so a prompt of
more than WHOLE_PROMPT_TOKENS that arrives while others decode (read a chunk at a time), or one
continuing a shared prefix of more than that, may sample other tokens than it would alone
(greedy ones at a near-tie). Those cases
are tested for what they must do (the running streams untouched, fewer tokens read), not for
equal tokens. The reference is LlamaRunner.stream over the same loaded weights from a reset
cache (LlamaRunner itself reuses its previous prompt's prefix, which cuts the next prompt).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mahout.runners import Piece
from mahout.runners.batched import BatchedLlamaRunner, CompletionText, JobStream, slots_chosen
from mahout.runners.llama import LlamaRunner
from scorer.errors import RequestRejected
from testkit.formats import rendered

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def runner(model_path: Path):
    batched = BatchedLlamaRunner(model_path, threads=2, n_ctx=256, slots=4)
    yield batched
    batched.close()


def completion(prompt: str, **params) -> dict:
    return rendered(
        {
            "id": "job",
            "model": "gemma-3-270m",
            "kind": "completion",
            "messages": None,
            "prompt": prompt,
            "params": {"max_tokens": 12, "temperature": 0.0, "top_p": 1.0, "stop": None, "seed": 1, **params},
        }
    )


def chat(content: str, **params) -> dict:
    return rendered(
        {
            "id": "job",
            "model": "gemma-3-270m",
            "kind": "chat",
            "prompt": None,
            "messages": [{"role": "user", "content": content}],
            "params": {"max_tokens": 12, "temperature": 0.0, "top_p": 1.0, "stop": None, "seed": 1, **params},
        }
    )


def answer(items: list[str], source: LlamaRunner | JobStream) -> tuple:
    """What a job delivers: its pieces (with their log-probability entries), then what holds after."""
    return (
        [(str(item), item.logprobs if isinstance(item, Piece) else None) for item in items],
        list(source.token_ids),
        source.finish_reason,
        source.completion_tokens,
    )


def alone(runner: BatchedLlamaRunner, job: dict) -> tuple:
    runner._llm.reset()
    return answer(list(LlamaRunner.stream(runner, job)), runner)


def together(runner: BatchedLlamaRunner, jobs: list[dict]) -> list[tuple]:
    """Each job streamed in its own thread, all at once, as mahout runs them."""
    results: list[tuple] = [()] * len(jobs)

    def consume(index: int) -> None:
        stream = runner.stream(jobs[index])
        results[index] = answer(list(stream), stream)

    threads = [threading.Thread(target=consume, args=(index,)) for index in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def idle(runner: BatchedLlamaRunner) -> None:
    """Wait until the step thread holds no job (a cancellation is applied at its next step)."""
    for _ in range(200):
        if not any(slot.job for slot in runner._slots):
            return
        time.sleep(0.01)
    raise AssertionError("the step loop still holds a job")


class BatchedRunnerTests:
    def test_interleaved_jobs_each_get_what_they_get_alone(self, runner):
        jobs = [
            completion("The capital of France is"),
            completion("Once upon a time", temperature=0.9, seed=7, max_tokens=20),
            completion("Once upon a time", temperature=1.3, top_p=0.9, seed=8, max_tokens=16),
            completion("List three fruits, one per line:\n1.", stop=["3."], max_tokens=30),
            completion("The capital of Italy is", logprobs=3, max_tokens=8),
            {**completion("The elephant is a large mam", logprobs=1), "continuation": True},
            {
                **chat("Describe a person as JSON.", max_tokens=30, temperature=0.7, seed=3),
                "params": {
                    "max_tokens": 30,
                    "temperature": 0.7,
                    "seed": 3,
                    "response_format": {"type": "json_schema", "name": "p", "schema": PERSON},
                },
            },
            chat("Say hello.", max_tokens=40, seed=5, temperature=0.5),
        ]  # 8 jobs on 4 sequences: the later ones wait for a free one and reuse its cache
        expected = [alone(runner, job) for job in jobs]
        assert together(runner, jobs) == expected
        assert "".join(text for text, _ in expected[5][0]).startswith("mal"), "the cut word was healed"
        assert expected[3][2] == "stop", "the stop string ended it"

    def test_a_job_cancelled_mid_way_frees_its_sequence_for_the_next(self, runner):
        import llama_cpp

        stream = runner.stream(completion("Write a long story about a dragon.", max_tokens=200, temperature=1.0))
        pieces = [next(stream) for _ in range(3)]
        seq = next(slot.seq for slot in runner._slots if slot.job is not None)
        stream.close()
        idle(runner)
        assert len(pieces) == 3 and llama_cpp.llama_memory_seq_pos_max(runner._memory, seq) == -1
        jobs = [completion(f"Fact number {index}:", seed=index, temperature=1.0) for index in range(runner.slots)]
        assert together(runner, jobs) == [alone(runner, job) for job in jobs]

    def test_a_prompt_past_the_context_is_rejected_from_the_iterator(self, runner):
        stream = runner.stream(completion("word " * 400))
        with pytest.raises(RequestRejected, match="context window is 256 tokens"):
            next(stream)

    def test_the_n_choices_of_a_request_read_their_prompt_once(self, runner):
        jobs = [completion("The three most useful inventions are", temperature=1.0, seed=seed) for seed in range(4)]
        prompt = runner.prompt_tokens(jobs[0])
        idle(runner)
        before = runner.prefilled_tokens
        results = together(runner, jobs)
        assert runner.prefilled_tokens - before == len(prompt)
        assert results == [alone(runner, job) for job in jobs]
        assert len({tuple(result[1]) for result in results}) > 1, "each choice samples with its own seed"

    def test_a_long_shared_prefix_is_copied_not_read_again(self, runner):
        system = "You are a careful assistant who answers in one short sentence. " * 8
        first, second = completion(system + "What is a cat?"), completion(system + "What is a dog?")
        together(runner, [first])
        before = runner.prefilled_tokens
        together(runner, [second])
        shared = len(runner.prompt_tokens(completion(system)))
        assert runner.prefilled_tokens - before <= len(runner.prompt_tokens(second)) - shared + 2

    def test_a_long_prompt_read_in_chunks_leaves_the_running_stream_untouched(self, runner):
        running = completion("Count slowly: one, two,", max_tokens=30)
        long = completion("The history of the elephant is long and varied. " * 12, max_tokens=4)
        assert len(runner.prompt_tokens(long)) > runner.whole > runner.chunk
        expected = alone(runner, running)
        stream = runner.stream(running)
        items = [next(stream)]
        other = runner.stream(long)
        reader = threading.Thread(target=lambda: list(other))
        reader.start()
        items += list(stream)
        reader.join()
        assert answer(items, stream) == expected
        assert other.finish_reason in ("stop", "length") and len(other.token_ids) >= 1

    def test_it_serves_as_many_sequences_as_it_has_and_queues_the_rest(self, runner):
        jobs = [completion(f"Number {index} is", seed=index) for index in range(runner.slots + 2)]
        assert together(runner, jobs) == [alone(runner, job) for job in jobs]


class CompletionTextTests:
    """The text cut for each token as llama-cpp-python's create_completion(stream=True) cuts
    it, compared chunk by chunk with create_completion made to sample the same tokens."""

    CASES = [
        ("Hello world. STOP here and more", ["STOP"], 20),  # a stop string: cut before it
        ("Hello world. Then more words", ["world!"], 20),  # a stop string's start held back, then let go
        ("a 🦣 and ⿕ then 𝄞 and ü done", [], 40),  # characters split over byte tokens
        ("Hello world. Then more words follow", [], 4),  # max_tokens: "length"
        ("x 🦣", ["zz"], 3),  # max_tokens inside a character split over byte tokens
    ]

    @pytest.mark.parametrize(("text", "stop", "max_tokens"), CASES)
    def test_it_streams_what_create_completion_streams(self, runner, text, stop, max_tokens):
        from llama_cpp import LogitsProcessorList

        llm = runner._llm
        forced = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False) + [llm.token_eos()]
        prompt = llm.tokenize(b"Say:", add_bos=True, special=False)

        def force(input_ids, scores):
            only = np.full_like(scores, -np.inf)
            only[forced[len(input_ids) - len(prompt)]] = 0.0
            return only

        llm.reset()
        chunks = [
            chunk["choices"][0]
            for chunk in llm.create_completion(
                prompt=prompt,
                stream=True,
                max_tokens=max_tokens,
                temperature=0.0,
                stop=stop,
                logits_processor=LogitsProcessorList([force]),
            )
        ]
        cut = CompletionText(spell=runner._spell, ends=runner._ends, stop=stop, max_tokens=max_tokens)
        ours = []
        for token in forced:
            ours += cut.push(token)
            if cut.finish_reason:
                break
        assert ours == [chunk["text"] for chunk in chunks]
        assert cut.finish_reason == chunks[-1]["finish_reason"]


class SlotsChosenTests:
    def test_it_stops_where_doubling_gains_less_than_fifteen_percent(self):
        assert slots_chosen({1: 66.0, 2: 124.0, 4: 179.0, 8: 190.0}) == 4
        assert slots_chosen({1: 66.0, 2: 70.0, 4: 72.0, 8: 74.0}) == 1
        assert slots_chosen({1: 66.0, 2: 90.0, 4: 124.0, 8: 179.0}) == 8
        assert slots_chosen({1: 66.0}) == 1

    def test_a_plateau_between_two_counts_does_not_stop_it(self):
        """Measured here: two sequences gain 6% over one, four 56%, eight 98%."""
        assert slots_chosen({1: 61.9, 2: 65.4, 4: 96.5, 8: 122.2}) == 8
