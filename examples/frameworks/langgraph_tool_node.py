"""A LangGraph tool node whose tool is sent once per key through the ledger's Python client
(`ledger_client`, over HTTP; no Django in this process).

    LEDGER_URL=http://127.0.0.1:8000 LEDGER_AGENT_KEY=alk_... ARTICLES_URL=http://.../articles \
        python examples/frameworks/langgraph_tool_node.py "Tools that act once"

The graph is the usual agent loop: a chat model node, `ToolNode` for its tool calls, and
`tools_condition` between them. The model here is langchain-core's scripted
`FakeMessagesListChatModel`: it calls the tool twice with the same arguments (a retry) and
then answers. Put a real chat model with `.bind_tools([publish_article])` in its place to
run it for real. A ledger error reaches the model as the tool's message
(`handle_tool_errors=tool_message`).
"""

import os
import sys

import httpx
from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from ledger_client import Ledger, tool_message

ARTICLES_URL = os.environ["ARTICLES_URL"]
ledger = Ledger()  # LEDGER_URL, LEDGER_AGENT_KEY


class CmsRefused(Exception):
    """The CMS answered 4xx: it created nothing."""


@tool
@ledger.action("articles.create", target=ARTICLES_URL, key=lambda title, body: title,
               rejections=(CmsRefused,), external_id=lambda article: article["id"])
def publish_article(title: str, body: str) -> dict:
    """Publish an article on the CMS; returns it with its id."""
    response = httpx.post(ARTICLES_URL, json={"title": title, "body": body}, timeout=5)
    if 400 <= response.status_code < 500:
        raise CmsRefused(f"{response.status_code} {response.text}")
    response.raise_for_status()  # a 5xx: the outcome is unknown, and so recorded
    return response.json()


def scripted_model(title: str) -> FakeMessagesListChatModel:
    """A model that calls the tool, calls it again with the same arguments, then answers."""
    arguments = {"title": title, "body": "Published by a tool call."}
    return FakeMessagesListChatModel(responses=[
        AIMessage("", tool_calls=[{"name": "publish_article", "args": arguments,
                                   "id": "call-1"}]),
        AIMessage("", tool_calls=[{"name": "publish_article", "args": arguments,
                                   "id": "call-2"}]),
        AIMessage("done"),
    ])


def build_graph(model):
    graph = StateGraph(MessagesState)
    graph.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
    graph.add_node("tools", ToolNode([publish_article], handle_tool_errors=tool_message))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile()


def main(title: str) -> None:
    state = build_graph(scripted_model(title)).invoke({"messages": [("user", "publish")]})
    for message in state["messages"]:  # what the model read back from the tool
        if isinstance(message, ToolMessage):
            print("tool answered:", message.content)
    print("final:", state["messages"][-1].content)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "Tools that act once")
