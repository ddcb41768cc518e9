"""Tool calls without a server: how tools are shown to a model (runtime/tools.py), what a grammar
lets it write (runtime/grammar.py), and how its text becomes OpenAI's tool calls
(gateway/toolcalls.py), whole or in stream deltas split anywhere."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import jsonschema
import pytest
import torch

from kvgate.agents import Conversations
from kvgate.gateway.protocol import ChatCompletionRequest
from kvgate.gateway.toolcalls import CallStream, constraint, message
from kvgate.runtime.errors import GrammarError
from kvgate.runtime.grammar import Calls, Grammars, calls_grammar, json_grammar
from kvgate.runtime.tools import HERMES, KVGATE, LLAMA3_JSON, call_text, detect, prepare

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
NAMES = frozenset({"get_weather", "noop"})
ANSWER = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n</tool_call>\n<tool_call>\n'
    '{"name": "noop", "arguments": {}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def grammars(loaded) -> Grammars:
    return Grammars(loaded.tokenizer, loaded.eos_token_ids)


def deltas_of(stream: CallStream, text: str, rng: random.Random) -> list[dict]:
    out, i = [], 0
    while i < len(text):
        j = i + rng.randint(1, 7)
        out += stream.feed(text[i:j])
        i = j
    return out + stream.end()


def joined(deltas: list[dict]) -> tuple[str, dict[int, dict]]:
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", ()):
            call = calls.setdefault(c["index"], {"name": None, "arguments": ""})
            call["name"] = c["function"].get("name") or call["name"]
            call["arguments"] += c["function"]["arguments"]
    return content, calls


@pytest.mark.parametrize("incremental", [True, False])
def test_a_stream_split_anywhere_gives_the_whole_answers_calls(incremental):
    whole = message(CallStream(KVGATE, NAMES, incremental), ANSWER)
    assert whole["content"] == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["tool_calls"]] == [
        ("get_weather", {"city": "Zürich", "days": 2}),
        ("noop", {}),
    ]
    rng = random.Random(7)
    for _ in range(100):
        deltas = deltas_of(CallStream(KVGATE, NAMES, incremental), ANSWER, rng)
        content, calls = joined(deltas)
        assert content.strip() == "Let me check."
        assert [c["arguments"] for c in calls.values()] == [c["function"]["arguments"] for c in whole["tool_calls"]]
        first = next(d for d in deltas if "tool_calls" in d)["tool_calls"][0]
        assert first["id"].startswith("call_") and first["function"] == {"name": "get_weather", "arguments": ""}


def test_a_held_call_ends_after_its_arguments_even_when_a_string_holds_the_end_tag():
    text = '<tool_call>\n{"name": "noop", "arguments": {"a": "</tool_call>"}}\n</tool_call>'
    for split in (False, True):
        stream = CallStream(KVGATE, NAMES, incremental=True)
        deltas = deltas_of(stream, text, random.Random(2)) if split else stream.feed(text) + stream.end()
        content, calls = joined(deltas)
        assert content == "" and [c["arguments"] for c in calls.values()] == ['{"a": "</tool_call>"}']


def test_incremental_arguments_stream_before_the_call_closes():
    stream = CallStream(KVGATE, NAMES, incremental=True)
    early = stream.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 30, "x": 1')
    assert joined(early)[1][0]["arguments"].startswith('{"city": "Paris"')


def test_bad_json_an_unknown_function_or_an_unclosed_call_is_plain_text():
    for text in (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',
        "The answer is <tool_ca",
    ):
        said = message(CallStream(KVGATE, NAMES, incremental=False), text)
        assert said == {"role": "assistant", "content": text}


@pytest.mark.parametrize(
    ("text", "arguments"),
    [
        ('{"a": "b', '{"a": "b'),  # cut inside its arguments: they stay cut, as OpenAI's do
        ('{"a": "b"}}\n</tool_', '{"a": "b"}'),  # cut inside the closing markup: none of it leaks
        ('{"a": "b"}}\n</tool_call>\n<tool_call>\n{"name": "no', '{"a": "b"}'),  # a second call cut before its name
    ],
)
def test_a_call_cut_short_keeps_what_the_model_wrote_and_nothing_else(text, arguments):
    opened = '<tool_call>\n{"name": "noop", "arguments": '
    rng = random.Random(5)
    for split in (False, True):
        stream = CallStream(KVGATE, NAMES, incremental=True)
        deltas = deltas_of(stream, opened + text, rng) if split else stream.feed(opened + text) + stream.end()
        content, calls = joined(deltas)
        assert content == "" and [c["arguments"] for c in calls.values()] == [arguments]


def test_llama3_json_calls_are_bare_json_with_parameters():
    text = '{"name": "noop", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}'
    said = message(CallStream(LLAMA3_JSON, NAMES, incremental=False), text)
    assert [c["function"]["name"] for c in said["tool_calls"]] == ["noop", "get_weather"]
    assert message(CallStream(LLAMA3_JSON, NAMES, False), "It is sunny.")["content"] == "It is sunny."


def test_kvgate_format_renders_tools_calls_and_results_into_plain_messages():
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "tool", "content": "warm", "tool_call_id": "c2"},
    ]
    shown, tools = prepare(KVGATE, messages, TOOLS)
    assert tools is None
    assert shown[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "get_weather"' in shown[0]["content"]
    assert shown[2] == {"role": "assistant", "content": call_text(KVGATE, "get_weather", {"city": "Zürich"})}
    assert "Zürich" in shown[2]["content"]  # as the model writes it: not \\u-escaped
    assert shown[3] == {
        "role": "user",
        "content": "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response>",
    }
    assert prepare(HERMES, messages, TOOLS) == (messages, TOOLS)  # a template that renders tools gets them


def test_the_default_models_template_ignores_tools_so_kvgate_renders_them(loaded):
    assert detect(loaded.tokenizer) == KVGATE


def test_forced_calls_validate_against_their_schema_whatever_the_sampler_picks(grammars, loaded):
    """The mask alone (random allowed tokens, no model) keeps every forced call valid."""
    grammar = grammars.compile(calls_grammar(KVGATE, Calls({"get_weather": WEATHER}, True, False)))
    rng = random.Random(3)
    for _ in range(20):
        matcher, out = grammars.matcher(grammar), []
        for _ in range(120):
            allowed = grammars.masks([matcher], len(loaded.tokenizer))[0].nonzero().flatten().tolist()
            token = rng.choice(allowed)
            if token in loaded.eos_token_ids:
                break
            assert matcher.consume_token(token)
            out.append(token)
        said = message(CallStream(KVGATE, NAMES, True), loaded.tokenizer.decode(out))
        if matcher.is_accepting():
            jsonschema.validate(json.loads(said["tool_calls"][0]["function"]["arguments"]), WEATHER)


def test_auto_lets_text_through_until_a_call_opens_then_holds_it(grammars, loaded):
    grammar = grammars.compile(calls_grammar(KVGATE, Calls({"get_weather": WEATHER}, False, True)))
    matcher = grammars.matcher(grammar)
    for token in loaded.tokenizer.encode("Sure, one moment.\n<tool_call>\n", add_special_tokens=False):
        assert matcher.consume_token(token)
    allowed = grammars.masks([matcher], len(loaded.tokenizer))[0].nonzero().flatten().tolist()
    assert [loaded.tokenizer.decode([t]) for t in allowed] == ['{"']


def test_masks_cover_a_padded_vocabulary_and_never_allow_its_padding(grammars, loaded):
    matcher = grammars.matcher(grammars.compile(json_grammar({"type": "object"})))
    width = len(loaded.tokenizer) + 64
    mask = grammars.masks([matcher, grammars.matcher(grammars.compile(json_grammar({"type": "object"})))], width)
    assert mask.shape == (2, width) and not mask[:, len(loaded.tokenizer) :].any()
    assert torch.equal(mask[0], mask[1]) and 0 < int(mask[0].sum()) < 100


def test_a_schema_llguidance_cannot_compile_is_a_grammar_error(grammars):
    with pytest.raises(GrammarError):
        grammars.compile(json_grammar({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}))


def test_the_request_decides_the_grammar():
    def body(**more) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "x"}]} | more
        )

    assert constraint(body(), KVGATE) == (None, False)
    assert constraint(body(tools=TOOLS, tool_choice="none"), KVGATE) == (None, False)
    named = constraint(body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}), KVGATE)
    assert named[1] and "TEXT" not in named[0]
    auto = constraint(body(tools=TOOLS), KVGATE)
    assert auto[1] and "lazy" in auto[0]
    assert constraint(body(response_format={"type": "json_object"}), KVGATE)[0].count("%json") == 1
    assert constraint(body(tools=TOOLS), LLAMA3_JSON) == (None, False)  # no tag to trigger on: parsed after


def test_conversations_find_the_answered_turn_a_request_resends_per_tenant_and_bounded():
    turns = Conversations(capacity=2)
    asked = [{"role": "user", "content": "Weather?"}]
    answer = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}],
    }
    turns.remember("t1", TOOLS, asked, answer, "p1")
    # Resent as a framework does: other ids, arguments re-serialised, content "" for None.
    resent = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "x", "function": {"name": "f", "arguments": {"a": 1}}}],
    }
    then = [*asked, resent, {"role": "tool", "content": "sunny", "tool_call_id": "x"}]
    assert turns.find("t1", TOOLS, then) == "p1"
    assert turns.find("t2", TOOLS, then) is None  # another tenant
    assert turns.find("t1", None, then) is None  # other tools: another prompt
    changed = [*asked, {**resent, "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 2}'}}]}, then[2]]
    assert turns.find("t1", TOOLS, changed) is None
    turns.remember("t1", TOOLS, [{"role": "user", "content": "a"}], {"role": "assistant", "content": "b"}, "p2")
    turns.remember("t1", TOOLS, [{"role": "user", "content": "c"}], {"role": "assistant", "content": "d"}, "p3")
    assert len(turns) == 2 and turns.find("t1", TOOLS, then) is None  # the oldest went first


TEMPLATES = Path(__file__).parents[1] / "helpers" / "templates"


@pytest.mark.parametrize(
    ("template", "fmt"),
    [("qwen2.5", HERMES), ("qwen3", HERMES), ("llama3.1", LLAMA3_JSON), ("mistral-nemo", KVGATE)],
)
def test_real_templates_render_tools_and_calls_as_the_model_writes_them(loaded, template, fmt):
    """Qwen's templates write Hermes calls, Llama 3.1's bare JSON with "parameters"; a call rendered
    back into the prompt is the very text constrained decoding makes the model write. Mistral's
    template wants its own ids and [TOOL_CALLS] lists: kvgate renders its tools in its own format."""
    tokenizer = copy.copy(loaded.tokenizer)
    tokenizer.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    assert detect(tokenizer) == fmt
    call = {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
    messages = [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call12345"},
    ]
    shown, tools = prepare(fmt, messages, TOOLS)
    text = tokenizer.apply_chat_template(shown, tools=tools, tokenize=False, add_generation_prompt=True)
    assert "get_weather" in text and '"maxLength": 16' in text  # the tool's schema is shown
    assert call_text(fmt, "get_weather", {"city": "Zürich"}).strip() in text
    said = message(CallStream(fmt, NAMES, incremental=False), call_text(fmt, "get_weather", {"city": "Zürich"}))
    assert said["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Zürich"}'}
