"""runtime/planner.py's request shape."""

from __future__ import annotations

import pytest

from kvgate.runtime.planner import Chat


def test_a_chat_takes_everything_but_its_messages_by_name() -> None:
    messages = [{"role": "user", "content": "Who kept the lamp?"}]
    assert Chat(messages, documents=[{"text": "Agnes kept it."}]).tools is None
    with pytest.raises(TypeError):  # documents in second place would have been read as tools
        Chat(messages, [{"text": "Agnes kept it."}])  # type: ignore[misc]
