"""The one real-model test: the shipped Gemma 3 270M streams through LlamaRunner.

Kept small (1 thread, a few tokens) so it runs in seconds on a 2-core machine.
"""

from __future__ import annotations

import json

import pytest

from mahout.model_files import assemble_shipped
from mahout.runners.llama import ContextOverflowError, LlamaRunner
from scorer.healing import healing
from scorer.llama import cpu_advertises_amx
from testkit.formats import rendered


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> LlamaRunner:
    path = assemble_shipped(tmp_path_factory.mktemp("home"), progress=False)
    return LlamaRunner(path, threads=1, n_ctx=256)


def chat_job(messages: list[dict], max_tokens: int = 8) -> dict:
    return rendered(
        {
            "id": "job-1",
            "model": "gemma-3-270m",
            "kind": "chat",
            "messages": messages,
            "prompt": None,
            "params": {"max_tokens": max_tokens, "temperature": 0.0, "top_p": 1.0, "stop": None, "seed": 1},
        }
    )


class LlamaRunnerTests:
    def test_it_streams_a_completion_from_the_shipped_model(self, runner):
        job = rendered(
            {
                "id": "job-1",
                "model": "gemma-3-270m",
                "kind": "completion",
                "messages": None,
                "prompt": "The capital of France is",
                "params": {"max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "stop": None, "seed": None},
            }
        )
        pieces = list(runner.stream(job))
        assert "".join(pieces).strip()
        assert runner.finish_reason in ("stop", "length")
        assert 1 <= runner.completion_tokens <= 8
        if runner.finish_reason == "length":
            assert runner.completion_tokens == 8

    def test_it_continues_an_open_assistant_turn(self, runner):
        messages = [
            {"role": "user", "content": "Count from one to ten."},
            {"role": "assistant", "content": "One, two, thr"},
        ]
        text = "".join(runner.stream(chat_job(messages)))
        assert text.strip()
        assert "<start_of_turn>" not in text and "<end_of_turn>" not in text

    def test_it_tokenizes_turn_markers_as_control_tokens(self, runner):
        tokens = runner.prompt_tokens(chat_job([{"role": "user", "content": "Hi"}]))
        # <bos> <start_of_turn> user \n Hi <end_of_turn> \n <start_of_turn> model \n: markers are single ids
        assert len(tokens) < 15

    def test_it_rejects_a_prompt_that_overflows_the_context(self, runner):
        job = chat_job([{"role": "user", "content": "word " * 400}])
        with pytest.raises(ContextOverflowError, match="context window is 256 tokens"):
            list(runner.stream(job))


class CpuAdvertisesAmxTests:
    def test_it_reads_the_amx_tile_flag(self):
        assert cpu_advertises_amx("flags\t\t: fpu avx2 amx_bf16 amx_tile amx_int8\n") is True
        assert cpu_advertises_amx("flags\t\t: fpu avx2 avx512f\n") is False


class TokenHealingTests:
    def test_it_finishes_a_word_cut_mid_way_on_the_real_model(self, runner):
        job = rendered(
            {
                "id": "job-2",
                "model": "gemma-3-270m",
                "kind": "completion",
                "messages": None,
                "continuation": True,
                "prompt": "The elephant is a large mam",
                "params": {"max_tokens": 6, "temperature": 0.0, "top_p": 1.0, "stop": None, "seed": None},
            }
        )
        text = "".join(runner.stream(job))
        assert text.startswith("mal"), f"'mam' should become 'mammal', got {text!r}"

    def test_it_leaves_a_prompt_that_ends_at_a_turn_marker_alone(self, runner):
        job = chat_job([{"role": "user", "content": "Hi"}])
        tokens = runner.prompt_tokens(job)
        runner._vocab_ready.join()
        assert healing({**job, "continuation": True}, tokens, runner._vocab) == (tokens, None)


class TokenHealerStripTests:
    def test_it_removes_the_rewritten_text_across_pieces(self):
        from scorer.healing import TokenHealer

        healer = TokenHealer(prompt_len=3, dropped=b" paragr", vocab=None)  # type: ignore[arg-type]
        assert [healer.strip(p) for p in (" par", "agraph", " two")] == ["", "aph", " two"]


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


class StructuredOutputTests:
    def test_the_lazy_grammar_chooses_what_llama_cpps_own_grammar_sampler_chooses(self, runner):
        """Greedy under a grammar: the lazy check (the likely tokens first) must pick exactly
        the token llama.cpp's sampler picks after masking the whole vocabulary."""
        from llama_cpp.llama_grammar import JSON_GBNF, LlamaGrammar

        for response_format in ({"type": "json_object"}, {"type": "json_schema", "name": "p", "schema": PERSON}):
            job = {
                **chat_job(ASK, max_tokens=40),
                "params": {"max_tokens": 40, "temperature": 0.0, "response_format": response_format},
            }
            runner._llm.reset()  # both from a cold cache: the same arithmetic, so the same near-ties
            lazy = "".join(runner.stream(job))
            grammar = (
                LlamaGrammar.from_string(JSON_GBNF, verbose=False)
                if response_format["type"] == "json_object"
                else LlamaGrammar.from_json_schema(json.dumps(PERSON), verbose=False)
            )
            tokens = runner.prompt_tokens(job)
            runner._llm.reset()
            full = runner._llm.create_completion(
                prompt=tokens, max_tokens=40, temperature=0.0, grammar=grammar, stop=runner.stop_strings(job)
            )["choices"][0]["text"]
            assert lazy == full, (response_format, lazy, full)

    def test_sampled_answers_under_a_schema_parse_and_match_it(self, runner):
        import jsonschema

        for seed in (1, 2, 3):
            job = {
                **chat_job(ASK, max_tokens=80),
                "params": {
                    "max_tokens": 80,
                    "temperature": 1.0,
                    "seed": seed,
                    "response_format": {
                        "type": "json_schema",
                        "name": "p",
                        "schema": {**PERSON, "additionalProperties": False},
                    },
                },
            }
            text = "".join(runner.stream(job))
            if runner.finish_reason == "stop":
                jsonschema.validate(json.loads(text), PERSON)
            else:
                assert text.lstrip().startswith("{")

    def test_a_continuation_writes_the_delivered_text_again_and_streams_only_what_follows(self, runner):
        whole = "".join(
            runner.stream(
                {
                    **chat_job(ASK),
                    "params": {
                        "max_tokens": 40,
                        "temperature": 0.0,
                        "response_format": {"type": "json_schema", "name": "p", "schema": PERSON},
                    },
                }
            )
        )
        cut = len(whole) // 2
        rest = "".join(
            runner.stream(
                {
                    **chat_job(ASK),
                    "continuation": True,
                    "rewrite": whole[:cut],
                    "params": {
                        "max_tokens": 40,
                        "temperature": 0.0,
                        "response_format": {"type": "json_schema", "name": "p", "schema": PERSON},
                    },
                }
            )
        )
        assert whole[:cut] + rest == whole


class LogprobTests:
    """Each piece carries the entries of exactly its tokens: their strings spell it, even where
    a healed or re-written start, or a stop string, cuts a token."""

    def pieces(self, runner, job: dict) -> tuple[str, list[dict]]:  # noqa: ANN001
        text, entries = "", []
        for piece in runner.stream(job):
            assert "".join(entry["token"] for entry in piece.logprobs) == piece, (piece, piece.logprobs)
            text += piece
            entries += piece.logprobs
        return text, entries

    def test_a_completion_reports_the_likeliest_alternatives_at_each_token(self, runner):
        job = rendered(
            {
                "id": "job-3",
                "model": "gemma-3-270m",
                "kind": "completion",
                "messages": None,
                "prompt": "The capital of France is",
                "params": {
                    "max_tokens": 8,
                    "temperature": 0.0,
                    "top_p": 1.0,
                    "stop": None,
                    "seed": None,
                    "logprobs": 3,
                },
            }
        )
        plain = "".join(runner.stream({**job, "params": {**job["params"], "logprobs": None}}))
        text, entries = self.pieces(runner, job)
        assert text == plain, "reporting log-probabilities changes nothing sampled"
        assert len(entries) == runner.completion_tokens
        for entry in entries:
            assert [top["logprob"] for top in entry["top_logprobs"]] == sorted(
                (top["logprob"] for top in entry["top_logprobs"]), reverse=True
            )
            assert len(entry["top_logprobs"]) == 3 and entry["logprob"] == entry["top_logprobs"][0]["logprob"]  # greedy

    def test_a_healed_start_and_a_stop_string_keep_only_delivered_characters(self, runner):
        job = rendered(
            {
                "id": "job-4",
                "model": "gemma-3-270m",
                "kind": "completion",
                "messages": None,
                "continuation": True,
                "prompt": "The elephant is a large mam",
                "params": {
                    "max_tokens": 12,
                    "temperature": 0.0,
                    "top_p": 1.0,
                    "stop": None,
                    "seed": None,
                    "logprobs": 0,
                },
            }
        )
        text, entries = self.pieces(runner, job)
        assert text.startswith("mal") and entries[0]["token"].startswith("mal"), entries[0]
        cut = text[len(text) // 2 :][:3]
        stopped, _ = self.pieces(runner, {**job, "params": {**job["params"], "stop": [cut]}})
        assert stopped == text[: text.index(cut)]

    def test_a_rewritten_start_under_a_grammar_is_not_reported(self, runner):
        params = {
            "max_tokens": 40,
            "temperature": 0.0,
            "logprobs": 1,
            "response_format": {"type": "json_schema", "name": "p", "schema": PERSON},
        }
        whole, entries = self.pieces(runner, {**chat_job(ASK), "params": params})
        cut = len(whole) // 2
        rest, later = self.pieces(
            runner, {**chat_job(ASK), "continuation": True, "rewrite": whole[:cut], "params": params}
        )
        assert whole[:cut] + rest == whole
        assert "".join(entry["token"] for entry in later) == rest


class StrictJsonStringTests:
    def test_a_schemas_grammar_refuses_a_raw_newline_inside_a_string(self, runner):
        """llama-cpp-python's converter lets control characters into strings; JSON does not
        (a sampled answer once held a newline in a hobby, and no parser took it)."""
        import ctypes
        import math

        import llama_cpp

        from scorer.llama import grammar_for

        llm = runner._llm
        grammar = grammar_for(
            {
                "type": "json_schema",
                "name": "p",
                "schema": {"type": "object", "properties": {"name": {"type": "string"}}},
            }
        )
        sampler = llama_cpp.llama_sampler_init_grammar(
            llama_cpp.llama_model_get_vocab(llm.model), grammar._grammar.encode(), grammar._root.encode()
        )
        try:
            for token in llm.tokenize(b'{"name": "ab', add_bos=False):
                llama_cpp.llama_sampler_accept(sampler, token)
            newline, letter = llm.tokenize(b"\n", add_bos=False)[0], llm.tokenize(b"c", add_bos=False)[0]
            data = (llama_cpp.llama_token_data * 2)()
            for index, token in enumerate((newline, letter)):
                data[index].id, data[index].logit, data[index].p = token, 0.0, 0.0
            array = llama_cpp.llama_token_data_array(
                data=ctypes.cast(data, ctypes.POINTER(llama_cpp.llama_token_data)), size=2, selected=-1, sorted=False
            )
            llama_cpp.llama_sampler_apply(sampler, ctypes.byref(array))
            assert math.isinf(data[0].logit) and not math.isinf(data[1].logit)
        finally:
            llama_cpp.llama_sampler_free(sampler)


def test_the_ends_of_generation_are_every_token_llama_cpp_stops_at(runner) -> None:  # noqa: ANN001
    """What a ring or an MoE coordinator stops at, sampling outside llama.cpp's loop: Gemma 3
    marks `</s>` as an end of generation too, besides EOS and its end of turn."""
    from mahout.runners.llama import end_of_generation_ids

    ends = end_of_generation_ids(runner._llm)
    spelled = {runner._llm.detokenize([token], special=True) for token in ends}
    assert spelled == {b"<eos>", b"<end_of_turn>", b"</s>"} and runner._llm.token_eos() in ends
