"""A Pydantic AI tool sent once per key through the ledger's Python client (`ledger_client`,
over HTTP; no Django in this process).

    LEDGER_URL=http://127.0.0.1:8000 LEDGER_AGENT_KEY=alk_... ARTICLES_URL=http://.../articles \
        python examples/frameworks/pydantic_ai_tool.py "Tools that act once"

The model is Pydantic AI's `FunctionModel` with a script: it calls the tool twice with the
same arguments (a retry) and then answers. Give `Agent` a real model ("openai:gpt-4.1-mini")
to run it for real. Pydantic AI stops the run on a tool's exception, so the tool returns
`tool_message(error)` instead: the model reads it as the tool's answer.
"""

import asyncio
import os
import sys

import httpx
from ledger_client import Ledger, tool_message
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

ARTICLES_URL = os.environ["ARTICLES_URL"]
ledger = Ledger()  # LEDGER_URL, LEDGER_AGENT_KEY
agent = Agent(instructions="Publish what you are asked to, once.")


class CmsRefused(Exception):
    """The CMS answered 4xx: it created nothing."""


@ledger.action("articles.create", target=ARTICLES_URL, key=lambda title, body: title,
               rejections=(CmsRefused,), external_id=lambda article: article["id"])
async def create_article(title: str, body: str) -> dict:
    async with httpx.AsyncClient(timeout=5) as client:
        response = await client.post(ARTICLES_URL, json={"title": title, "body": body})
    if 400 <= response.status_code < 500:
        raise CmsRefused(f"{response.status_code} {response.text}")
    response.raise_for_status()  # a 5xx: the outcome is unknown, and so recorded
    return response.json()


@agent.tool_plain
async def publish_article(title: str, body: str) -> dict | str:
    """Publish an article on the CMS; returns it with its id.

    Args:
        title: the headline.
        body: the article's text.
    """
    try:
        return await create_article(title, body)
    except Exception as error:
        return tool_message(error)


def scripted_model(title: str) -> FunctionModel:
    """A model that calls the tool, calls it again with the same arguments, then answers."""
    arguments = {"title": title, "body": "Published by a tool call."}

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        calls = sum(isinstance(part, ToolCallPart) for message in messages
                    if isinstance(message, ModelResponse) for part in message.parts)
        if calls < 2:
            return ModelResponse(parts=[ToolCallPart("publish_article", arguments,
                                                     tool_call_id=f"call-{calls + 1}")])
        return ModelResponse(parts=[TextPart("done")])

    return FunctionModel(respond)


async def main(title: str) -> None:
    result = await agent.run("publish", model=scripted_model(title))
    for message in result.all_messages():  # what the model read back from the tool
        for part in getattr(message, "parts", ()):
            if part.part_kind == "tool-return":
                print("tool answered:", part.model_response_str())
    print("final:", result.output)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "Tools that act once"))
