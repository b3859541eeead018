"""The floor under P8: an ASGI app that does nothing, served by the same uvicorn.

It reads the request's body and answers the status and a JSON body shaped as the API's
(`{"operation_id": ...}`), with no Django, no database and no authentication. The same
client sending the same three POSTs to it measures what the transport alone costs: the
client library, the loopback, uvicorn's parsing and the event loop. What the HTTP API adds
above that is P8's HTTP median minus this one.
"""

import json

BODY = json.dumps({"operation_id": "00000000-0000-0000-0000-000000000000"}).encode()


async def application(scope, receive, send):
    if scope["type"] != "http":  # lifespan: nothing to start or stop
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    status = 201 if scope["path"].endswith("/operations") else 200
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(BODY)).encode())]})
    await send({"type": "http.response.body", "body": BODY})
