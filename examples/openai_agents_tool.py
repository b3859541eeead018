"""An OpenAI Agents SDK tool (`function_tool`) whose side effect happens once per key.

Run it from the project folder (twice: the second run sends nothing):

    .venv/bin/python examples/openai_agents_tool.py

With OPENAI_API_KEY set, a real agent (gpt-4.1-mini) decides when to call the tool.
Without it, the script calls the tool the way the SDK's runner does
(`tool.on_invoke_tool(context, arguments_json)`), so it runs offline. A ledger error (the
outcome of an earlier call is unknown, or it was refused) goes back to the model as the
tool's answer, which says not to send again. ARTICLES_URL as in httpx_client.py.
"""

import asyncio
import json
import os

import django
import httpx
from agents import Agent, Runner, function_tool, set_tracing_disabled
from agents.tool_context import ToolContext

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django.setup()

from ledger import receipts  # noqa: E402

if not os.environ.get("ARTICLES_URL"):  # no service given: the simulated one, for this run
    from demo.simulated.articles import ArticlesService

    os.environ["ARTICLES_URL"] = ArticlesService().start().articles_url
ARTICLES_URL = os.environ["ARTICLES_URL"]


class Refused(Exception):
    """The service answered 4xx: it created nothing."""


def article_key(title: str, body: str) -> str:
    return "tool-" + "-".join(title.lower().split())


@function_tool(failure_error_function=lambda context, error: f"not published: {error}")
@receipts.action("articles.create", target=ARTICLES_URL, key=article_key,
                 rejections=(Refused,), external_id=lambda article: article["id"])
async def publish_article(title: str, body: str) -> dict:
    """Publish an article on the CMS; returns it with its id.

    Args:
        title: the headline.
        body: the article's text.
    """
    async with httpx.AsyncClient(timeout=5) as client:
        response = await client.post(ARTICLES_URL, json={"title": title, "body": body},
                                     headers={"Idempotency-Key": article_key(title, body)})
    if 400 <= response.status_code < 500:
        raise Refused(f"{response.status_code} {response.text}")
    response.raise_for_status()  # a 5xx: the outcome is unknown, and so recorded
    return response.json()


agent = Agent(name="Publisher", instructions="Publish what you are asked to, once.",
              tools=[publish_article], model="gpt-4.1-mini")


async def main() -> None:
    if os.environ.get("OPENAI_API_KEY"):
        result = await Runner.run(agent, "Publish an article titled 'Tools that act once'.")
        print(result.final_output)
        return
    set_tracing_disabled(True)
    for n, title in enumerate(("Tools that act once", "Receipts for tools")):
        arguments = json.dumps({"title": title, "body": "Published by a tool call."})
        context = ToolContext(context=None, tool_name=publish_article.name,
                              tool_call_id=f"call-{n}", tool_arguments=arguments)
        print("tool answered", await publish_article.on_invoke_tool(context, arguments))


if __name__ == "__main__":
    asyncio.run(main())
