"""One exception type for every refusal; it renders as OpenAI's error shape (lw_core.wire.ErrorBody)."""

from __future__ import annotations

from aiohttp import web

from lw_core.wire import error_body

# HTTP status -> OpenAI error "type"
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          405: "invalid_request_error", 409: "conflict_error", 410: "gone_error", 413: "invalid_request_error",
          415: "invalid_request_error", 502: "upstream_error", 503: "service_unavailable", 504: "timeout_error"}


class ProxyError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        # metrics label (lw_proxy_errors_total{kind}); defaults from the status class
        self.kind = kind or ("bad_request" if status < 500 else "upstream")

    def body(self) -> bytes:
        return error_body(self.status, self.message, _TYPES.get(self.status, "server_error"), self.param)

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=self.body(), content_type="application/json")
