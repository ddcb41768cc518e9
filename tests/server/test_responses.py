"""/v1/responses as the official openai SDK and the OpenAI Agents SDK use it: a real uvicorn server on loopback
over the real model (and, in proxy mode, over the stub upstream), answered through chat completions.

The Agents SDK owns the import name `agents`, which from the repository root is the repository's own folder:
its runs are subprocesses started elsewhere, isolated (as in tests/unit/test_package.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.responses import Response

from kvgate.bench.upstream import serve_upstream
from kvgate.gateway.settings import Settings
from tests.helpers import loopback
from tests.helpers.servers import serving

ROOT = Path(__file__).resolve().parents[2]
BRIEF = "You answer in one short sentence."
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FUNCTION = {"name": "get_weather", "description": "The weather in a city.", "parameters": CITY}
WEATHER = [{"type": "function", **FUNCTION}]  # Responses' flat shape; chat's is {"type", "function": FUNCTION}
STUB_ANSWER = "w0 w1 w2 w3 w4 w5 w6 w7 "


def sdk(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def said(role: str, content: Any, **more: Any) -> dict[str, Any]:
    return {"role": role, "content": content, **more}


def truth(url: str, model: str, messages: list[dict[str, Any]], max_tokens: int, **more: Any) -> Any:
    """The chat answer by full prefill, for a tenant of its own (nothing of the others' KV)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **more}
    return sdk(url, "truth").chat.completions.create(**body, extra_body={"kvgate": {"reuse": "full"}})


def test_a_response_is_the_chat_answer_to_the_same_messages(client, base_url, model_name):
    question = "What is the capital of France?"
    raw = client.responses.with_raw_response.create(
        model=model_name, instructions=BRIEF, input=question, max_output_tokens=48, temperature=0, metadata={"k": "v"}
    )
    response = raw.parse()
    chat = truth(base_url, model_name, [said("system", BRIEF), said("user", question)], 48)
    assert isinstance(response, Response) and response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat.choices[0].message.content
    assert (response.status, chat.choices[0].finish_reason, response.incomplete_details) == ("completed", "stop", None)
    (message,) = response.output
    assert (message.type, message.role, message.status, message.id[:4]) == ("message", "assistant", "completed", "msg_")
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert usage.total_tokens == chat.usage.total_tokens and usage.output_tokens_details.reasoning_tokens == 0
    assert (response.model, response.instructions, response.metadata) == (model_name, BRIEF, {"k": "v"})
    assert (response.temperature, response.tool_choice, response.tools, response.store) == (0, "auto", [], True)
    assert raw.headers["x-kvgate-cache"] == "bypass" and raw.headers["x-kvgate-reused-tokens"] == "0"


def test_max_output_tokens_cut_the_answer_short_as_incomplete(client, model_name):
    response = client.responses.create(model=model_name, input="Tell me a long story.", max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"


def test_a_stream_is_the_responses_events_ending_with_the_response(client, base_url, model_name):
    ask = {"model": model_name, "instructions": BRIEF, "input": "What is the capital of Spain?", "temperature": 0}
    events = list(client.responses.create(**ask, max_output_tokens=48, stream=True))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    opening = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    closing = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert types[:4] == opening and types[-4:] == [*closing, "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and text == final.output_text == events[-4].text
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"
    assert final.status == "completed" and final.usage.output_tokens > 0
    assert client.responses.retrieve(final.id).output_text == text
    assert client.responses.create(**ask, max_output_tokens=48).output_text == text
    with client.responses.stream(**ask, max_output_tokens=48) as stream:  # the SDK's own bookkeeping of the events
        assert stream.get_final_response().output_text == text
    with loopback.stream("POST", base_url + "/v1/responses", json={**ask, "max_output_tokens": 4, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    named = [line.removeprefix("event: ") for line in lines[0::2]]
    assert named == [json.loads(line.removeprefix("data: "))["type"] for line in lines[1::2]]
    assert named[-1] == "response.incomplete"


def test_output_items_sent_back_continue_their_chain(kept_url, model_name):
    """A client that resends the whole conversation (the Agents SDK) continues the chain of the output items in it."""
    client = sdk(kept_url, "whole")
    asked = said("user", "Name a fruit.")
    # Greedy: a sampled answer may be tokens its text does not tokenize back to (CI drew one: reuse stopped there)
    raw = client.responses.with_raw_response.create(model=model_name, input=[asked], max_output_tokens=6, temperature=0)
    first, program = raw.parse(), raw.headers["x-kvgate-program-id"]
    assert program == "responses:" + first.id.removeprefix("resp_")
    items = [asked, *[o.model_dump(exclude_none=True) for o in first.output], said("user", "And one more?")]
    raw = client.responses.with_raw_response.create(model=model_name, input=items, max_output_tokens=6, temperature=0)
    assert raw.headers["x-kvgate-program-id"] == program
    assert raw.parse().usage.input_tokens_details.cached_tokens > first.usage.input_tokens


# ---- a conversation kept by the server: continued by previous_response_id, or by its items' ids ----------------

CHAINED = {"authorization": "Bearer chained"}  # the tenant of the chained conversation
ASKED = ("Name a city in France.", "What is the weather there?", "And tomorrow?")
RESULT = "Sunny, 22 C."


@dataclass(frozen=True)
class Turn:
    response: Response
    program: str  # the agent program it ran in
    reuse: str  # how its prompt's KV was found ("": none was)


def ref(item_id: str) -> dict[str, str]:
    return {"type": "item_reference", "id": item_id}


def converse(client: openai.OpenAI, model_name: str, by_reference: bool) -> list[Turn]:
    """Three turns, a forced function call and its output in the second (two responses): continued by
    `previous_response_id`, or (`by_reference`) by the whole conversation sent again as references to the
    kept items (as the AI SDK does): the earlier input items by the ids input_items lists, the output items."""
    ask = {"model": model_name, "instructions": BRIEF, "tools": WEATHER, "parallel_tool_calls": False}
    turns: list[Turn] = []
    history: list[dict[str, Any]] = []  # every item so far, by id
    steps: list[tuple[Any, str]] = [(said("user", ASKED[0]), "none"), (said("user", ASKED[1]), "required")]
    steps += [(None, "none"), (said("user", ASKED[2]), "none")]  # None: the function call's output
    for new, choice in steps:
        if new is None:
            new = {"type": "function_call_output", "call_id": turns[-1].response.output[0].call_id, "output": RESULT}
        if by_reference:
            given = {"input": [*history, new]}
        else:
            given = {"input": [new]} | ({"previous_response_id": turns[-1].response.id} if turns else {})
        most = 48 if choice == "required" else 8  # a call, whole
        raw = client.responses.with_raw_response.create(
            **ask, **given, tool_choice=choice, temperature=0, max_output_tokens=most
        )
        turns.append(
            Turn(raw.parse(), raw.headers["x-kvgate-program-id"], raw.headers.get("x-kvgate-reuse", "").split(";")[0])
        )
        inputs = client.responses.input_items.list(turns[-1].response.id, order="asc", limit=100).data
        history = [ref(i.id) for i in (*inputs, *turns[-1].response.output)]
    return turns


@pytest.fixture(scope="module")
def kept_url(settings: Settings, engine: Any) -> Iterator[str]:
    """A server that finds no program by the messages a request resends (the local backend's own way): a
    conversation keeps its program only as the Responses API continues it."""
    with serving(settings.model_copy(update={"agents": {"implicit_programs": False}}), engine) as url:
        yield url


@pytest.fixture(scope="module")
def conversations(kept_url: str, model_name: str) -> dict[str, list[Turn]]:
    """Each in a tenant of its own: the KV one reuses is none of the other's."""
    chained = converse(sdk(kept_url, "chained"), model_name, False)
    return {"chained": chained, "referred": converse(sdk(kept_url, "referred"), model_name, True)}


@pytest.mark.parametrize("way", ["chained", "referred"])
def test_a_conversation_with_a_function_call_continues_on_its_kv(conversations, way):
    """By previous_response_id or by item references alike, every turn runs in the first's program and reuses
    the KV of at least 80% of the previous prompt (at most of it and its answer)."""
    turns = conversations[way]
    assert len({t.program for t in turns}) == 1 and turns[0].program.startswith("responses:")
    assert [t.reuse for t in turns[1:]] == ["program"] * 3
    for before, after in zip(turns, turns[1:], strict=False):
        cached, prior = after.response.usage.input_tokens_details.cached_tokens, before.response.usage
        assert 0.8 * prior.input_tokens <= cached <= prior.input_tokens + prior.output_tokens - 1, way
        if way == "chained":
            assert after.response.previous_response_id == before.response.id


def test_a_forced_function_call_and_its_output_continue_the_conversation(base_url, model_name, conversations):
    """The second turn's call, then the answer to its output: the chat answer to the whole conversation."""
    first, calling, answering, _ = (t.response for t in conversations["chained"])
    (call,) = calling.output
    assert (call.type, call.name, call.status, call.id[:3]) == ("function_call", "get_weather", "completed", "fc_")
    city = json.loads(call.arguments)["city"]
    assert isinstance(city, str) and city and calling.status == "completed"
    assert calling.tool_choice == "required" and calling.tools[0].name == "get_weather"
    function = {"name": "get_weather", "arguments": call.arguments}
    history = [
        said("system", BRIEF),
        said("user", ASKED[0]),
        said("assistant", first.output_text),
        said("user", ASKED[1]),
        said("assistant", None, tool_calls=[{"id": call.call_id, "type": "function", "function": function}]),
        said("tool", RESULT, tool_call_id=call.call_id),
    ]
    tools = [{"type": "function", "function": FUNCTION}]
    chat = truth(base_url, model_name, history, 8, tools=tools, tool_choice="none", parallel_tool_calls=False)
    assert answering.output_text == chat.choices[0].message.content and answering.output[0].type == "message"


def test_item_references_are_the_items_they_name(conversations):
    """The conversation sent as references is the one kept by previous_response_id: the same prompts, the same
    answers (the references resolved to their user messages, answers, function call and its output)."""
    chained, referred = ([t.response for t in turns] for turns in conversations.values())
    assert [r.usage.input_tokens for r in referred] == [r.usage.input_tokens for r in chained]
    assert [r.output_text for r in referred] == [r.output_text for r in chained]
    assert json.loads(referred[1].output[0].arguments) == json.loads(chained[1].output[0].arguments)


def test_input_items_are_listed_in_pages(kept_url, conversations):
    """A response's input items, each with its id (a referred item's is the id it was kept with), in
    OpenAI's list: newest first by default, `limit` at a time after `after`, typed by the SDK."""
    turns, client = [t.response for t in conversations["referred"]], sdk(kept_url, "referred")
    everything = client.responses.input_items.list(turns[-1].id, order="asc", limit=100)
    items = everything.data
    kinds = ["ResponseInputMessageItem", "ResponseOutputMessage", "ResponseInputMessageItem"]
    kinds += ["ResponseFunctionToolCallItem", "ResponseFunctionToolCallOutputItem", "ResponseOutputMessage"]
    assert [type(i).__name__ for i in items] == [*kinds, "ResponseInputMessageItem"]
    assert [i.id for i in (items[1], items[3], items[5])] == [t.output[0].id for t in turns[:3]]
    assert [i.text for i in (items[0].content[0], items[1].content[0])] == [ASKED[0], turns[0].output_text]
    assert (items[3].call_id, items[4].call_id, items[4].output) == (turns[1].output[0].call_id,) * 2 + (RESULT,)
    assert items[-1].content[0].text == ASKED[2] and items[-1].id.startswith("msg_") and items[4].id[:4] == "fco_"
    assert (everything.first_id, everything.last_id, everything.has_more) == (items[0].id, items[-1].id, False)
    newest = client.responses.input_items.list(turns[-1].id, limit=3)  # desc by default
    assert [i.id for i in newest.data] == [i.id for i in items[::-1][:3]] and newest.has_more
    assert [i.id for i in newest] == [i.id for i in items[::-1]]  # every page: the SDK follows `after`
    tail = client.responses.input_items.list(turns[-1].id, order="asc", after=items[4].id)
    assert [i.id for i in tail.data] == [i.id for i in items[5:]] and not tail.has_more
    (only,) = client.responses.input_items.list(turns[0].id).data
    assert (only.role, only.status, only.content[0].type) == ("user", "completed", "input_text")


LISTED_BAD = [
    ({"limit": 0}, "limit"),
    ({"limit": 101}, "limit"),
    ({"limit": "many"}, "limit"),
    ({"order": "sideways"}, "order"),
    ({"include": "message.input_image.image_url"}, "include"),
    ({"after": "msg_unknown"}, "after"),
]


@pytest.mark.parametrize(("query", "param"), LISTED_BAD, ids=[p for _, p in LISTED_BAD])
def test_what_input_items_cannot_list_is_a_400_naming_the_param(kept_url, conversations, query, param):
    first = conversations["chained"][0].response
    r = loopback.get(f"{kept_url}/v1/responses/{first.id}/input_items", params=query, headers=CHAINED)
    assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.text


def test_an_unknown_item_is_a_404_naming_it(kept_url, model_name, conversations):
    kept = conversations["chained"][0].response.output[0].id
    asked = {"model": model_name, "input": [said("user", "Hi."), ref(kept), {"id": "msg_gone"}], "max_output_tokens": 2}
    r = loopback.post(kept_url + "/v1/responses", json=asked, headers=CHAINED, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 404 and (error["param"], error["code"]) == ("input.2.id", "item_not_found"), error
    assert error["message"] == "Item with id 'msg_gone' not found."
    twice = {**asked, "input": [ref(kept), ref(kept)]}
    r = loopback.post(kept_url + "/v1/responses", json=twice, headers=CHAINED, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.1.id"
    with pytest.raises(openai.NotFoundError):
        sdk(kept_url, "chained").responses.input_items.list("resp_unknown")


def test_a_turn_continues_through_another_front_on_one_redis(settings, engine, redis_url, model_name):
    """Two fronts on one Redis: the second turn, sent to the other front, continues the first's conversation
    (its messages and its chain's program), and either front shows or deletes it."""
    off = {"semantic_cache": {"enabled": False}, "agents": {"implicit_programs": False}}  # a program: the chain's
    shared = settings.model_copy(update={"redis_url": redis_url, **off})
    with serving(shared, engine) as one, serving(shared, engine) as two:
        a, b = sdk(one, "tok-fleet"), sdk(two, "tok-fleet")
        first = a.responses.create(
            model=model_name, instructions=BRIEF, input="Name a river in Egypt.", max_output_tokens=8, temperature=0
        )
        again = {"instructions": BRIEF, "input": "And in Brazil?", "max_output_tokens": 8, "temperature": 0}
        raw = b.responses.with_raw_response.create(model=model_name, previous_response_id=first.id, **again)
        second = raw.parse()
        assert second.previous_response_id == first.id
        assert raw.headers["x-kvgate-program-id"] == "responses:" + first.id.removeprefix("resp_")  # its chain
        assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
        assert b.responses.retrieve(first.id).output_text == first.output_text
        (asked,) = b.responses.input_items.list(first.id).data  # the input items too, with their ids
        (again_asked,) = a.responses.input_items.list(second.id).data
        items = [ref(i) for i in (asked.id, first.output[0].id, again_asked.id, second.output[0].id)]
        items.append(said("user", "And in Chile?"))
        raw = a.responses.with_raw_response.create(model=model_name, **again | {"input": items})  # by reference
        assert raw.headers["x-kvgate-program-id"] == "responses:" + first.id.removeprefix("resp_")
        assert raw.parse().usage.input_tokens_details.cached_tokens >= 0.8 * second.usage.input_tokens
        with pytest.raises(openai.NotFoundError):
            sdk(two, "tok-other").responses.retrieve(first.id)  # another tenant, whichever front
        with pytest.raises(openai.NotFoundError, match=asked.id):
            sdk(two, "tok-other").responses.create(model=model_name, **again | {"input": items})
        b.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            a.responses.retrieve(first.id)


def test_a_response_is_its_tenants_alone(settings, engine, model_name):
    keyed = settings.model_copy(update={"security": {"api_keys": {"sk-alpha": "alpha", "sk-beta": "beta"}}})
    with serving(keyed, engine) as url:
        alpha, beta = sdk(url, "sk-alpha"), sdk(url, "sk-beta")
        mine = alpha.responses.create(model=model_name, input="Say hi.", max_output_tokens=4)
        with pytest.raises(openai.NotFoundError) as refused:
            beta.responses.create(model=model_name, input="Go on.", previous_response_id=mine.id, max_output_tokens=4)
        assert refused.value.body["code"] == "previous_response_not_found"
        assert refused.value.body["param"] == "previous_response_id"
        for touch in (beta.responses.retrieve, beta.responses.delete, beta.responses.input_items.list):
            with pytest.raises(openai.NotFoundError):
                touch(mine.id)
        (asked,) = alpha.responses.input_items.list(mine.id).data
        for item in (asked.id, mine.output[0].id):  # alpha's items are no items to beta
            with pytest.raises(openai.NotFoundError) as refused:
                beta.responses.create(model=model_name, input=[ref(item)], max_output_tokens=4)
            assert (refused.value.body["code"], refused.value.body["param"]) == ("item_not_found", "input.0.id")
        alpha.responses.create(model=model_name, input=[ref(asked.id)], max_output_tokens=1)  # but to alpha
        assert alpha.responses.retrieve(mine.id).output_text == mine.output_text
        alpha.responses.delete(mine.id)
        with pytest.raises(openai.NotFoundError):
            alpha.responses.retrieve(mine.id)
        unkept = alpha.responses.create(model=model_name, input="Say hi.", max_output_tokens=4, store=False)
        with pytest.raises(openai.NotFoundError):
            alpha.responses.create(
                model=model_name, input="Go on.", previous_response_id=unkept.id, max_output_tokens=4
            )
        with pytest.raises(openai.NotFoundError):
            alpha.responses.input_items.list(unkept.id)
        with pytest.raises(openai.NotFoundError, match=unkept.output[0].id):  # nor are its items kept
            alpha.responses.create(model=model_name, input=[ref(unkept.output[0].id)], max_output_tokens=4)


BAD = [
    ({"input": [said("user", [{"type": "input_image", "image_url": "http://x/y.png"}])]}, "input.0.content.0.type"),
    ({"input": ["hi"]}, "input"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input.0.type"),
    ({"input": [{"role": "tool", "content": "hi"}]}, "input.0.role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
    ({"input": []}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "name": "has space"}]}, "tools.0.name"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "has space", "schema": {}}}}, "text.format.name"),
    ({"temperature": 3}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
]


@pytest.mark.parametrize(("fields", "param"), BAD, ids=[p for _, p in BAD])
def test_what_cannot_be_honoured_is_a_400_naming_the_param(base_url, model_name, fields, param):
    r = loopback.post(base_url + "/v1/responses", json={"model": model_name, "input": "hi", **fields}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error


def test_a_function_call_streams_its_arguments(client, model_name):
    named = {"type": "function", "name": "get_weather"}
    ask = {"tools": WEATHER, "tool_choice": named, "parallel_tool_calls": False, "temperature": 0}
    with client.responses.stream(model=model_name, input="What is the weather in Rome?", **ask) as stream:
        events = list(stream)
        final = stream.get_final_response()
    (call,) = final.output
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == call.arguments and json.loads(call.arguments)["city"]
    ending = ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e.type for e in events][-3:] == ending
    assert events[2].item.type == "function_call" and events[2].item.call_id == call.call_id


def test_documents_and_kvgate_options_reach_the_chat_side(client, model_name):
    doc = {"text": "Oriel Thatchwood was a writer and cartographer, educated at Quenmere College, Vellmoor."}
    extra = {"documents": [doc], "kvgate": {"reuse": "naive"}}
    for _ in range(2):
        raw = client.responses.with_raw_response.create(
            model=model_name, input="Where was Oriel Thatchwood educated?", max_output_tokens=4, extra_body=extra
        )
    assert raw.headers["x-kvgate-reuse"] == "naive"
    reused = int(raw.headers["x-kvgate-reused-tokens"])
    assert reused > 0 and raw.parse().usage.input_tokens_details.cached_tokens == reused


# ---- proxy mode: an upstream that speaks chat completions ----------------------------------------------------


@pytest.fixture(scope="module")
def stub() -> Iterator[str]:
    with serve_upstream(models=("stub-a",)) as url:
        yield url


def front(tmp_path: Path, upstream: str, semantic: bool = False) -> Settings:
    upstreams = [{"name": "up-0", "base_url": upstream + "/v1", "models": ["stub-a"]}]
    return Settings(proxy={"upstreams": upstreams}, semantic_cache={"enabled": semantic}, cache_dir=tmp_path)


def sent(upstream: str) -> dict[str, Any]:
    return loopback.get(upstream + "/_stats").json()["last_body"]


def test_in_proxy_mode_a_chat_upstream_answers(tmp_path, stub):
    loopback.post(stub + "/_reset")
    with serving(front(tmp_path, stub), None) as url:
        first = sdk(url).responses.create(model="stub-a", instructions="Be brief.", input="hello")
        assert (first.output_text, first.status, first.usage.output_tokens) == (STUB_ANSWER, "completed", 8)
        assert sent(stub)["messages"] == [said("system", "Be brief."), said("user", "hello")]
        again = {"input": "again", "previous_response_id": first.id, "stream": True}
        events = list(sdk(url).responses.create(model="stub-a", **again))
        assert events[-1].type == "response.completed" and events[-1].response.output_text == STUB_ANSWER
        assert events[-1].response.usage.output_tokens == 8
        assert [m["content"] for m in sent(stub)["messages"]] == ["hello", STUB_ANSWER, "again"]
        text = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}
        call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
        result = {"type": "function_call_output", "call_id": "c1", "output": "done"}
        sdk(url).responses.create(model="stub-a", input=[said("user", "hi"), text, call, result])
        tool_calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
        answered = [said("assistant", "ok", tool_calls=tool_calls), said("tool", "done", tool_call_id="c1")]
        assert sent(stub)["messages"] == [said("user", "hi"), *answered]  # text and calls: one chat message
        loopback.post(stub + "/_script", json={"actions": [{"drop_after": 2}]})
        events = list(sdk(url).responses.create(model="stub-a", input="hello", stream=True))
        assert events[-1].type == "response.failed" and events[-1].response.status == "failed"
        assert "failed mid-stream" in events[-1].response.error.message
        loopback.post(stub + "/_script", json={"actions": [{"status": 400}]})
        with pytest.raises(openai.BadRequestError, match="Scripted failure 400"):
            sdk(url).responses.create(model="stub-a", input="hello")


def test_the_semantic_cache_answers_responses_as_it_answers_chat(tmp_path, stub):
    loopback.post(stub + "/_reset")
    with serving(front(tmp_path, stub, semantic=True), None) as url:
        ask = {"model": "stub-a", "input": "What is the capital of France?", "temperature": 0}
        assert sdk(url).responses.with_raw_response.create(**ask).headers["x-kvgate-cache"] == "miss"
        again = sdk(url).responses.with_raw_response.create(**ask, stream=True)
        assert again.headers["x-kvgate-cache"] == "hit"
        assert list(again.parse())[-1].response.output_text == STUB_ANSWER
    assert loopback.get(stub + "/_stats").json()["requests"] == 1


# ---- the OpenAI Agents SDK, its default model: OpenAIResponsesModel ---------------------------------------------

AGENT_RUN = """
import asyncio, json, os, sys

assert os.environ["KVGATE_REPO"] not in sys.path and "" not in sys.path, sys.path

from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_client, set_tracing_disabled
from agents.models.multi_provider import MultiProvider
from openai import AsyncOpenAI
from openai.types.responses import ResponseTextDeltaEvent

set_tracing_disabled(True)
client = AsyncOpenAI(base_url=os.environ["KVGATE_URL"] + "/v1", api_key="agents", max_retries=0, timeout=120)
set_default_openai_client(client, use_for_tracing=False)
MODEL, calls = os.environ["KVGATE_MODEL"], []


@function_tool
def get_weather(city: str) -> str:
    \"\"\"The weather in a city.\"\"\"
    calls.append(city)
    return f"Sunny in {city}, 22 C."


async def text():
    settings = ModelSettings(temperature=0, max_tokens=48)
    brief = "You answer in one short sentence."
    agent = Agent(name="assistant", instructions=brief, model=MODEL, model_settings=settings)
    done = await Runner.run(agent, "What is the capital of France?", max_turns=1)
    streamed = Runner.run_streamed(agent, "What is the capital of Italy?", max_turns=1)
    deltas = [
        e.data.delta async for e in streamed.stream_events()
        if e.type == "raw_response_event" and isinstance(e.data, ResponseTextDeltaEvent)
    ]
    model = type(MultiProvider().get_model(MODEL)).__name__
    ids = [r.response_id for r in done.raw_responses + streamed.raw_responses]
    said = {"final": done.final_output, "deltas": "".join(deltas), "streamed": streamed.final_output}
    return {"model": model, "ids": ids, **said}


async def tool():
    settings = ModelSettings(temperature=0, max_tokens=48, tool_choice="required", parallel_tool_calls=False)
    brief = "You report the weather."
    agent = Agent(name="weather", instructions=brief, model=MODEL, tools=[get_weather], model_settings=settings)
    done = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    cached = [r.usage.input_tokens_details.cached_tokens for r in done.raw_responses]
    return {"calls": calls, "final": done.final_output, "cached": cached}


print(json.dumps(asyncio.run({"text": text, "tool": tool}[sys.argv[1]]())))
"""


def run_agent(base_url: str, model_name: str, tmp_path: Path, mode: str) -> dict[str, Any]:
    env = {**os.environ, "KVGATE_URL": base_url, "KVGATE_MODEL": model_name, "KVGATE_REPO": str(ROOT)}
    env["OPENAI_AGENTS_DISABLE_TRACING"] = "1"  # nothing but loopback can be reached
    done = subprocess.run(
        [sys.executable, "-I", "-c", AGENT_RUN, mode],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_agent_answers_on_the_agents_sdks_default_responses_model(base_url, model_name, tmp_path):
    seen = run_agent(base_url, model_name, tmp_path, "text")
    assert seen["model"] == "OpenAIResponsesModel"
    assert len(seen["ids"]) == 2 and all(i.startswith("resp_") for i in seen["ids"])  # the Responses API answered
    assert isinstance(seen["final"], str) and seen["final"].strip()
    assert seen["deltas"].strip() and seen["deltas"] == seen["streamed"]


def test_an_agent_calls_a_function_tool_and_finishes(base_url, model_name, tmp_path):
    """tool_choice required for the first turn; the SDK resets it after the call, and the model answers."""
    seen = run_agent(base_url, model_name, tmp_path, "tool")
    assert len(seen["calls"]) == 1 and seen["calls"][0].strip()  # the Python tool ran, with the model's argument
    assert isinstance(seen["final"], str) and seen["final"].strip()
    assert len(seen["cached"]) == 2 and seen["cached"][1] > 0  # the second turn continued the first's KV
