"""Responses the server keeps, as the openai SDK continues them: a chain by `previous_response_id`, by output items
sent back whole, or by the ids of stored items (`item_reference`); their input items listed in pages; each tenant's
alone; in Redis, through any front. A real uvicorn server on loopback over the real model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from openai.types.responses import Response

from kvgate.gateway.settings import Settings
from tests.helpers import loopback
from tests.helpers.responses import BRIEF, FUNCTION, WEATHER, said, sdk, truth
from tests.helpers.servers import serving


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
