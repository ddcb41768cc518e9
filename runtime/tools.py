"""Tools as a model sees them: in its chat template's own format, or in kvgate's.

A chat template that renders `tools` and assistant `tool_calls` itself (Qwen2.5, Qwen3, Llama 3.1)
gets them as they are, and its answers are parsed in its format. A template that ignores them
(the default model's) gets kvgate's format, Hermes-style, rendered into ordinary messages:

- the tools: a system message (the first one, extended) listing each as JSON in <tools></tools>
  and asking for calls as <tool_call>{"name": ..., "arguments": {...}}</tool_call>;
- an assistant's tool calls: that very text, in its content;
- tool results: a user message of <tool_response>...</tool_response> blocks.

Arguments are always written `json.dumps(..., ensure_ascii=False)` (what the templates' `tojson`
writes, and the separators constrained decoding generates), so a call rendered back into the next
prompt gives the tokens the model produced.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

KVGATE_PROMPT = """# Tools

You can call functions to help answer the user. Their signatures, as JSON, are within <tools></tools>:
<tools>
{tools}
</tools>

To call a function, answer with a JSON object holding its name and arguments within <tool_call></tool_call>:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}
</tool_call>
Several calls go one after another. Results come back within <tool_response></tool_response>."""


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes a call: `open` + {"name": ..., <arguments key>: {...}} + `close`."""

    name: str  # "kvgate": kvgate renders tools; "hermes", "llama3_json": the template does
    open: str = "<tool_call>\n"
    close: str = "\n</tool_call>"
    arguments: str = "arguments"
    separator: str = "\n"  # between parallel calls

    @property
    def native(self) -> bool:
        return self.name != "kvgate"


KVGATE = ToolFormat("kvgate")
HERMES = ToolFormat("hermes")
LLAMA3_JSON = ToolFormat("llama3_json", open="", close="", arguments="parameters", separator="; ")


def detect(tokenizer: PreTrainedTokenizerBase) -> ToolFormat:
    """The model's tool format: its template's, when the template renders both a tool and an
    assistant's call to it (probed with a name no real tool has); else kvgate's."""
    template = tokenizer.chat_template
    if not isinstance(template, str):
        return KVGATE
    name = f"probe_{secrets.token_hex(6)}"
    tool = {"type": "function", "function": {"name": name, "description": "", "parameters": {"type": "object"}}}
    call = {"id": "call_0", "type": "function", "function": {"name": name + "_call", "arguments": {}}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "ok", "tool_call_id": "call_0"},
    ]
    try:
        text = tokenizer.apply_chat_template(messages, tools=[tool], tokenize=False, add_generation_prompt=True)
    except Exception:  # a template that rejects tool messages renders them in kvgate's format
        return KVGATE
    if name not in text.replace(name + "_call", "") or name + "_call" not in text:
        return KVGATE
    if "<tool_call>" in template:
        return HERMES
    if '"parameters"' in template or "<|python_tag|>" in template:
        return LLAMA3_JSON
    return KVGATE


def call_text(fmt: ToolFormat, name: str, arguments: dict[str, Any]) -> str:
    """One call as the model writes it."""
    body = {"name": name, fmt.arguments: arguments}
    return fmt.open + json.dumps(body, ensure_ascii=False) + fmt.close


def prepare(
    fmt: ToolFormat, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages and tools for the chat template (assistant calls' arguments already mappings)."""
    if fmt.native:
        return messages, tools
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] in ("tool", "function"):
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("kvgate_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "kvgate_tool_results": True})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = [call_text(fmt, c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            content = "\n".join(x for x in (m.get("content") or "", fmt.separator.join(calls)) if x)
            out.append({"role": "assistant", "content": content})
        else:
            out.append(m)
    out = [{k: v for k, v in m.items() if k != "kvgate_tool_results"} for m in out]
    if tools:
        listing = KVGATE_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{listing}"}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out, None


def partial_suffix(text: str, tag: str, whole: bool = False) -> int:
    """The length of the longest end of `text` that begins `tag` (it may be a tag starting);
    `whole`: the tag itself counts too."""
    for n in range(min(len(tag) - (not whole), len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
