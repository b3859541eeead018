"""Run a coroutine to completion from a synchronous test.

`asyncio.run` refuses to start while an event loop already runs in the calling thread, and
one does for the rest of a session once the browser tests have started Playwright's sync
API. A fresh thread has no loop, so the coroutine gets its own there, as in an agent
process; its result or exception comes back to the test.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any


def run_coroutine(coro: Coroutine[Any, Any, Any]) -> Any:
    outcome: dict[str, Any] = {}

    def target():
        try:
            outcome["result"] = asyncio.run(coro)
        except BaseException as exc:  # handed back to the test as it was raised
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="test-event-loop")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]
