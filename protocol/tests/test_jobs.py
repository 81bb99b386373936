from __future__ import annotations

from protocol.jobs import CHAT, COMPLETION, EMBEDDINGS, job_payload_build
from protocol.rendering import ChatFormat

FORMAT = ChatFormat(template="{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")

PARAMS = {"max_tokens": 20, "temperature": 0.5, "top_p": 1.0, "stop": None, "seed": 3, "user_field": "never sent"}


class JobPayloadTests:
    def test_it_sends_only_the_sampling_params(self) -> None:
        payload = job_payload_build(
            job_id=1,
            model="m",
            kind=CHAT,
            messages=[{"role": "user", "content": "hi"}],
            prompt=None,
            inputs=None,
            params=PARAMS,
            fmt=FORMAT,
        )
        assert payload["params"] == {
            "max_tokens": 20,
            "temperature": 0.5,
            "top_p": 1.0,
            "stop": None,
            "seed": 3,
            "response_format": None,
            "logprobs": None,
        }
        assert payload["continuation"] is False

    def test_a_continuation_under_a_grammar_carries_the_delivered_text_apart_to_be_written_again(self) -> None:
        structured = {**PARAMS, "response_format": {"type": "json_object"}}
        payload = job_payload_build(
            job_id=5,
            model="m",
            kind=CHAT,
            messages=[{"role": "user", "content": "hi"}],
            prompt=None,
            inputs=None,
            params=structured,
            fmt=FORMAT,
            continuation=True,
            delivered='{"a": ',
            delivered_tokens=3,
        )
        assert payload["messages"] == [{"role": "user", "content": "hi"}] and payload["rewrite"] == '{"a": '
        assert payload["params"]["response_format"] == {"type": "json_object"} and payload["params"]["max_tokens"] == 17

    def test_it_continues_a_chat_from_an_unfinished_assistant_turn_with_the_budget_left(self) -> None:
        payload = job_payload_build(
            job_id=2,
            model="m",
            kind=CHAT,
            messages=[{"role": "user", "content": "hi"}],
            prompt=None,
            inputs=None,
            params=PARAMS,
            fmt=FORMAT,
            continuation=True,
            delivered="Hello, wor",
            delivered_tokens=4,
        )
        assert payload["messages"][-1] == {"role": "assistant", "content": "Hello, wor"}
        assert (payload["params"]["max_tokens"], payload["continuation"]) == (16, True)

    def test_it_continues_a_completion_by_appending_to_the_prompt_and_never_asks_for_zero_tokens(self) -> None:
        payload = job_payload_build(
            job_id=3,
            model="m",
            kind=COMPLETION,
            messages=None,
            prompt="Once",
            inputs=None,
            params=PARAMS,
            fmt=FORMAT,
            continuation=True,
            delivered=" upon",
            delivered_tokens=25,
        )
        assert (payload["prompt"], payload["params"]["max_tokens"]) == ("Once upon", 1)

    def test_embeddings_start_over_and_carry_their_inputs(self) -> None:
        payload = job_payload_build(
            job_id=4,
            model="e",
            kind=EMBEDDINGS,
            messages=None,
            prompt=None,
            inputs=["a", "b"],
            params={"max_tokens": 0},
            continuation=True,
            delivered="x",
        )
        assert payload == {"id": 4, "model": "e", "kind": EMBEDDINGS, "input": ["a", "b"], "continuation": False}
