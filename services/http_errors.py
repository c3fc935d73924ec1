"""HTTP 400 for bad input, with a message that names the field (FastAPI's default is a 422 list)."""

from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

_TYPE_NAMES = {"str", "int", "float", "bool", "bytes"}  # pydantic's names of union members of these types


def field_name(loc: tuple) -> str:
    """``("body", "sampling_params", "SamplingParams", "top_p")`` → ``sampling_params.top_p``.

    Union members appear in pydantic's locations under their type names; they are not fields
    (``rid: str | list[str]`` given 5 was ``rid.str``).
    """
    out = ""
    for p in loc[1:] if loc and loc[0] in ("body", "query") else loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif re.fullmatch(r"[a-z_][a-z0-9_]*", p) and p not in _TYPE_NAMES:
            out += f".{p}" if out else p
    return out or "body"


def bad_request(field: str, message: str) -> JSONResponse:
    return JSONResponse(
        status_code=400, content={"object": "error", "code": 400, "field": field, "message": f"{field}: {message}"}
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        field = field_name(tuple(err.get("loc", ())))
        if err.get("type") == "json_invalid":
            return bad_request("body", f"malformed JSON ({err.get('ctx', {}).get('error', 'invalid')})")
        if err.get("type") == "extra_forbidden":
            return bad_request(field, "unknown field")
        return bad_request(field, err.get("msg", "invalid value"))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        # FastAPI's own 400 for a body json.loads cannot even decode (not UTF-8): {"detail": ...}, no field.
        if exc.status_code == 400 and exc.__cause__ is not None:
            return bad_request("body", f"malformed JSON ({exc.__cause__})")
        if exc.status_code == 413:  # BodyLimit: its detail names the body
            response = bad_request("body", str(exc.detail).removeprefix("body: "))
            response.status_code = 413
            return response
        return await http_exception_handler(request, exc)
