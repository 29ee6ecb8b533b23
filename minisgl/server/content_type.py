"""Bodies sent as a form read as JSON: `curl -d '{...}'` labels its JSON
`application/x-www-form-urlencoded` unless told otherwise, and no route of this API takes a
form, so such a body is read as the JSON it is (as llama.cpp's server does)."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

FORM = b"application/x-www-form-urlencoded"


class FormAsJson:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = scope["headers"]
            if any(k == b"content-type" and v.startswith(FORM) for k, v in headers):
                headers = [(k, v) for k, v in headers if k != b"content-type"]
                scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)
