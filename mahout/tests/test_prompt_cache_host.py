"""A host's prompt cache is bounded in time (issue 53): a prefix held from a finished job is
reused within ``prompt_cache_seconds`` (only the rest of the next prompt is read) and gone after
it (the whole prompt is read again), on the shipped Gemma 3 270M, for the batched runner and for
the one-slot LlamaRunner (llama-cpp-python's own reuse of its last prompt). A small bound stands
in for PROMPT_CACHE_SECONDS."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from mahout.runners.batched import BatchedLlamaRunner
from mahout.runners.llama import LlamaRunner
from testkit.formats import rendered

BOUND_SECONDS = 3.0
SYSTEM = "You are a careful assistant who answers every question in one short sentence. " * 6


def completion(prompt: str) -> dict:
    return rendered(
        {
            "id": "job",
            "model": "gemma-3-270m",
            "kind": "completion",
            "messages": None,
            "prompt": prompt,
            "params": {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "stop": None, "seed": 1},
        }
    )


def held_nothing(runner: BatchedLlamaRunner) -> bool:
    import llama_cpp

    return all(
        not slot.tokens and llama_cpp.llama_memory_seq_pos_max(runner._memory, slot.seq) == -1 for slot in runner._slots
    )


@pytest.fixture(scope="module")
def batched(model_path: Path):
    runner = BatchedLlamaRunner(model_path, threads=2, n_ctx=256, slots=2, prompt_cache_seconds=BOUND_SECONDS)
    runner._vocab_ready.join()  # (built at start: it would slow the first jobs)
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def single(model_path: Path):
    runner = LlamaRunner(model_path, threads=2, n_ctx=256, prompt_cache_seconds=BOUND_SECONDS)
    runner._vocab_ready.join()
    yield runner
    runner.close()


def streamed(runner: BatchedLlamaRunner, job: dict):  # type: ignore[no-untyped-def]
    stream = runner.stream(job)
    list(stream)
    return stream


class BatchedPromptCacheTests:
    def test_a_held_prefix_is_reused_within_the_bound_and_read_again_after_it(self, batched):
        first, second, third = (
            completion(SYSTEM + f"Question {n}: what is a {animal}?") for n, animal in enumerate(("cat", "dog", "cow"))
        )
        shared = len(batched.prompt_tokens(completion(SYSTEM)))
        assert shared > batched.whole, "long enough to be worth sharing"
        assert streamed(batched, first).prompt_read == len(batched.prompt_tokens(first))
        before = batched.prefilled_tokens
        reused = streamed(batched, second)
        assert reused.prompt_read <= len(batched.prompt_tokens(second)) - shared + 2
        assert batched.prefilled_tokens - before == reused.prompt_read
        deadline = time.monotonic() + BOUND_SECONDS + 2.0
        while not held_nothing(batched):
            assert time.monotonic() < deadline, "an idle runner still holds a sequence past the bound"
            time.sleep(0.1)
        assert streamed(batched, third).prompt_read == len(batched.prompt_tokens(third))

    def test_an_idle_runner_drops_a_held_sequence_within_two_seconds_of_the_bound(self, batched):
        streamed(batched, completion(SYSTEM + "Question: what is a horse?"))
        ended = time.monotonic()
        assert not held_nothing(batched), "the finished job's sequence is held"
        while not held_nothing(batched):
            time.sleep(0.05)
        assert BOUND_SECONDS - 0.1 <= time.monotonic() - ended <= BOUND_SECONDS + 2.0


class SinglePromptCacheTests:
    def test_the_last_prompt_is_reused_within_the_bound_and_read_again_after_it(self, single):
        read: list[int] = []
        evaluate = single._llm.eval

        def recording(tokens):  # type: ignore[no-untyped-def]
            read.append(len(tokens))
            return evaluate(tokens)

        single._llm.eval = recording  # llama-cpp-python evaluates a job's prompt (what it does not reuse) first
        try:
            first, second, third = (
                completion(SYSTEM + f"Question {n}: what is a {animal}?")
                for n, animal in enumerate(("cat", "dog", "cow"))
            )
            shared = len(single.prompt_tokens(completion(SYSTEM)))
            for job in (first, second):
                read.clear()
                list(single.stream(job))
            assert read[0] <= len(single.prompt_tokens(second)) - shared + 2, "only the rest was read"
            time.sleep(BOUND_SECONDS + 0.1)
            read.clear()
            list(single.stream(third))
            assert read[0] == len(single.prompt_tokens(third)), "the whole prompt was read again"
        finally:
            del single._llm.eval


def keyed(job: dict, key: str) -> dict:
    return {**job, "cache_key": key}


class AccountsApartTests:
    """A held prompt serves only jobs with its `cache_key` (one account on this host): another
    account's job with the same prompt reads it whole, so its first token tells it nothing."""

    def test_the_batched_runner_shares_a_held_prompt_within_one_key_only(self, batched):
        prompt = completion(SYSTEM + "Question: what is an owl?")
        whole = len(batched.prompt_tokens(prompt))
        assert streamed(batched, keyed(prompt, "account-a")).prompt_read == whole
        assert streamed(batched, keyed(prompt, "account-b")).prompt_read == whole, "another account read it whole"
        assert streamed(batched, keyed(prompt, "account-a")).prompt_read < whole, "its own account reuses it"

    def test_the_one_slot_runner_clears_its_last_prompt_before_another_keys_job(self, single):
        read: list[int] = []
        evaluate = single._llm.eval

        def recording(tokens):  # type: ignore[no-untyped-def]
            read.append(len(tokens))
            return evaluate(tokens)

        single._llm.eval = recording
        try:
            prompt = completion(SYSTEM + "Question: what is a swan?")
            whole = len(single.prompt_tokens(prompt))
            for key, expect_whole in (("account-a", True), ("account-b", True), ("account-b", False)):
                read.clear()
                list(single.stream(keyed(prompt, key)))
                assert (read[0] == whole) is expect_whole, (key, read[0], whole)
        finally:
            del single._llm.eval
