"""`rollmesh serve tinker` against the official `tinker` SDK and two tinker-cookbook recipes, unchanged.

One service (SmolLM2-135M-Instruct, its own embedded engine) for the module; three keys: alice's and bob's,
and carol's for the fuzzed bodies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from services.gateway.keys import issue_key
from services.processes import free_port, stop_process, wait_http_healthy

tinker = pytest.importorskip("tinker", reason="the tinker SDK is a dev dependency (make setup installs it)")
from tinker import types  # noqa: E402

EXAMPLES = [("banana split", "ananab tilps"), ("quantum physics", "mutnauq scisyhp"), ("donut shop", "tunod pohs")]


@pytest.fixture(scope="module")
def service(smollm2, tmp_path_factory):
    where = tmp_path_factory.mktemp("tinker")
    keys = where / "keys.json"
    key = {name: issue_key(keys, name, prefix="tml-") for name in ("alice", "bob", "carol")}
    port = free_port()
    cmd = [sys.executable, "-m", "launch.cli", "serve", "tinker", "--set", f"model_path={smollm2}"]
    for k, v in {
        "api_keys_path": keys,
        "root": where / "root",
        "port": port,
        "max_loaded_adapters": 2,
        "max_models_per_key": 32,
    }.items():
        cmd += ["--set", f"tinker.{k}={v}"]
    log = open(where / "server.log", "w")  # noqa: SIM115 (as long as the process)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_healthy(url + "/health", 180, proc)
        yield {"url": url, "key": key, "model": smollm2, "dir": where, "pid": proc.pid}
    finally:
        stop_process(proc)
        log.close()


@pytest.fixture
def client(service, monkeypatch):
    """ServiceClients of alice (or bob), closed after the test: their sessions end on the service (which
    frees their adapters) and their heartbeats stop."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    made = []

    def make(who: str = "alice"):
        made.append(tinker.ServiceClient(base_url=service["url"], api_key=service["key"][who]))
        return made[-1]

    yield make
    for sc in made:
        sc.close("success").result()


def datum(tok, inp: str, out: str) -> types.Datum:
    prompt = tok.encode(f"English: {inp}\nPig Latin:", add_special_tokens=True)
    answer = tok.encode(f" {out}\n\n", add_special_tokens=False)
    tokens, weights = prompt + answer, [0] * len(prompt) + [1] * len(answer)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"weights": weights[1:], "target_tokens": tokens[1:]},
    )


def losses_now(tc, data) -> float:
    return tc.forward(data, "cross_entropy").result().metrics["loss:sum"]


