"""The OpenAI Agents SDK (issue 34) against a real daphne gateway and a real mahout host running
the shipped model: one agent with a function tool, on the SDK's default model class (its
Responses API client) pointed at the gateway. The shipped model is a small base model, so this
checks the protocol's round trip, not the answer's sense: the first turn calls the tool under
the call's grammar (tool_choice "required"), the SDK runs the tool and sends its output back,
and the second turn (the SDK resets the choice to "auto") answers in the agent's output type,
sampled under that type's JSON Schema (`text.format`): a final answer, settled like any chat.
(openai-agents 0.24.0 requires websockets<17: mahout's socket runs on 16.1.1 for it.)"""

from __future__ import annotations

from typing import Annotated

import agents
import pydantic
import pytest

from marketplace.models import Request
from marketplace.tests.test_responses_e2e import customer_served, generation  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]


class Forecast(pydantic.BaseModel):
    summary: str = pydantic.Field(max_length=40)


class AgentTests:
    def test_an_agent_calls_its_tool_gets_the_output_back_and_answers(self, gateway, customer_served) -> None:  # noqa: F811
        from openai import AsyncOpenAI

        agents.set_tracing_disabled(True)  # (the SDK would send traces to OpenAI otherwise)
        agents.set_default_openai_client(
            AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=customer_served.secret, max_retries=0, timeout=120),
            use_for_tracing=False,
        )
        asked: list[str] = []

        @agents.function_tool
        def get_weather(city: Annotated[str, pydantic.Field(max_length=20)]) -> str:
            """The weather in a city."""
            asked.append(city)
            return "18 C and sunny"

        agent = agents.Agent(
            name="forecaster",
            instructions="Answer with the weather.",
            model="gemma-3-270m",
            tools=[get_weather],
            output_type=Forecast,
            model_settings=agents.ModelSettings(
                tool_choice="required", temperature=0, max_tokens=60, parallel_tool_calls=False
            ),
        )
        result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)

        assert len(asked) == 1 and asked[0], "the SDK ran the tool once, with the arguments the model wrote"
        kinds = [item.type for item in result.new_items]
        assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
        assert result.new_items[1].output == "18 C and sunny"
        assert isinstance(result.final_output, Forecast)
        first, second = (response.response_id for response in result.raw_responses)
        rows = {row.public_id: row for row in Request.objects.filter(public_id__in=[first, second])}
        assert all(row.status == "completed" and row.cost_ucents > 0 for row in rows.values())
        assert rows[second].prompt_tokens > rows[first].prompt_tokens, "the call and its output went back in the prompt"
        assert generation(gateway, customer_served, second)["completion_tokens"] == rows[second].completion_tokens
