"""An ASGI middleware for vLLM's API server: a tenant header becomes the request's tenant.

    vllm serve MODEL --middleware kvledger_engine.vllm.tenant_header.TenantHeader

with ``KVLEDGER_VLLM_TENANT=request`` (read in the engine) and, optionally,
``KVLEDGER_VLLM_TENANT_HEADER`` (default ``x-tenant``). On ``POST /v1/completions`` and
``POST /v1/chat/completions`` with a JSON object body it sets
``vllm_xargs.kvledger_tenant`` to the header's value, or removes a client-supplied one
when the header is absent: the tenant is what the gateway in front of vLLM says, never
what a client writes in its body. vLLM passes ``vllm_xargs`` to the engine as the
request's ``extra_args``, where the ledger reads it. Other requests pass untouched.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

ENV_HEADER = "KVLEDGER_VLLM_TENANT_HEADER"
XARG = "kvledger_tenant"
PATHS = ("/v1/completions", "/v1/chat/completions")
MAX_TENANT_CHARS = 128


class TenantHeader:
    def __init__(self, app: App, header: str | None = None) -> None:
        self.app = app
        name = header or os.environ.get(ENV_HEADER, "") or "x-tenant"
        self.header = name.strip().lower().encode("latin-1")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in PATHS:
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = list(scope.get("headers") or [])
        tenant = self._tenant(headers)
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message.get("type") != "http.request":
                # the client went away before its body arrived: let the app see that
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        rewritten = _with_tenant(body, tenant)
        if rewritten is not None:
            body = rewritten
            headers = [(k, v) for k, v in headers if k.lower() not in (b"content-length", b"transfer-encoding")]
            headers.append((b"content-length", str(len(body)).encode()))
            scope = dict(scope, headers=headers)
        await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive), send)

    def _tenant(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        for key, value in headers:
            if key.lower() == self.header:
                text = value.decode("latin-1").strip()
                if text and len(text) <= MAX_TENANT_CHARS and text.isprintable():
                    return text
                return None
        return None


def _with_tenant(body: bytes, tenant: str | None) -> bytes | None:
    """The body with ``vllm_xargs.kvledger_tenant`` set (or removed); None to leave it as is."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None  # not JSON: vLLM answers with its own error
    if not isinstance(doc, dict):
        return None
    xargs = doc.get("vllm_xargs")
    if xargs is not None and not isinstance(xargs, dict):
        return None  # malformed: vLLM's validation names it
    xargs = dict(xargs or {})
    if tenant is None:
        if XARG not in xargs:
            return None
        del xargs[XARG]
    else:
        xargs[XARG] = tenant
    doc["vllm_xargs"] = xargs or None
    return json.dumps(doc).encode()


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
