"""The Tinker service's refusals: ``TinkerError`` (the SDK's category, an HTTP status, the field),
an id the caller does not own (404, as unknown), and checks of what a JSON body gives."""

from __future__ import annotations

from rollout.engines.http_engine import EngineRejected, EngineUnavailable
from services.tinker import wire
from trainer.token_losses import LossInputError


class TinkerError(Exception):
    """A call refused or failed. ``category`` is the SDK's: ``user`` (the request is wrong; HTTP 400
    where it is answered at once) or ``server``; ``status``: 404 for an id the caller does not own."""

    def __init__(self, field: str, message: str, category: str = "user", status: int = 400) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field, self.category, self.status = field, category, status


def unknown(what: str, value: str) -> TinkerError:
    return TinkerError(what, f"no {what.rsplit('.', 1)[-1]} {value!r} of this key", status=404)


def json_object(body: dict, key: str) -> dict:
    """``body[key]``, an optional JSON object ({} when null or left out)."""
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TinkerError(key, f"{str(value)[:100]!r}: an object")
    return value


def string_id(what: str, value) -> str:
    """An id a JSON body gives: a string (a list or a number is no key of this service's tables)."""
    if not isinstance(value, str):
        raise TinkerError(what, f"{str(value)[:100]!r}: a string")
    return value


def user_error(e: Exception) -> TinkerError | None:
    """An exception of a call as what the client did wrong, where it was."""
    if isinstance(e, TinkerError):
        return e
    if isinstance(e, LossInputError | wire.WireError):
        return TinkerError(e.field, str(e).removeprefix(e.field + ": "))
    if isinstance(e, EngineRejected):
        return TinkerError(e.field or "sample", str(e).removeprefix(f"{e.field}: "))
    if isinstance(e, EngineUnavailable):
        return TinkerError("", f"the engine did not answer: {e}", "server", 503)
    return None
