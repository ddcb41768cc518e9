"""The OpenAI request bodies kvgate accepts. Unknown fields are accepted and ignored."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from kvgate.gateway.errors import bad_request
from kvgate.gateway.strict import strict

SEED_BOUND = 2**63  # seeds are signed 64-bit integers


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """An explicit null for a field with a default means the default (as OpenAI and vLLM read it)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}


class TextPart(Body):
    type: Literal["text"]
    text: str


class OtherPart(Body):
    type: str


class FunctionCall(Body):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends JSON text; a mapping is accepted too


class ToolCall(Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart | OtherPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a '{self.role}' message needs content")
        return self

    def for_template(self, index: int) -> dict[str, Any]:
        out = self.model_dump(exclude_none=True, exclude={"content"})
        if isinstance(self.content, list):
            parts = []
            for j, part in enumerate(self.content):
                if not isinstance(part, TextPart):
                    raise bad_request(
                        f"content parts of type '{part.type}' are not supported by this model; only 'text'",
                        f"messages.{index}.content.{j}.type",
                        "unsupported_content",
                    )
                parts.append(part.text)
            out["content"] = "\n".join(parts)
        else:
            out["content"] = self.content or ""
        if out["role"] == "developer":  # OpenAI's newer name for the system role
            out["role"] = "system"
        for call in out.get("tool_calls", ()):
            # OpenAI's wire form is JSON text; chat templates expect a mapping. Text that is not
            # JSON (an answer cut short, say) is rendered back as the text it is, as OpenAI takes it.
            arguments = call["function"]["arguments"]
            if isinstance(arguments, str):
                try:
                    call["function"]["arguments"] = json.loads(arguments) if arguments.strip() else {}
                except json.JSONDecodeError:
                    pass
        return out


class StreamOptions(Body):
    include_usage: bool = False


Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class Sampling(Body):
    """Fields shared by chat and text completions."""

    model: str
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # vLLM extension
    seed: int | None = Field(None, ge=-SEED_BOUND, lt=SEED_BOUND)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v is not None and any(s == "" for s in ([v] if isinstance(v, str) else v)):
            raise ValueError("stop strings must not be empty")
        return v

    @model_validator(mode="after")
    def _stream_options(self) -> Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class DocumentRef(Body):
    """A document of a RAG request: its text, or the id `POST /v1/documents` gave it."""

    text: str | None = Field(None, min_length=1)
    id: str | None = None

    @model_validator(mode="after")
    def _one_of(self) -> DocumentRef:
        if (self.text is None) == (self.id is None):
            raise ValueError("a document needs exactly one of 'text' and 'id'")
        return self


class ReuseOptions(Body):
    """kvgate extension: how documents' KV is reused, whether the semantic cache may answer, and
    which agent program the request belongs to."""

    # Documents: how their KV is reused ("kvcomm" is "blend" for them). An agent program's messages
    # that other programs read or wrote: kvcomm unless set; "prefix" reuses its own context only.
    reuse: Literal["full", "prefix", "naive", "blend", "kvcomm"] = "blend"
    recompute_ratio: float | None = Field(None, ge=0.0, le=1.0)
    # None: look up and store temperature-0 requests only; true: also others; false: never.
    cache: bool | None = None
    # The agent program this request is a turn of (or the x-kvgate-program-id header).
    program_id: str | None = None


class DocumentRequest(Body):
    text: str = Field(min_length=1)


class FeedbackRequest(Body):
    """A semantic-cache hit reported wrong: the id of the completion that served it."""

    id: str = Field(min_length=1, max_length=256)


FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class Function(Body):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object; none: no arguments
    strict: bool | None = None  # true: its objects closed, their properties required (gateway/strict.py)

    @model_validator(mode="after")
    def closed(self) -> Function:
        if self.strict and self.parameters is not None:
            self.parameters = strict(self.parameters, "parameters")
        return self


class Tool(Body):
    type: Literal["function"]
    function: Function


class NamedFunction(Body):
    name: str


class NamedTool(Body):
    type: Literal["function"]
    function: NamedFunction


class JsonSchema(Body):
    name: str = Field("response", pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # true: its objects closed, their properties required (gateway/strict.py)

    @model_validator(mode="after")
    def closed(self) -> JsonSchema:
        if self.strict:
            self.schema_ = strict(self.schema_, "schema")
        return self


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema")
        return self


# OpenAI fields kvgate cannot honour: refused with a 400, never ignored.
UNSUPPORTED = {
    "functions": "the deprecated `functions` are not supported; use `tools`",
    "function_call": "the deprecated `function_call` is not supported; use `tool_choice`",
    "audio": "audio output is not supported by this model",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
}


class ChatCompletionRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    documents: list[DocumentRef] | None = Field(None, max_length=256)  # kvgate extension
    kvgate: ReuseOptions | None = None  # kvgate extension
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    modalities: list[Literal["text"]] | None = None
    add_generation_prompt: bool = True  # vLLM extension

    functions: Any = None  # each of UNSUPPORTED: a 400 when given
    function_call: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _unsupported(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None:
            raise ValueError(UNSUPPORTED[str(info.field_name)])
        return v

    @model_validator(mode="after")
    def _logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @field_validator("tools")
    @classmethod
    def _distinct(cls, tools: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in tools or ()]
        if len(set(names)) < len(names):
            raise ValueError("tools must have distinct function names")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, choice: Any, info: ValidationInfo) -> Any:
        names = [t.function.name for t in info.data.get("tools") or ()]
        if choice not in (None, "none", "auto") and not names:
            raise ValueError("'required' or a named function needs tools")
        if isinstance(choice, NamedTool) and choice.function.name not in names:
            raise ValueError(f"the function {choice.function.name!r} is not among the tools")
        return choice

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may hold tool calls (and so is parsed for them)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(Sampling):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo together with logprobs (prompt logprobs) is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be an empty list")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]
