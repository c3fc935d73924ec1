"""The Tinker service's bookkeeping without HTTP: call order, refused calls, idle sessions, key limits."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from sample_buffer.deadlines import wait_for
from services.tinker.config import TinkerConfig
from services.tinker.errors import TinkerError
from services.tinker.service import TinkerService
from trainer.adapter_pool import AdapterPool, Datum


@pytest.fixture(scope="module")
def pool(tiny_model):
    return AdapterPool(tiny_model)


def _service(pool, tiny_model, tmp_path, **config) -> TinkerService:
    cfg = TinkerConfig(**{"root": str(tmp_path), "order_timeout_s": 5, **config})
    return TinkerService(cfg, pool, engine=None, model_path=tiny_model, arch="tiny")


async def _model(svc: TinkerService, owner: str = "alice"):
    sid = svc.create_session(owner)
    body = {"session_id": sid, "model_seq_id": 0, "base_model": svc.base_model, "lora_config": {"rank": 2}}
    mid = (await svc.create_model(owner, body))["model_id"]
    return sid, svc.model(owner, mid)


def test_a_refused_call_passes_its_turn_and_a_duplicate_number_is_refused(pool, tiny_model, tmp_path):
    async def main():
        svc = _service(pool, tiny_model, tmp_path)
        _, m = await _model(svc)
        with pytest.raises(TinkerError, match="adam_params.learning_rate"):  # seq 1: refused at once
            svc.optim_step("alice", {"model_id": m.id, "seq_id": 1, "adam_params": {"learning_rate": -1}})
        step = svc.optim_step("alice", {"model_id": m.id, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}})
        assert (await wait_for(step, 5))["type"] == "optim_step"  # did not wait for seq 1
        again = svc.optim_step("alice", {"model_id": m.id, "seq_id": 2, "adam_params": {}})
        with pytest.raises(TinkerError, match="seq_id"):
            await again
        with pytest.raises(TinkerError, match="saved already"):  # a name is saved for samplers once
            await svc.save_weights_for_sampler("alice", {"model_id": m.id, "seq_id": 3, "path": "s"})
            svc.save_weights_for_sampler("alice", {"model_id": m.id, "seq_id": 4, "path": "s"})
        await wait_for(svc.optim_step("alice", {"model_id": m.id, "seq_id": 5, "adam_params": {}}), 5)
        svc.pool.remove(m.adapter)

    asyncio.run(main())


def test_a_missing_call_breaks_the_model_loudly_and_sessions_without_heartbeats_end(pool, tiny_model, tmp_path):
    async def main():
        svc = _service(pool, tiny_model, tmp_path, order_timeout_s=0.5, session_idle_s=60.0)
        sid, m = await _model(svc)
        with pytest.raises(TinkerError, match="call 1 never came"):  # seq 1 never sent
            await svc.optim_step("alice", {"model_id": m.id, "seq_id": 2, "adam_params": {}})
        with pytest.raises(TinkerError, match="never came"):
            await svc.optim_step("alice", {"model_id": m.id, "seq_id": 3, "adam_params": {}})
        other, _ = await _model(svc, "bob")
        svc.seen[sid] -= 120  # alice's client died 2 minutes ago
        assert await svc.expire() == [sid]
        assert not any(x.owner == "alice" for x in svc.models.values()) and sid not in svc.sessions
        assert other in svc.sessions
        for x in list(svc.models.values()):
            svc.pool.remove(x.adapter)

    asyncio.run(main())


def test_a_keys_model_limit_counts_models_being_made(pool, tiny_model, tmp_path):
    async def main():
        svc = _service(pool, tiny_model, tmp_path, max_models_per_key=2)
        sid = svc.create_session("alice")
        body = {"session_id": sid, "base_model": svc.base_model, "lora_config": {"rank": 2}}
        made = [svc.create_model("alice", {**body, "model_seq_id": i}) for i in range(2)]  # neither made yet
        with pytest.raises(TinkerError, match="max_models_per_key"):
            svc.create_model("alice", {**body, "model_seq_id": 2})
        for work in made:
            svc.pool.remove(svc.model("alice", (await work)["model_id"]).adapter)

    asyncio.run(main())


def test_losses_refuse_inputs_that_would_break_midway(pool):
    rng = np.random.default_rng(0)
    pool.add("z", __import__("trainer.lora", fromlist=["LoraConfig"]).LoraConfig(rank=2, target_modules=["q_proj"]))
    tokens = rng.integers(0, 50, 9)
    good = {"target_tokens": tokens[1:], "logprobs": np.zeros(8, np.float32), "advantages": np.ones(8, np.float32)}
    from trainer.token_losses import LossInputError

    for bad, field in (
        ({**good, "advantages": np.ones((8, 3), np.float32)}, "advantages"),
        ({**good, "logprobs": np.full(8, np.nan, np.float32)}, "logprobs"),
    ):
        with pytest.raises(LossInputError, match=rf"data\[1\].loss_fn_inputs.{field}"):
            pool.forward_backward("z", [Datum(tokens[:-1], good), Datum(tokens[:-1], bad)], "ppo", {})
    assert all(p.grad is None for p in pool.adapters["z"].params)
    pool.remove("z")


def test_saved_weights_with_a_ttl_are_listed_with_it_and_deleted_once_it_passes(pool, tiny_model, tmp_path):
    async def main():
        svc = _service(pool, tiny_model, tmp_path)
        _, m = await _model(svc)
        with pytest.raises(TinkerError, match="ttl_seconds"):
            svc.save_weights("alice", {"model_id": m.id, "seq_id": 1, "path": "x", "ttl_seconds": -5})
        short = {"model_id": m.id, "seq_id": 2, "path": "short", "ttl_seconds": 0.01}
        await wait_for(svc.save_weights("alice", short), 30)
        await wait_for(svc.save_weights("alice", {"model_id": m.id, "seq_id": 3, "path": "kept"}), 30)
        listed = {c["checkpoint_id"]: c["expires_at"] for c in svc.checkpoints("alice", m.id)["checkpoints"]}
        assert listed["weights/kept"] is None and listed["weights/short"] is not None
        await asyncio.sleep(0.05)  # past its expiry time
        await svc.expire()
        assert [c["checkpoint_id"] for c in svc.checkpoints("alice", m.id)["checkpoints"]] == ["weights/kept"]
        with pytest.raises(TinkerError, match="no training_run_id"):
            svc.checkpoints("bob", m.id)
        svc.pool.remove(m.adapter)

    asyncio.run(main())
