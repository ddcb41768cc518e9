"""The errors a request can meet on the server. Each says how a client should see it: the HTTP status,
OpenAI's `code`, and the request field at fault (`param`). Every layer raises them; the gateway renders
them, once (gateway/errors.py)."""

from __future__ import annotations


class ServerError(Exception):
    status: int = 400
    code: str | None = None
    param: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if param is not None:
            self.param = param
        if code is not None:
            self.code = code

    def at(self, param: str) -> ServerError:
        """This error naming `param` as the field at fault where it named none (the caller knows the request): a
        new one, raised from this."""
        return self if self.param is not None else self.named(param, self.message)

    def named(self, param: str | None, message: str) -> ServerError:
        """The same error with another field at fault and message (as another API names the field)."""
        made = ServerError.__new__(type(self))
        ServerError.__init__(made, message, param, self.code)
        made.__dict__.update({k: v for k, v in vars(self).items() if k not in ("message", "param", "code")})
        return made


class InvalidPrompt(ServerError, ValueError):
    """A prompt the engine cannot take."""

    code = "invalid_value"


class PromptTooLong(InvalidPrompt):
    """The prompt, or the prompt and max_tokens, exceed the context window."""

    code = "context_length_exceeded"


class TemplateError(ServerError, ValueError):
    """Messages the model's chat template cannot render as kvgate needs them."""

    code, param = "invalid_messages", "messages"


class GrammarError(ServerError, ValueError):
    """A grammar (a schema, a tool format) that constrained decoding cannot use, or that allows no token."""


class DocumentNotFound(ServerError, LookupError):
    """No stored document has this id in this scope (or it is another tenant's)."""

    status, code = 404, "document_not_found"

    def __init__(self, document_id: str, index: int | None = None) -> None:
        super().__init__(f"no document with id {document_id!r}", "id" if index is None else f"documents.{index}.id")
        self.document_id, self.index = document_id, index


class EngineError(ServerError, RuntimeError):
    """A step failed; the requests in it end with this error."""

    status, code = 500, "internal_error"


class DataError(ValueError):
    """Not a request's error: a command's data, or the options asking for it, cannot give any item (a usage
    error of `kvgate calibrate` or a benchmark, reported as `kvgate: error: ...`, exit 2)."""
