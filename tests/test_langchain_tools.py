"""langchain against `tandem serve`'s shape (issue 41): a gateway in front of a colocated worker
running the shipped model, and langchain-openai's `ChatOpenAI` as a user writes it.

- `bind_tools([...], tool_choice="required")` gets a tool call (the grammar makes the output a
  list of calls) whose arguments parse and validate for the tool's schema;
- `with_structured_output(Schema, method="function_calling")` (a named function underneath)
  gets a `Schema` instance;
- cut by max_tokens, both still raise nothing: the call comes back partial (its name, its
  arguments so far: langchain lists it in `invalid_tool_calls`), finish_reason "length".
The tiny model's arguments are what the grammar allows, not what the question asks."""

from __future__ import annotations

from collections.abc import Iterator

import jsonschema
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.gateway_helpers import API_KEY, colocated_gateway
from tests.workers import config

ASK = "What is the weather in Paris for the next two days?"


class Weather(BaseModel):
    """The weather in a city for some days."""
    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": Weather.model_json_schema()}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with colocated_gateway(config(compile=False)) as (gw, _):
        yield gw.url + "/v1"


def chat(url: str, max_tokens: int) -> ChatOpenAI:
    return ChatOpenAI(model="tiny-moe", base_url=url, api_key=API_KEY, max_retries=0, temperature=0,
                      max_tokens=max_tokens)  # type: ignore[call-arg]


@pytest.mark.parametrize("stream", [False, True])
def test_bind_tools_required_gives_a_call_whose_arguments_validate(url: str, stream: bool) -> None:
    model = chat(url, 128).bind_tools([WEATHER, TIME], tool_choice="required")
    if stream:
        message = None
        for chunk in model.stream(ASK):
            message = chunk if message is None else message + chunk
    else:
        message = model.invoke(ASK)
    assert message is not None and message.tool_calls, message
    call = message.tool_calls[0]
    schemas = {"get_weather": WEATHER, "get_time": TIME}
    assert call["name"] in schemas and call["id"], call
    jsonschema.validate(call["args"], schemas[call["name"]]["function"]["parameters"])
    assert message.response_metadata.get("finish_reason") == "tool_calls", message.response_metadata


def test_with_structured_output_function_calling_gives_the_schema(url: str) -> None:
    got = chat(url, 128).with_structured_output(Weather, method="function_calling").invoke(ASK)
    assert isinstance(got, Weather), got
    assert 1 <= got.days <= 7 and len(got.city) <= 12


def test_a_required_call_cut_by_max_tokens_is_a_partial_call(url: str) -> None:
    message = chat(url, 6).bind_tools([WEATHER], tool_choice="required").invoke(ASK)
    assert message.response_metadata.get("finish_reason") == "length", message.response_metadata
    calls = [*message.tool_calls, *message.invalid_tool_calls]
    assert [c["name"] for c in calls] == ["get_weather"], message
    assert not message.content, message                    # the raw [{"name": ... text is not content


def test_structured_output_cut_by_max_tokens_raises_nothing_with_include_raw(url: str) -> None:
    got = chat(url, 6).with_structured_output(Weather, method="function_calling", include_raw=True).invoke(ASK)
    raw = got["raw"]
    assert raw.response_metadata.get("finish_reason") == "length", raw.response_metadata
    assert [c["name"] for c in [*raw.tool_calls, *raw.invalid_tool_calls]] == ["Weather"], raw
    assert got["parsed"] is None          # its arguments so far are no Weather: langchain parses none
