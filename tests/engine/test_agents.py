"""An agent framework that is not ours drives a tool loop against
``asyncstep serve``: the OpenAI Agents SDK (``openai-agents``) calls a
function (forced: ``tool_choice="required"``; the SDK then sets it back to
``auto``, served by the hermes parser), feeds its result back and ends with
the model's answer, whole and streamed."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import agents
import pytest
from openai import AsyncOpenAI
from processes import serving_url

pytestmark = pytest.mark.anyio

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the SDK runs on asyncio


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    argv = [sys.executable, "-m", "asyncstep", "serve", "--port", "0", "--max-model-len", "1024"]
    argv += ["--kv-cache-memory-gib", "0.1", "--enable-auto-tool-choice"]
    argv += ["--tool-call-parser", "hermes"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    try:
        yield serving_url(proc, output)
    finally:
        proc.terminate()
        proc.wait(30)


def weather_agent(client: AsyncOpenAI, calls: list[str]) -> agents.Agent[None]:
    agents.set_tracing_disabled(True)

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"22 C and sunny in {city}"

    return agents.Agent(
        name="weather",
        instructions="Answer with the help of the weather tool.",
        tools=[get_weather],
        model=agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=48),
    )


def client_of(url: str) -> AsyncOpenAI:
    """A client of the test's own (closed by it: its connections belong to
    the test's event loop)."""
    return AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def test_an_agent_calls_its_tool_and_answers(url: str) -> None:
    calls: list[str] = []
    async with client_of(url) as client:
        result = await agents.Runner.run(
            weather_agent(client, calls), "What is the weather in Paris?", max_turns=4
        )
    assert len(calls) == 1 and calls[0]
    assert isinstance(result.final_output, str) and result.final_output


async def test_a_streamed_agent_run_calls_its_tool_and_answers(url: str) -> None:
    calls: list[str] = []
    async with client_of(url) as client:
        run = agents.Runner.run_streamed(
            weather_agent(client, calls), "What is the weather in Oslo?", max_turns=4
        )
        kinds = [event.type async for event in run.stream_events()]
    assert len(calls) == 1 and calls[0]
    assert "run_item_stream_event" in kinds
    assert isinstance(run.final_output, str) and run.final_output
