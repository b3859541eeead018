"""A plain httpx client whose side effect (creating an article) happens once per key.

Run it from the project folder (twice: the second run sends nothing and prints the same ids):

    .venv/bin/python examples/httpx_client.py

It talks to ARTICLES_URL (the simulated articles service of demo/simulated, or any service
with its POST /articles); without one it starts the simulated service for the run.
"""

import os

import django
import httpx

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
    return "article-" + "-".join(title.lower().split())


@receipts.action("articles.create", target=ARTICLES_URL, key=article_key,
                 rejections=(Refused,), external_id=lambda article: article["id"])
def create_article(title: str, body: str) -> dict:
    response = httpx.post(ARTICLES_URL, json={"title": title, "body": body}, timeout=5,
                          headers={"Idempotency-Key": article_key(title, body)})
    if 400 <= response.status_code < 500:
        raise Refused(f"{response.status_code} {response.text}")
    response.raise_for_status()  # a 5xx: the outcome is unknown, and so recorded
    return response.json()


if __name__ == "__main__":
    for title in ("Hello from httpx", "A second article"):
        try:
            print("created", create_article(title, "Written by an agent.")["id"], title)
        except Exception as exc:  # a timeout, a refusal: recorded; the loop goes on
            print("not created", title, type(exc).__name__, exc)
