"""API errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}; the bus away
(any NATS error a handler meets) is a 503 with Retry-After."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import nats.errors
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable", 504: "timeout"}
RETRY_AFTER_S = 1  # the bus away, or no router answering: when to ask again


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "api_error"), "param": param, "code": code}}


def response(err: APIError) -> JSONResponse:
    return JSONResponse(body(err.status, err.message, err.param, err.code), status_code=err.status,
                        headers=err.headers)


def bus_away(err: Exception) -> APIError:
    return APIError(503, f"The service's message bus is unreachable ({type(err).__name__}); retry shortly.",
                    code="bus_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})


def plain(errors: Sequence[Any]) -> list[dict]:
    """Pydantic's errors as JSON values, without the inputs they quote (a client's body, however
    deeply nested, is not written again)."""
    return json.loads(json.dumps([{k: v for k, v in e.items() if k != "input"} for e in errors], default=str))


def describe(errors: list[dict]) -> tuple[str, str | None, str | None]:
    """(message, param, code) of the first error."""
    first = errors[0]
    kind = first.get("type")
    if kind == "json_invalid":
        return "The request body is not valid JSON.", None, None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    named = (first.get("ctx") or {}).get("param")  # a model's check names its field, under the model's place
    param = ".".join([*loc, *([named] if named else [])]) or None
    msg = first.get("msg", "invalid value")
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param, "unknown_parameter"
    if kind == "unsupported_parameter":
        return msg + ".", param, "unsupported_parameter"
    if kind == "invalid_value":
        return msg + ".", param, None
    return (f"Invalid value for '{param}': {msg}." if param else f"Invalid request: {msg}."), param, None


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return response(err)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, err: RequestValidationError) -> JSONResponse:
        message, param, code = describe(plain(err.errors()))
        return JSONResponse(body(400, message, param, code), status_code=400)

    @app.exception_handler(nats.errors.Error)
    async def _bus(_: Request, err: nats.errors.Error) -> JSONResponse:
        return response(bus_away(err))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(body(err.status_code, str(err.detail)), status_code=err.status_code)