def test_the_sdk_loop_trains_samples_what_it_trained_and_resumes(service, client):
    """The SDK's own loop (its README's): forward_backward + optim_step, the loss falls; the sampler's
    tokens carry the log-probs the trainer computes for them; a saved state resumes with its optimizer."""
    sc = client()
    tc = sc.create_lora_training_client(base_model=service["model"], rank=8, seed=0).result()
    tok = tc.get_tokenizer()  # from the local directory get_info names: no download
    data = [datum(tok, *e) for e in EXAMPLES]
    losses = []
    for _ in range(4):
        fb, op = tc.forward_backward(data, "cross_entropy"), tc.optim_step(types.AdamParams(learning_rate=1e-3))
        losses.append(fb.result().metrics["loss:sum"])
        assert op.result() is not None
    assert losses[-1] < 0.6 * losses[0], losses

    saved = tc.save_state("four").result().path
    assert saved.endswith("/weights/four")
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tok.encode("English: coffee break\nPig Latin:"))
    res = sampler.sample(prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=8, seed=1)).result()
    assert len(res.sequences) == 2 and all(len(s.tokens) == len(s.logprobs) > 0 for s in res.sequences)

    # what the engine sampled with the adapter is what the trainer's forward of the same tokens gives
    seq = res.sequences[0]
    full = prompt.to_ints() + seq.tokens
    check = types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "weights": [0.0] * (len(full) - 1)},
    )
    train_lp = tc.forward([check], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    np.testing.assert_allclose(train_lp[-len(seq.tokens) :], seq.logprobs, atol=2e-3)
    prompt_lp = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    assert prompt_lp[0] is None
    np.testing.assert_allclose(prompt_lp[1:], train_lp, atol=1e-4)

    # the saved state, loaded with its optimizer, takes the same next step as the client that saved it
    resumed = sc.create_training_client_from_state_with_optimizer(saved).result()
    for c in (tc, resumed):
        c.forward_backward(data, "cross_entropy")
        c.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    after = [c.forward(data, "cross_entropy").result().metrics["loss:sum"] for c in (tc, resumed)]
    assert after[0] == pytest.approx(after[1], rel=1e-5)
    assert after[0] < losses[-1]

    # a custom loss (the SDK's: its gradient as cross_entropy's weights) moves the model as its formula says
    def neg_nll(data, logprobs):
        loss = sum(-(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs))
        return loss, {"custom_nll": float(loss.detach())}

    custom = tc.forward_backward_custom(data, neg_nll).result()
    assert custom.metrics["custom_nll"] == pytest.approx(losses_now(tc, data), rel=1e-4)
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert losses_now(tc, data) < custom.metrics["custom_nll"]


def test_keys_are_required_and_each_keys_models_are_its_own(service, client):
    import httpx

    url = service["url"]
    r = httpx.post(f"{url}/api/v1/create_session", json={})
    assert r.status_code == 401 and r.json()["field"] == "x-api-key"
    r = httpx.post(f"{url}/api/v1/create_session", json={}, headers={"X-API-Key": "tml-not-a-key"})
    assert r.status_code == 401

    alice = client().create_lora_training_client(base_model=service["model"], rank=4).result()
    path = alice.save_weights_for_sampler("mine").result().path
    bob = client("bob")
    with pytest.raises(tinker.NotFoundError, match="sampler_weights"):
        bob.create_sampling_client(model_path=path).result()
    headers = {"X-API-Key": service["key"]["bob"]}
    r = httpx.post(f"{url}/api/v1/get_info", json={"model_id": alice.model_id}, headers=headers)
    assert r.status_code == 404 and r.json()["field"] == "model_id"
    r = httpx.post(f"{url}/api/v1/retrieve_future", json={"request_id": "0" * 32}, headers=headers)
    assert r.status_code == 404


def test_bad_calls_name_their_field_and_the_service_keeps_serving(service, client):
    sc = client()
    with pytest.raises(tinker.BadRequestError, match="base_model"):
        sc.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=8).result()
    with pytest.raises(tinker.BadRequestError, match="lora_config.rank"):
        sc.create_lora_training_client(base_model=service["model"], rank=0).result()
    tc = sc.create_lora_training_client(base_model=service["model"], rank=4).result()
    tok = tc.get_tokenizer()
    data = [datum(tok, *EXAMPLES[0])]
    with pytest.raises(tinker.RequestFailedError, match="loss_fn"):
        tc.forward_backward(data, "stable_reinforce").result()
    # a failed call poisons the SDK's client (its rule): a new one on the same model goes on
    tc = sc.create_lora_training_client(base_model=service["model"], rank=4).result()
    short = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3], "weights": [1, 1, 1]},
    )
    with pytest.raises(tinker.BadRequestError, match=r"data\[0\].loss_fn_inputs.target_tokens"):
        tc.forward_backward([short], "cross_entropy").result()
    fine = tc.forward_backward(data, "cross_entropy").result()  # the refused call's turn passed
    assert fine.metrics["loss:sum"] > 0
    # GSPO: its sequence ratio over the tokens the mask marks; with the learner's own log-probs as q
    # the ratio is 1 and the loss is -sum(A) over the datum
    own = fine.loss_fn_outputs[0]["logprobs"].tolist()
    n = len(own)
    rl = types.Datum(
        model_input=data[0].model_input,
        loss_fn_inputs={
            "target_tokens": data[0].loss_fn_inputs["target_tokens"],
            "logprobs": own,
            "advantages": [1.0] * n,
            "sequence_ratio_mask": [0.0] * (n - 4) + [1.0] * 4,
        },
    )
    gspo = tc.forward_backward([rl], "gspo").result()
    assert abs(gspo.metrics["loss:sum"] + n) < 1e-3 * n
    trained = sc.create_lora_training_client(base_model=service["model"], rank=4).result()
    sampler = trained.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tok.encode("hello"))
    with pytest.raises(tinker.BadRequestError, match="sampling_params.stop"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, stop=["\n"])).result()
    with pytest.raises(tinker.BadRequestError, match=r"prompt.chunks\[0\].tokens"):
        sampler.sample(types.ModelInput.from_ints([10**7]), 1, types.SamplingParams(max_tokens=4)).result()
    out = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=3, stop=[])).result()
    assert len(out.sequences[0].tokens) == 3 and out.sequences[0].stop_reason == "length"


