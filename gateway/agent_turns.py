"""Agent programs at the local backend: the program a chat request's turn belongs to (named by the
client, or found by the history it resends), the pins its context gets while its tools run, and what
is remembered when the turn ends, so the next one finds it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from prometheus_client.core import Metric

from kvgate.agents import Expirer, Programs, Turn
from kvgate.gateway.conversation_index import conversation_index
from kvgate.gateway.metrics import counter, gauge
from kvgate.gateway.settings import Settings
from kvgate.gateway.tool_times import RedisToolTimes
from kvgate.gateway.toolcalls import CallStream, message
from kvgate.runtime.costs import EngineCosts
from kvgate.runtime.engine import Engine

Messages = list[dict[str, Any]]
Ended = Callable[[str | None], Awaitable[None]]  # the turn is over: the first choice's answer, None if it failed


class AgentTurns:
    """The local engine's agent programs: turns begin and end here; the programs' registry pins and
    expires their contexts (agents/programs.py), and counts them in flight at the engine's door."""

    def __init__(self, settings: Settings, engine: Engine) -> None:
        config = self.config = settings.agent_config()
        self.tool_times = RedisToolTimes(settings.redis_url, max_tools=config.max_tools) if settings.redis_url else None
        costs = EngineCosts(engine, config.reload_bytes_per_s)
        self.programs = Programs(config, engine.store, costs, shared=self.tool_times, flight=engine.flight)
        self.expirer = Expirer(self.programs)
        self.conversations = conversation_index(settings.redis_url, config.conversations, settings.proxy.route_ttl_s)

    async def begin(
        self, program: str | None, tenant: str, tools: Messages | None, messages: Messages, prompt_tokens: int
    ) -> Turn | None:
        """The turn of a request: of the program it names, else of the one it continues; None: of none."""
        program = program or await self.continued(tenant, tools, messages)
        return None if program is None else self.programs.begin(program, tenant, messages, prompt_tokens)

    async def continued(self, tenant: str, tools: Messages | None, messages: Messages) -> str | None:
        """A program for a request that named none: the one whose answered turn its messages resend,
        else a new one when a later request may resend this one's (it has tools, or a history)."""
        if not self.config.implicit_programs:
            return None
        found = await self.conversations.find(tenant, tools, messages)
        if found is None and (tools or any(m["role"] == "assistant" for m in messages)):
            found = "conv-" + uuid.uuid4().hex
        return found

    def ender(
        self,
        tenant: str,
        turn: Turn | None,
        tools: Messages | None,
        messages: Messages,
        calls: Callable[[], CallStream] | None,
    ) -> Ended:
        async def end(text: str | None) -> None:
            """The turn is over (its context kept or not; `text`: the first choice's answer, None when
            it failed); off the event loop, as a lower tier may be remote."""
            if turn is None:
                return
            answer: dict[str, Any] | None = None
            if text is not None:
                answer = message(calls(), text) if calls is not None else {"role": "assistant", "content": text}
            more = answer is None or bool(answer.get("tool_calls"))  # a failed turn may be retried
            await asyncio.to_thread(self.programs.end, tenant, turn, more)
            if answer is not None and turn.keep:
                await self.conversations.remember(tenant, tools, messages, answer, turn.program)

        return end

    def metrics(self) -> Iterator[Metric]:
        programs = self.programs.stats()
        yield gauge("kvgate_programs", "agent programs seen recently", programs["programs"])
        yield gauge("kvgate_pinned_programs", "agent programs whose context is pinned", programs["pinned"])
        yield counter("kvgate_program_turns", "agent turns ended", programs["turns_ended"])
        yield counter("kvgate_tool_returns", "agent turns that followed a tool call", programs["tool_returns"])
        yield gauge("kvgate_programs_in_flight", "agent programs admitted and not ended", programs["in_flight"])
        if (limit := programs["in_flight_limit"]) is not None:
            yield gauge("kvgate_programs_in_flight_limit", "programs in flight a new one waits behind", limit)

    async def close(self) -> None:
        self.expirer.close()
        await self.conversations.close()
        if self.tool_times is not None:
            self.tool_times.close()
