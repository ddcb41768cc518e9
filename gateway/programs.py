"""Agent programs at the gateway: the program id of a request, from its header `x-kvgate-program-id`
or its body's `kvgate.program_id`."""

from __future__ import annotations

import re
from typing import Any

from kvgate.gateway.errors import bad_request

HEADER = "x-kvgate-program-id"
PROGRAM_ID = re.compile(r"^[A-Za-z0-9._:/@+=-]{1,256}$")


def program_of(header: str | None, body: dict[str, Any]) -> str | None:
    """The program id of a request: its header `x-kvgate-program-id` (`header`, None where it has none), or
    its body's kvgate.program_id. An error names what the caller sent: the header by its name, the body's
    field by its path."""
    options = body.get("kvgate") if isinstance(body.get("kvgate"), dict) else {}
    given = options.get("program_id")
    if header is not None and given is not None and header != given:
        raise bad_request(f"the {HEADER} header and kvgate.program_id differ", HEADER)
    program, sent = (header, HEADER) if header is not None else (given, "kvgate.program_id")
    if program is not None and not (isinstance(program, str) and PROGRAM_ID.match(program)):
        said = f"{sent}: a program id is 1 to 256 letters, digits or ._:/@+=- characters"
        raise bad_request(said, sent, "invalid_value")
    return program
