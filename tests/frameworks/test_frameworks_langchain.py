"""LangChain's ChatOpenAI and a LangGraph ReAct agent against kvgate: tools bound with a tool_choice,
the tool messages sent back, structured output by function calling and by JSON schema."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent
from pydantic import BaseModel

from tests.helpers.frameworks import MAX_TOKENS, SYSTEM, assert_ran_once_with_a_city, assert_resumed, question, weather


class City(BaseModel):
    """A city and its country."""

    name: str
    country: str


@pytest.fixture
def llm(base_url: str, model_name: str) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=f"{base_url}/v1",
        api_key="unused",
        model=model_name,
        max_tokens=MAX_TOKENS,
        temperature=0,
        max_retries=0,
    )


def cache_read(message: BaseMessage) -> int | None:
    """What LangChain says the provider read from its prompt cache: kvgate's reused tokens."""
    assert isinstance(message, AIMessage) and message.usage_metadata
    return message.usage_metadata.get("input_token_details", {}).get("cache_read")


def input_tokens(message: BaseMessage) -> int:
    assert isinstance(message, AIMessage) and message.usage_metadata
    return message.usage_metadata["input_tokens"]


def test_langchain_bind_tools_loop(llm: ChatOpenAI) -> None:
    calls: list[str] = []

    @tool
    def get_weather(city: str) -> str:
        """Get the weather for a city."""
        calls.append(city)
        return weather(city)

    messages: list[BaseMessage] = [SystemMessage(SYSTEM), HumanMessage(question("Oslo"))]
    forced = llm.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False)  # a named choice
    first = forced.invoke(messages)
    assert isinstance(first, AIMessage) and first.response_metadata["finish_reason"] == "tool_calls"
    assert [c["name"] for c in first.tool_calls] == ["get_weather"] and not first.invalid_tool_calls
    messages.append(first)
    for call in first.tool_calls:
        messages.append(get_weather.invoke(call))  # a ToolMessage answering the call's id

    second = llm.bind_tools([get_weather]).invoke(messages)

    assert_ran_once_with_a_city(calls)
    assert isinstance(messages[-1], ToolMessage) and messages[-1].tool_call_id == first.tool_calls[0]["id"]
    assert isinstance(second, AIMessage) and second.content and not second.tool_calls
    assert cache_read(first) == 0
    assert_resumed(input_tokens(first), cache_read(second))


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output(llm: ChatOpenAI, method: Any) -> None:
    # function_calling: City as a tool the model is made to call; json_schema: City as response_format.
    structured = llm.with_structured_output(City, method=method, include_raw=True)
    out: Any = structured.invoke("Paris is the capital of France. Extract the city.")
    assert out["parsing_error"] is None
    assert isinstance(out["parsed"], City) and out["parsed"].name and out["parsed"].country
    raw = out["raw"]
    assert isinstance(raw, AIMessage)
    if method == "function_calling":
        assert raw.response_metadata["finish_reason"] == "tool_calls" and raw.tool_calls[0]["name"] == "City"
    else:
        assert raw.response_metadata["finish_reason"] == "stop" and City.model_validate_json(str(raw.content))


def test_langgraph_react_agent(llm: ChatOpenAI) -> None:
    calls: list[str] = []

    @tool
    def get_weather(city: str) -> str:
        """Get the weather for a city."""
        calls.append(city)
        return weather(city)

    def model(state: dict[str, Any], runtime: Any) -> Any:
        """LangGraph's dynamic model: the first turn must call the tool; once a tool has answered, the
        model must answer (tool_choice "none": the tools stay listed, so the prompt stays the same)."""
        answered = any(isinstance(m, ToolMessage) for m in state["messages"])
        return llm.bind_tools([get_weather], tool_choice="none" if answered else "required", parallel_tool_calls=False)

    agent = create_react_agent(model, [get_weather], prompt=SYSTEM)
    out = agent.invoke({"messages": [HumanMessage(question("Rome"))]}, {"recursion_limit": 6})

    messages = out["messages"]
    assert [type(m) for m in messages] == [HumanMessage, AIMessage, ToolMessage, AIMessage]
    call, result, answer = messages[1:]
    assert [c["name"] for c in call.tool_calls] == ["get_weather"] and result.content == weather(calls[0])
    assert answer.content and not answer.tool_calls  # the loop ended on an answer
    assert_ran_once_with_a_city(calls)
    assert_resumed(input_tokens(call), cache_read(answer))
