"""Agent and structuring libraries users run, against a real mesh of SmolLM2 (a tracker and two
node processes): pydantic-ai's OpenAI model calling a tool, and ``instructor`` extracting a
pydantic model. SmolLM2's template has no tools, so this drives meshnet's documented tool prompt
(:mod:`meshnet.gateway.tools`) and the grammar that holds a forced call to its schema."""

from __future__ import annotations

import json

import httpx
import pytest
from pydantic import BaseModel, Field

from tests.integration.conftest import REAL
from tests.integration.mesh import serving

pytestmark = pytest.mark.slow


class Requests(httpx.Client):
    """An httpx client that keeps every chat request body it sends (the tool result's round trip)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.bodies: list[dict] = []

    def send(self, request, **kw):
        if request.url.path.endswith("/chat/completions"):
            self.bodies.append(json.loads(request.content))
        return super().send(request, **kw)


class AsyncRequests(httpx.AsyncClient):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.bodies: list[dict] = []
        self.answers: list[dict] = []

    async def send(self, request, **kw):
        if request.url.path.endswith("/chat/completions"):
            self.bodies.append(json.loads(request.content))
        resp = await super().send(request, **kw)
        if request.url.path.endswith("/chat/completions"):
            await resp.aread()
            self.answers.append(resp.json())
        return resp


@pytest.fixture(scope="module")
def mesh(real_model_path, tmp_path_factory):
    with serving(tmp_path_factory.mktemp("agents"), REAL, [(0, 14), (15, 29)]) as m:
        yield m


def test_pydantic_ai_agent_calls_the_tool_gets_its_result_back_and_answers(mesh):
    from pydantic_ai import Agent
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class ToolFirst(AbstractCapability):
        """Force the weather tool on the first step, text after it (pydantic-ai's per-step tool_choice)."""

        def get_model_settings(self):
            return lambda ctx: {"tool_choice": ["get_weather"] if ctx.run_step <= 1 else "none",
                                "temperature": 0.0}

    http = AsyncRequests(timeout=120)
    model = OpenAIChatModel(REAL, provider=OpenAIProvider(base_url=f"{mesh.url}/v1", api_key="none",
                                                          http_client=http))
    agent = Agent(model, capabilities=[ToolFirst()])
    calls: list[str] = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is sunny and 21 degrees in {city}."

    result = agent.run_sync("What is the weather in Paris?")
    assert len(calls) == 1 and isinstance(calls[0], str) and calls[0]
    first, second = http.answers[0], http.answers[-1]
    assert first["choices"][0]["finish_reason"] == "tool_calls"
    call = first["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and set(json.loads(call["function"]["arguments"])) == {"city"}
    sent_back = [m for m in http.bodies[-1]["messages"] if m["role"] == "tool"]
    assert sent_back and f"sunny and 21 degrees in {calls[0]}" in json.dumps(sent_back)
    assert second["choices"][0]["finish_reason"] == "stop"
    assert isinstance(result.output, str) and result.output.strip()
    print(f"pydantic-ai: called get_weather({calls[0]!r}); final answer {result.output[:80]!r}")


def test_instructor_extracts_a_pydantic_model_that_validates(mesh):
    import instructor
    from openai import OpenAI

    class City(BaseModel):
        name: str
        country: str
        population_millions: float = Field(ge=0, le=100)

    http = Requests(timeout=120)
    client = instructor.from_openai(OpenAI(base_url=f"{mesh.url}/v1", api_key="none", http_client=http),
                                    mode=instructor.Mode.TOOLS)
    city = client.chat.completions.create(model=REAL, response_model=City, temperature=0, max_retries=0,
                                          messages=[{"role": "user", "content": "Paris is the capital of France. "
                                                     "About 2.1 million people live there."}])
    assert isinstance(city, City) and city.name and city.country
    assert http.bodies[0]["tool_choice"] == {"type": "function", "function": {"name": "City"}}
    print(f"instructor: {city!r}")
    json_mode = instructor.from_openai(OpenAI(base_url=f"{mesh.url}/v1", api_key="none"),
                                       mode=instructor.Mode.JSON_SCHEMA)
    again = json_mode.chat.completions.create(model=REAL, response_model=City, temperature=0, max_retries=0,
                                              messages=[{"role": "user", "content": "Tell me about Rome, Italy."}])
    assert isinstance(again, City)
    print(f"instructor (json_schema): {again!r}")


def test_the_official_client_calls_a_tool_sends_its_result_back_and_gets_a_final_answer(mesh):
    from openai import OpenAI

    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                       "required": ["city"]}}}
    http = Requests(timeout=120)
    client = OpenAI(base_url=f"{mesh.url}/v1", api_key="none", http_client=http)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=REAL, messages=messages, tools=[weather], tool_choice="required",
                                           temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(arguments) == {"city"} and isinstance(arguments["city"], str)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees."}]
    second = client.chat.completions.create(model=REAL, messages=messages, tools=[weather], tool_choice="none",
                                            temperature=0, max_tokens=96)
    assert http.bodies[-1]["messages"][-1] == {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees."}
    bare = client.chat.completions.create(model=REAL, messages=messages[:1], tools=[weather], tool_choice="none",
                                          temperature=0, max_tokens=1)
    assert second.usage.prompt_tokens > bare.usage.prompt_tokens + 10  # the call and its result are in the prompt
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content
    print(f"openai client: get_weather({arguments}) then {second.choices[0].message.content!r}")
