"""LLMProxy logic: routing, the suspend gate, retries and weight-update fan-out (no sockets of its own)."""

from rollout.proxy.config import ProxyConfig
from rollout.proxy.proxy import LLMProxy, ProxyRequest, ProxyResult, RequestInvalid

__all__ = ["LLMProxy", "ProxyConfig", "ProxyRequest", "ProxyResult", "RequestInvalid"]
