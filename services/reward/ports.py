"""What reward variants need from the mesh, built where the mesh is known: the LLM judge
(``reward: {type: judge}``) reaches its model through an LLMProxy, and ``{type: service}`` is a
client of the reward service. ``build_reward(spec, **reward_ports(...))`` passes them."""

from __future__ import annotations

import asyncio

from rollout.verifiers.judge import JudgeReward, JudgeRewardConfig
from services.auth import AuthConfig


def reward_ports(
    auth: AuthConfig | None, *, reward_address: str | None = None, proxy=None, tokenizer_path: str | None = None
) -> dict:
    """``reward_service``: always (``reward_address``: the mesh's service, for a spec naming none);
    ``judge``: where ``proxy`` (the mesh's ``ProxyClient``) is given, built on the running event loop."""
    from services.reward.client import RewardClient

    ports = {"reward_service": lambda spec: RewardClient.from_config(spec, reward_address, auth)}
    if proxy is not None:
        ports["judge"] = _judge_builder(proxy, auth, tokenizer_path)
    return ports


def _judge_builder(proxy, auth: AuthConfig | None, tokenizer_path: str | None):
    """Builds the LLM judge on this process's event loop: through the mesh's LLMProxy, or a client
    of its own to the judge's."""
    from services.llm_proxy.client import ProxyClient, ProxyGenerate

    def build(spec: JudgeRewardConfig) -> JudgeReward:
        from transformers import AutoTokenizer

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("the judge reward is built on the event loop that will serve its calls") from None
        client = proxy if spec.proxy is None else ProxyClient(spec.proxy, auth=auth)
        tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_path or tokenizer_path)
        return JudgeReward(spec, ProxyGenerate(client), tokenizer, loop)

    return build
