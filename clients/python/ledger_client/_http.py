"""Requests to the ledger's API and their answers, sync and async over httpx.

A request that could not even connect reached nothing, so it is tried again (a few times,
briefly): that is always safe. Any other transport failure (a timeout, a dropped
connection) may have reached the ledger: it is raised as LedgerUnavailable and the caller,
who knows what the request was, decides. Answers become data or typed errors here.
"""

from __future__ import annotations

import asyncio
import functools
import time
import weakref
from dataclasses import dataclass
from typing import Any

import httpx

from ledger_client import errors
from ledger_client.receipt import Receipt

PROBLEM = "application/problem+json"
REPLAYED = "Idempotent-Replayed"
CONNECT_DELAYS = (0.05, 0.2, 0.5)  # after a refused connection: nothing was sent


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    json: Any = None
    params: dict[str, Any] | None = None
    headers: dict[str, str] | None = None


def _describe(request: Request) -> str:
    return f"{request.method} {request.path}"


def unavailable(request: Request, url: str, exc: BaseException) -> errors.LedgerUnavailable:
    kind = ("could not connect" if isinstance(exc, httpx.ConnectError) else
            "timed out" if isinstance(exc, httpx.TimeoutException) else
            f"failed ({type(exc).__name__})")
    return errors.LedgerUnavailable(
        f"expected the ledger at {url} to answer {_describe(request)}, found that the "
        f"request {kind}: {exc}", cause=exc)


def answer(request: Request, response: httpx.Response) -> Any:
    """The JSON of a 2xx answer; the typed error of any other."""
    status = response.status_code
    content_type = response.headers.get("content-type", "").split(";")[0].strip()
    if 200 <= status < 300:
        try:
            data = response.json()
        except ValueError as exc:
            raise errors.UnexpectedResponse(
                f"expected JSON from the ledger for {_describe(request)}, found "
                f"{status} with {content_type or 'no content type'}: "
                f"{response.text[:200]!r}", cause=exc) from None
        if isinstance(data, dict) and response.headers.get(REPLAYED, "").lower() == "true":
            data["replayed"] = True  # served from the stored receipt (Receipt.replayed)
        return data
    problem = None
    if content_type == PROBLEM:
        try:
            problem = response.json()
        except ValueError:
            problem = None
    if not isinstance(problem, dict) or not isinstance(problem.get("type"), str):
        message = (f"expected the ledger's API to answer {_describe(request)}, found "
                   f"{status} with {content_type or 'no content type'}: "
                   f"{response.text[:200]!r}")
        if status >= 500:
            raise errors.ServerError(message, status=status)
        raise errors.UnexpectedResponse(message)
    raise problem_error(problem, status)


def problem_error(problem: dict, status: int) -> errors.LedgerError:
    slug = problem["type"].removeprefix(errors.PROBLEM_PREFIX)
    cls = errors.PROBLEM_TYPES.get(slug)
    detail = str(problem.get("detail", ""))
    message = f"{problem.get('title', slug)} ({status}): {detail}"
    operation = problem.get("operation")
    receipt = Receipt(operation) if isinstance(operation, dict) else None
    if cls is None:
        cls = errors.InternalError if status >= 500 else errors.ProblemError
    return cls(message, status=status, problem=problem, operation=receipt)


class _NoCookies(httpx.Cookies):
    """Cookies never taken from an answer, so none is kept or sent back. The ledger's API
    sets none (keys, not sessions, authenticate it), yet httpx searches every answer for
    Set-Cookie, through urllib's cookie jar and a urllib request built for it: about a
    tenth of the client's CPU per request."""

    def extract_cookies(self, response: httpx.Response) -> None:
        pass


NO_COOKIES = _NoCookies()


class _CookielessClient(httpx.Client):
    """An httpx.Client whose cookies are NO_COOKIES; nothing else differs."""

    @property
    def cookies(self) -> httpx.Cookies:
        return NO_COOKIES


class _CookielessAsyncClient(httpx.AsyncClient):
    """An httpx.AsyncClient whose cookies are NO_COOKIES; nothing else differs."""

    @property
    def cookies(self) -> httpx.Cookies:
        return NO_COOKIES


@functools.lru_cache(maxsize=256)
def absolute_url(url: str, path: str) -> httpx.URL:
    """The ledger's `url` (no trailing slash) joined to an API path (a leading one), parsed
    once per pair. An httpx.URL is immutable and httpx sends it as it is, so a path that
    repeats (an action's intent goes to the operations list) is not parsed again; a
    client's `base_url` would parse the path, merge it and parse the result every time."""
    return httpx.URL(url + path)


def _settings(key: str, timeout: float, transport) -> dict[str, Any]:
    """A client's settings (no `base_url`: requests name their absolute_url)."""
    return {"timeout": timeout, "transport": transport,
            "headers": {"Authorization": f"Bearer {key}", "Accept": "application/json"}}


class SyncTransport:
    def __init__(self, url: str, key: str, *, timeout: float, transport=None):
        self.url = url
        self.client = _CookielessClient(**_settings(key, timeout, transport))

    def send(self, request: Request) -> Any:
        url = absolute_url(self.url, request.path)
        for delay in (*CONNECT_DELAYS, None):
            try:
                response = self.client.request(request.method, url, json=request.json,
                                                params=request.params, headers=request.headers)
            except httpx.ConnectError as exc:
                if delay is None:
                    raise unavailable(request, self.url, exc) from None
                time.sleep(delay)
                continue
            except httpx.HTTPError as exc:
                raise unavailable(request, self.url, exc) from None
            return answer(request, response)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.client.close()


class AsyncTransport:
    """One httpx.AsyncClient per event loop (a client is bound to the loop it first ran
    on; `asyncio.run` twice gives two loops), closed with its loop: a guard async
    generator started on the loop closes the client when the loop shuts its async
    generators down (`asyncio.run` and anyio do, before closing the loop), so 300
    `asyncio.run` calls leave no socket open. `aclose()` closes them all at once."""

    def __init__(self, url: str, key: str, *, timeout: float, transport=None):
        self.url = url
        self._settings = _settings(key, timeout, transport)
        # loop -> (its client, the guard that closes it); weak: a dropped loop drops both
        self._clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    async def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        found = self._clients.get(loop)
        if found is not None:
            return found[0]
        client = _CookielessAsyncClient(**self._settings)
        guard = self._close_with_loop(client)
        self._clients[loop] = (client, guard)
        await guard.asend(None)  # started: the loop now finalizes it at shutdown
        return client

    async def _close_with_loop(self, client: httpx.AsyncClient):
        try:
            yield
        finally:  # the loop is shutting down (or aclose): it still runs this
            loop = asyncio.get_running_loop()
            if self._clients.get(loop, (None,))[0] is client:
                del self._clients[loop]
            await client.aclose()

    async def send(self, request: Request) -> Any:
        client = await self._client()
        url = absolute_url(self.url, request.path)
        for delay in (*CONNECT_DELAYS, None):
            try:
                response = await client.request(request.method, url, json=request.json,
                                                 params=request.params, headers=request.headers)
            except httpx.ConnectError as exc:
                if delay is None:
                    raise unavailable(request, self.url, exc) from None
                await asyncio.sleep(delay)
                continue
            except httpx.HTTPError as exc:
                raise unavailable(request, self.url, exc) from None
            return answer(request, response)
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        """Close this loop's client now (the others close with their loops)."""
        found = self._clients.get(asyncio.get_running_loop())
        if found is not None:
            await found[1].aclose()  # its finally closes the client
