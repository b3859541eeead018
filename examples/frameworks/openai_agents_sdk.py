"""An OpenAI Agents SDK tool (`function_tool`) sent once per key through the ledger's
Python client (`ledger_client`, over HTTP; no Django in this process).

    LEDGER_URL=http://127.0.0.1:8000 LEDGER_AGENT_KEY=alk_... ARTICLES_URL=http://.../articles \
        python examples/frameworks/openai_agents_sdk.py "Tools that act once"

With OPENAI_API_KEY set, gpt-4.1-mini decides when to call the tool. Without it, the SDK's
own test double (`agents.testing.ScriptedModel`) plays a model that calls the tool twice
with the same arguments (a retry) and then answers: the article is published once, and
if the first call's outcome is unknown, both tool answers tell the model not to retry
because the ledger is reconciling the operation.
"""

import asyncio
import os
import sys

import httpx
from agents import Agent, Runner, function_tool, set_tracing_disabled
from agents.testing import ScriptedModel, assistant_message, function_call
from ledger_client import Ledger, tool_message

ARTICLES_URL = os.environ["ARTICLES_URL"]
ledger = Ledger()  # LEDGER_URL, LEDGER_AGENT_KEY


class CmsRefused(Exception):
    """The CMS answered 4xx: it created nothing."""


@function_tool(failure_error_function=lambda context, error: tool_message(error))
@ledger.action("articles.create", target=ARTICLES_URL, key=lambda title, body: title,
               rejections=(CmsRefused,), external_id=lambda article: article["id"])
async def publish_article(title: str, body: str) -> dict:
    """Publish an article on the CMS; returns it with its id.

    Args:
        title: the headline.
        body: the article's text.
    """
    async with httpx.AsyncClient(timeout=5) as client:
        response = await client.post(ARTICLES_URL, json={"title": title, "body": body})
    if 400 <= response.status_code < 500:
        raise CmsRefused(f"{response.status_code} {response.text}")
    response.raise_for_status()  # a 5xx: the outcome is unknown, and so recorded
    return response.json()


def scripted_model(title: str) -> ScriptedModel:
    """A model that calls the tool, calls it again with the same arguments, then answers."""
    arguments = {"title": title, "body": "Published by a tool call."}
    return ScriptedModel([
        [function_call("publish_article", arguments, call_id="call-1")],
        [function_call("publish_article", arguments, call_id="call-2")],
        [assistant_message("done")],
    ])


async def main(title: str) -> None:
    if os.environ.get("OPENAI_API_KEY"):
        model, prompt = "gpt-4.1-mini", f"Publish an article titled {title!r}."
    else:
        set_tracing_disabled(True)
        model, prompt = scripted_model(title), "publish"
    agent = Agent(name="Publisher", instructions="Publish what you are asked to, once.",
                  tools=[publish_article], model=model)
    result = await Runner.run(agent, prompt)
    for item in result.to_input_list():  # what the model read back from the tool
        if item.get("type") == "function_call_output":
            print("tool answered:", item["output"])
    print("final:", result.final_output)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "Tools that act once"))
