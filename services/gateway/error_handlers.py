"""The gateway's errors in OpenAI's shape (``{"error": {message, type, param, code}}``): bad input
names its field, a refused session its reason, an unknown route or method its status, and an
unexpected error is a logged 500."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout.agent.sessions import SessionError
from services.gateway.openai_api import error
from services.http_errors import field_name

log = logging.getLogger(__name__)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        field = field_name(tuple(err.get("loc", ())))
        if err.get("type") == "json_invalid":
            return error(400, "body: malformed JSON", "body")
        message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        return error(400, f"{field}: {message}", field)

    @app.exception_handler(SessionError)
    async def _refused(_: Request, exc: SessionError) -> JSONResponse:
        return error(exc.status, str(exc), exc.param, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:  # unknown route, wrong method
        if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI's: a body that is not even UTF-8
            return error(400, f"body: malformed JSON ({exc.__cause__})", "body")
        if exc.status_code == 413:  # BodyLimit's detail names the body
            return error(413, str(exc.detail), "body")
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:  # still OpenAI's shape, and logged
        log.exception("unexpected error")
        return error(500, f"internal error: {type(exc).__name__}: {exc}")
