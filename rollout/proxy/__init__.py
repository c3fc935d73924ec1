"""LLMProxy logic: routing, the suspend gate, retries and weight-update fan-out (no sockets of its own)."""

from rollout.proxy.config import ProxyConfig
from rollout.proxy.pool import UPDATE_FAILURE_CAUSES
from rollout.proxy.proxy import LLMProxy
from rollout.proxy.request import NoEngineAvailable, ProxyRequest, ProxyResult, RequestInvalid

__all__ = [
    "UPDATE_FAILURE_CAUSES",
    "LLMProxy",
    "NoEngineAvailable",
    "ProxyConfig",
    "ProxyRequest",
    "ProxyResult",
    "RequestInvalid",
]
