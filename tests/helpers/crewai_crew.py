"""CrewAI's sequential crew against a kvgate server, run by the test in the CrewAI virtualenv (crewai 1.15 needs
the openai SDK below 3, kvgate's test extras pin 3): `python tests/helpers/crewai_crew.py BASE_URL MODEL TOPIC`.

A researcher writes notes; a writer's task gets them as context, which CrewAI pastes inside the writer's own
user message. Prints one JSON line: each chat completion's messages, kvgate's reuse headers and usage, and the
crew's own token usage. It imports nothing from kvgate."""

from __future__ import annotations

import json
import sys
from typing import Any

import httpx
from crewai import LLM, Agent, Crew, Process, Task
from crewai.llms.hooks.base import BaseInterceptor


class Record(BaseInterceptor[httpx.Request, httpx.Response]):
    """CrewAI's transport hook: each request's messages, then its answer's headers and usage."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def on_outbound(self, message: httpx.Request) -> httpx.Request:
        self.calls.append({"messages": json.loads(message.content)["messages"]})
        return message

    def on_inbound(self, message: httpx.Response) -> httpx.Response:
        message.read()
        self.calls[-1].update(
            status=message.status_code,
            reused=int(message.headers.get("x-kvgate-reused-tokens", -1)),
            reuse=message.headers.get("x-kvgate-reuse"),
            usage=message.json().get("usage"),
        )
        return message

    async def aon_outbound(self, message: httpx.Request) -> httpx.Request:
        return self.on_outbound(message)

    async def aon_inbound(self, message: httpx.Response) -> httpx.Response:
        return self.on_inbound(message)


def main(base_url: str, model: str, topic: str) -> None:
    record = Record()

    def llm(max_tokens: int) -> LLM:
        return LLM(
            model=f"openai/{model}", base_url=f"{base_url}/v1", api_key="unused", max_tokens=max_tokens,
            temperature=0, interceptor=record,
        )  # fmt: skip

    researcher = Agent(
        role="Researcher", goal=f"Collect facts about {topic}", backstory="You write thorough notes.", llm=llm(80)
    )
    # The writer's prompt is what is checked; a few words of its answer prove the call went through.
    writer = Agent(role="Writer", goal="Write a short article", backstory="You turn research into prose.", llm=llm(16))
    notes = Task(
        description=f"Write ten numbered facts about {topic}.", expected_output="Ten numbered facts.", agent=researcher
    )
    article = Task(
        description="Write an article's first paragraph from the researcher's notes.",
        expected_output="One paragraph.",
        agent=writer,
        context=[notes],
    )
    crew = Crew(agents=[researcher, writer], tasks=[notes, article], process=Process.sequential)
    out = crew.kickoff()
    print(json.dumps({"calls": record.calls, "notes": notes.output.raw, "usage": out.token_usage.model_dump()}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
