"""runtime/progress.py: long work shows its progress on a terminal, and nothing in a log or a pipe."""

from __future__ import annotations

import io
import os
import pty

from kvgate.runtime.progress import progress


def test_a_terminal_sees_items_done_and_elapsed_a_pipe_nothing() -> None:
    piped = io.StringIO()
    assert list(progress(range(3), "items measured", stream=piped)) == [0, 1, 2]
    assert piped.getvalue() == ""
    master, replica = pty.openpty()
    try:
        with os.fdopen(replica, "w") as terminal:
            assert list(progress(range(3), "items measured", stream=terminal)) == [0, 1, 2]
        shown = os.read(master, 1 << 16).decode()
    finally:
        os.close(master)
    assert "items measured" in shown and "/3 [00:00<" in shown  # done of all, elapsed < what is left