def _cookbook(service, args: list[str], log_path: Path) -> list[dict]:
    env = dict(
        os.environ,
        TINKER_BASE_URL=service["url"],
        TINKER_API_KEY=service["key"]["alice"],
        TINKER_TELEMETRY="0",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
    )
    common = [f"model_name={service['model']}", "renderer_name=qwen3_instruct", f"base_url={service['url']}"]
    common += [f"log_path={log_path}", "behavior_if_log_dir_exists=delete", "lora_rank=8"]
    out = log_path.with_suffix(".out")
    with open(out, "w") as f:
        rc = subprocess.run(
            [sys.executable, "-m", *args, *common], env=env, stdout=f, stderr=subprocess.STDOUT, timeout=600
        )
    assert rc.returncode == 0, out.read_text()[-3000:]
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def test_the_rest_client_lists_reads_and_deletes_a_keys_checkpoints(service, client):
    """The SDK's RestClient: a run and its checkpoints (what the cookbook reads on resume), a path's
    weights info, and deleting a checkpoint, sampler weights the engine holds included; another
    key sees none of it."""
    sc = client()
    tc = sc.create_lora_training_client(base_model=service["model"], rank=4).result()
    state = tc.save_state("r1").result().path
    sampler_path = tc.save_weights_for_sampler("s1").result().path
    sampler = sc.create_sampling_client(model_path=sampler_path)
    prompt = types.ModelInput.from_ints([1, 2, 3])
    sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()  # the engine now holds s1
    rest = sc.create_rest_client()

    run = rest.get_training_run(tc.model_id).result()
    base = str(Path(service["model"]).resolve())  # the service names its base model by its absolute path
    assert run.training_run_id == tc.model_id and run.base_model == base and run.lora_rank == 4
    assert run.last_checkpoint.tinker_path == state and run.last_sampler_checkpoint.tinker_path == sampler_path
    assert rest.get_training_run_by_tinker_path(state).result().training_run_id == tc.model_id
    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert {(c.checkpoint_id, c.checkpoint_type) for c in listed} == {
        ("weights/r1", "training"),
        ("sampler_weights/s1", "sampler"),
    }
    assert all(c.size_bytes > 0 for c in listed)
    info = rest.get_weights_info_by_tinker_path(state).result()
    assert info.is_lora and info.lora_rank == 4 and info.base_model == base

    other = client("bob").create_rest_client()
    for call in (lambda: other.list_checkpoints(tc.model_id), lambda: other.delete_checkpoint_from_tinker_path(state)):
        with pytest.raises(tinker.NotFoundError):
            call().result()

    rest.delete_checkpoint_from_tinker_path(sampler_path).result()
    assert [c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == ["weights/r1"]
    with pytest.raises(tinker.NotFoundError):
        sc.create_sampling_client(model_path=sampler_path).sample(
            prompt, 1, types.SamplingParams(max_tokens=2)
        ).result()
    with pytest.raises(tinker.NotFoundError):
        rest.delete_checkpoint_from_tinker_path(sampler_path).result()
    rest.delete_checkpoint_from_tinker_path(state).result()
    assert rest.list_checkpoints(tc.model_id).result().checkpoints == []


def test_the_cookbooks_supervised_recipe_runs_unchanged_and_its_loss_falls(service, tmp_path):
    """tinker_cookbook.recipes.chat_sl.train on the cookbook's 4 shortest example conversations, 3 epochs
    (a step's forward and backward of a 135M model take about a second per 100 tokens on two cores)."""
    import tinker_cookbook

    convs = (Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl").read_text().splitlines()
    data = tmp_path / "conversations.jsonl"
    data.write_text("\n".join(sorted(convs, key=len)[:4]) + "\n")
    args = ["tinker_cookbook.recipes.chat_sl.train", f"dataset={data}", "batch_size=4", "max_length=256"]
    rows = _cookbook(service, [*args, "learning_rate=2e-4", "num_epochs=3", "save_every=2"], tmp_path / "sl")
    nll = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    assert len(nll) == 3 and nll[-1] < nll[0], nll
    saved = [json.loads(line) for line in (tmp_path / "sl" / "checkpoints.jsonl").read_text().splitlines()]
    assert saved[-1]["name"] == "final" and saved[-1]["sampler_path"].startswith("tinker://")


def test_the_cookbooks_rl_recipe_runs_unchanged(service, tmp_path):
    """tinker_cookbook.recipes.math_rl.train on its arithmetic environment, importance sampling, 2 steps:
    the engine's per-token log-probs and the trainer's agree (the recipe's own kl_sample_train metric)."""
    args = ["tinker_cookbook.recipes.math_rl.train", "env=arithmetic", "group_size=4", "groups_per_batch=2"]
    args += ["max_tokens=16", "learning_rate=1e-4", "loss_fn=importance_sampling", "max_steps=2", "eval_every=0"]
    rows = _cookbook(service, [*args, "save_every=1"], tmp_path / "rl")
    steps = [r for r in rows if "env/all/reward/total" in r]
    assert len(steps) == 2
    assert all(abs(r["optim/kl_sample_train_v1"]) < 1e-3 for r in steps), steps
    saved = [json.loads(line) for line in (tmp_path / "rl" / "checkpoints.jsonl").read_text().splitlines()]
    assert saved[-1]["name"] == "final"


def _peak_rss(pid: int, reset: bool = False) -> int:
    """The process's peak resident memory in bytes (VmHWM); ``reset``: start the peak again from now."""
    if reset:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def test_a_small_sparse_body_that_would_inflate_is_refused_in_bounded_memory(service, client):
    """4 MB of protobuf naming two sparse [100000, 1024] inputs took the service from 254 to 1,040 MB.
    Refused by the model's positions before anything dense is made; the service's peak memory stays."""
    import httpx

    from tests.services.test_tinker_wire import _sparse_datum

    tc = client().create_lora_training_client(base_model=service["model"], rank=4).result()
    msg = _sparse_datum(100_000, 1024)
    msg.model_id = tc.model_id
    body = msg.SerializeToString()
    before = _peak_rss(service["pid"], reset=True)
    r = httpx.post(
        f"{service['url']}/api/v1/forward_backward",
        content=body,
        headers={"X-API-Key": service["key"]["alice"], "Content-Type": "application/x-protobuf"},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["field"] == "data[0].model_input", r.text
    assert "100000 tokens" in r.json()["detail"]
    assert _peak_rss(service["pid"]) - before < 64 * 2**20  # the body's few MB, never the 800 MB it names


def test_hostile_json_bodies_get_a_4xx_naming_the_field_and_the_service_keeps_serving(service, client):
    """Fuzzed (hypothesis, as the gateway's routes in test_fuzz_http.py): each JSON route's body as the
    SDK sends it, cut short, not JSON, or one field given any JSON value. Every answer is a 200 or a
    4xx whose body names the field (``{"detail", "field"}``), never a 5xx; every call it accepted
    ends in a result or a refusal, never an internal error; the SDK's loop works afterwards."""
    import time

    import httpx
    from hypothesis import given
    from hypothesis import strategies as st

    from tests.services.test_fuzz import fuzz
    from tests.services.test_fuzz_http import MUST_FAIL, damaged

    sc = client("carol")
    tc = sc.create_lora_training_client(base_model=service["model"], rank=4).result()
    sid, mid = tc.model_id.split(":train:")[0], tc.model_id
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    bodies = {
        "create_model": {
            "session_id": sid,
            "model_seq_id": 900,
            "base_model": service["model"],
            "lora_config": {"rank": 4},
        },
        "optim_step": {"model_id": mid, "seq_id": 1, "adam_params": {"learning_rate": 1e-4, "beta1": 0.9}},
        "save_weights": {"model_id": mid, "path": "fuzz", "seq_id": 2},
        "save_weights_for_sampler": {"model_id": mid, "path": "fuzz-s", "seq_id": 3},
        "load_weights": {"model_id": mid, "path": f"tinker://{mid}/weights/none", "seq_id": 4},
        "get_info": {"model_id": mid},
        "weights_info": {"tinker_path": f"tinker://{mid}/weights/none"},
        "create_sampling_session": {
            "session_id": sid,
            "sampling_session_seq_id": 7,
            "model_path": f"tinker://{mid}/sampler_weights/none",
        },
        "asample": {
            "base_model": service["model"],
            "prompt": prompt,
            "num_samples": 1,
            "sampling_params": {"max_tokens": 2},
        },
        "session_heartbeat": {"session_id": sid},
        "retrieve_future": {"request_id": "nothing"},
        "unload_model": {"model_id": f"{sid}:train:999"},
    }
    http = httpx.Client(base_url=f"{service['url']}/api/v1", headers={"X-API-Key": service["key"]["carol"]}, timeout=60)
    accepted = []

    @fuzz(200)
    @given(data=st.data())
    def run(data):
        route = data.draw(st.sampled_from(sorted(bodies)))
        kind = data.draw(st.sampled_from(["truncated", "not_json", "value"]))
        body, field = damaged(bodies[route], kind, data.draw)
        r = http.post(f"/{route}", content=body, headers={"content-type": "application/json"})
        what = f"{route} {kind} {body[:200]!r}: HTTP {r.status_code} {r.text[:300]}"
        assert r.status_code == 200 or 400 <= r.status_code < 500, what
        assert r.status_code != 200 or kind not in MUST_FAIL, what
        if r.status_code == 200:
            if "request_id" in r.json() and route != "retrieve_future":
                accepted.append((what, r.json()["request_id"]))
            return
        err = r.json()
        assert err["detail"] and (err["field"] or r.status_code in (404, 429)), what
        assert kind == "value" or err["field"] == field, what

    run()
    deadline = time.monotonic() + 120
    for what, rid in accepted:  # the calls it took end cleanly (or are still waiting their turn)
        while time.monotonic() < deadline:
            answer = http.post("/retrieve_future", json={"request_id": rid}).json()
            if answer.get("type") != "try_again":
                assert answer.get("category") != "server", f"{what} -> {answer}"
                break
    http.close()
    fresh = sc.create_lora_training_client(base_model=service["model"], rank=4).result()
    tok = fresh.get_tokenizer()
    assert fresh.forward_backward([datum(tok, *EXAMPLES[0])], "cross_entropy").result().metrics["loss:sum"] > 0
