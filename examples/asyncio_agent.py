"""An asyncio agent: three concurrent tasks, each creating an article at most once per key.

Run it from the project folder (twice: the second run sends nothing):

    .venv/bin/python examples/asyncio_agent.py

The decorated coroutine's ledger writes run in Django's worker thread, so the event loop
never waits on PostgreSQL. ARTICLES_URL as in httpx_client.py.
"""

import asyncio
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
TITLES = ("Morning digest", "Noon digest", "Evening digest")


class Refused(Exception):
    """The service answered 4xx: it created nothing."""


def article_key(title: str, body: str) -> str:
    return "digest-" + "-".join(title.lower().split())


@receipts.action("articles.create", target=ARTICLES_URL, key=article_key,
                 rejections=(Refused,), external_id=lambda article: article["id"])
async def create_article(title: str, body: str) -> dict:
    async with httpx.AsyncClient(timeout=5) as client:
        response = await client.post(ARTICLES_URL, json={"title": title, "body": body},
                                     headers={"Idempotency-Key": article_key(title, body)})
    if 400 <= response.status_code < 500:
        raise Refused(f"{response.status_code} {response.text}")
    response.raise_for_status()  # a 5xx: the outcome is unknown, and so recorded
    return response.json()


async def main() -> None:
    outcomes = await asyncio.gather(*(create_article(t, "Summed up by an agent.") for t in TITLES),
                                    return_exceptions=True)
    for title, outcome in zip(TITLES, outcomes, strict=True):
        if isinstance(outcome, BaseException):  # recorded (outcome_unknown or rejected)
            print("not created", title, type(outcome).__name__, outcome)
        else:
            print("created", outcome["id"], title)


if __name__ == "__main__":
    asyncio.run(main())
