"""The LLMProxy gRPC service over real engine processes on loopback."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoModelForCausalLM

from rollout.proxy import ProxyConfig
from services.llm_proxy.client import ProxyClient
from services.llm_proxy.server import engine_client, start_proxy
from services.pb.rollmesh.v1 import common_pb2
from services.pb.rollmesh.v1 import llm_proxy_pb2 as pb
from services.processes import free_port
from tests.engines import TEST_LOAD_ROOTS, Engines
from tests.services.proxy_waits import decoding


@pytest.fixture(scope="module")
def embedded_engines(tiny_model, engine_pool):
    with engine_pool.borrowed(tiny_model, TEST_LOAD_ROOTS, 2) as urls:
        yield Engines(urls)


@pytest.fixture(params=["embedded", "vllm"])
def two_engines(request):
    """Every test on two engines runs against the embedded engine and against vLLM."""
    return request.getfixturevalue(f"{request.param}_engines")


def run(scenario, urls, **cfg):
    """Start a proxy on a free port in this event loop, run ``scenario(client, proxy)``, stop everything."""

    async def main():
        config = ProxyConfig(
            engine_urls=urls,
            engine_api=getattr(urls, "api", "sglang"),
            port=0,
            metrics_port=0,
            health_check_interval_s=0.2,
            **cfg,
        )
        server, proxy = await start_proxy(config)
        client = ProxyClient(f"127.0.0.1:{server.bound_port}")
        try:
            return await scenario(client, proxy)
        finally:
            await client.close()
            await server.stop(0)
            await proxy.close()

    return asyncio.run(main())


def greedy(model_path, prompt, n):
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


GREEDY = {"temperature": 0.0, "ignore_eos": True}


def test_generate_and_routing(two_engines, tiny_model):
    async def scenario(client, proxy):
        one = await client.generate([1, 40, 41], 16, route="t", **GREEDY)
        same = {(await client.generate([1, 40, 41, 9], 4, route="t")).engine for _ in range(5)}
        spread = await asyncio.gather(
            *(client.generate([1, 2, 3], 60, route=f"s{i}", ignore_eos=True) for i in range(8))
        )
        return one, same, {r.engine for r in spread}, await client.stats()

    one, same, spread, stats = run(scenario, two_engines)
    assert list(one.output_ids) == greedy(tiny_model, [1, 40, 41], 16)
    assert one.finish_reason == common_pb2.FINISH_REASON_LENGTH and one.prompt_tokens == 3
    # The version the engines serve (0, unless a test before this one updated the shared engines).
    assert len(one.behavior_logprobs) == 16 and set(one.token_versions) == {stats.weight_version}
    assert one.num_segments == 1
    assert same == {one.engine}  # affinity: one episode, one engine
    assert spread == {"engine-0", "engine-1"}  # least outstanding tokens spreads load
    assert stats.requests_total == 14 and all(e.healthy for e in stats.engines)


def test_bad_input_is_invalid_argument_and_the_proxy_keeps_serving(two_engines):
    async def scenario(client, proxy):
        errors = {}
        cases = {
            "input_ids": pb.GenerateRequest(sampling_params=pb.SamplingParams(max_new_tokens=2)),
            "sampling_params.max_new_tokens": pb.GenerateRequest(input_ids=[1]),
            "sampling_params.top_p": pb.GenerateRequest(
                input_ids=[1], sampling_params=pb.SamplingParams(max_new_tokens=1, top_p=2.0)
            ),
            "oov": pb.GenerateRequest(input_ids=[1, 10**6], sampling_params=pb.SamplingParams(max_new_tokens=1)),
        }
        for name, req in cases.items():
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.stub.Generate(req, timeout=30)
            errors[name] = (e.value.code(), e.value.details())
        raw = client._channel.unary_unary("/rollmesh.v1.LLMProxy/Generate")
        for name, payload in {
            "corrupt": b"\xff\xff\xff",
            "unknown": pb.GenerateRequest(input_ids=[1]).SerializeToString() + bytes([0xF8, 0x06, 0x01]),
        }.items():
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await raw(payload, timeout=30)
            errors[name] = (e.value.code(), e.value.details())
        ok = await client.generate([1, 2], 2)
        return errors, ok

    errors, ok = run(scenario, two_engines)
    for name, (code, details) in errors.items():
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, details)
    assert errors["input_ids"][1].startswith("input_ids:")
    assert errors["sampling_params.max_new_tokens"][1].startswith("sampling_params.max_new_tokens:")
    assert errors["sampling_params.top_p"][1].startswith("sampling_params.top_p:")
    assert "input_ids" in errors["oov"][1] and "vocabulary" in errors["oov"][1]
    assert "malformed" in errors["corrupt"][1] and "unknown field number 111" in errors["unknown"][1]
    assert len(ok.output_ids) >= 1


def test_a_grammar_crosses_the_proxy_to_the_engine_or_is_refused_by_name(two_engines, tiny_model):
    """SGLang's regex through the LLMProxy's gRPC: the engine (embedded, or vLLM through its
    structured outputs) answers under it; one that does not compile is refused by name."""
    import re

    from transformers import AutoTokenizer

    async def scenario(client, proxy):
        def req(regex: str) -> pb.GenerateRequest:
            return pb.GenerateRequest(
                input_ids=[1, 2, 3], sampling_params=pb.SamplingParams(max_new_tokens=12, regex=regex)
            )

        outcomes = []
        for regex in ("(cat|dog)s?", "(unclosed"):
            try:
                outcomes.append(await client.stub.Generate(req(regex), timeout=30))
            except grpc.aio.AioRpcError as e:
                outcomes.append((e.code(), e.details()))
        return outcomes

    answer, bad = run(scenario, two_engines)
    assert bad[0] == grpc.StatusCode.INVALID_ARGUMENT and bad[1].startswith("sampling_params.regex"), bad
    text = AutoTokenizer.from_pretrained(tiny_model).decode(list(answer.output_ids)[:-1])
    assert re.fullmatch("(cat|dog)s?", text) and answer.finish_reason == common_pb2.FINISH_REASON_STOP, text


def test_suspend_update_resume_continues_from_partial_tokens(make_engine_process, tiny_model, tiny_model_b):
    _, url = make_engine_process()
    prompt = [1, 30, 31, 32]

    async def scenario(client, proxy):
        task = asyncio.create_task(client.generate(prompt, 600, request_id="long", **GREEDY))
        await decoding(proxy)
        suspended = await client.suspend(pb.SUSPEND_MODE_CONTINUE)
        update = await client.update_weights(tiny_model_b, 1)
        waiting = not task.done()
        await client.resume()
        return suspended, update, waiting, await task, await client.stats()

    suspended, update, waiting, out, stats = run(scenario, [url])
    assert suspended.num_in_flight == 1 and waiting
    assert update.success and [e.weight_version for e in update.engines] == [1]
    assert out.finish_reason == common_pb2.FINISH_REASON_LENGTH and len(out.output_ids) == 600
    assert out.num_segments == 2 and out.weight_version == 1 and stats.weight_version == 1
    versions = list(out.token_versions)
    switch = versions.index(1)
    assert set(versions[:switch]) == {0} and set(versions[switch:]) == {1}
    ids = list(out.output_ids)
    assert ids[:switch] == greedy(tiny_model, prompt, switch)
    assert ids[switch:] == greedy(tiny_model_b, prompt + ids[:switch], 600 - switch)


@pytest.fixture(scope="module")
def tiny_moe_b(tmp_path_factory) -> str:
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_moe_b"), TinyModelConfig(arch="qwen3-moe", seed=1)))


def _routing_of(model_path: str, ids: list[int]) -> np.ndarray:
    """The experts a forward of ``model_path`` routes each of ``ids`` to (SGLang's layout)."""
    from rollout.engines.embedded.routing import RoutingCapture

    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    capture = RoutingCapture(model)
    with torch.no_grad():
        model(torch.tensor([ids]))
    return capture.take(1, len(ids))[0]


def test_routing_across_an_update_is_each_positions_own_forwards(make_engine_process, tiny_moe, tiny_moe_b):
    """An MoE generation that spans suspend → update → resume has routing for every position but the
    last, as the new weights route them: the continuation re-forwarded the whole prefix, and its tokens
    were sampled with that routing (the old weights' is what the first segment sampled with: different)."""
    _, url = make_engine_process(model=tiny_moe)
    prompt = [1, 30, 31, 32]

    async def scenario(client, proxy):
        task = asyncio.create_task(client.generate(prompt, 300, request_id="moe", return_routed_experts=True, **GREEDY))
        await decoding(proxy)
        await client.suspend(pb.SUSPEND_MODE_CONTINUE)
        update = await client.update_weights(tiny_moe_b, 1)
        await client.resume()
        plain = await client.generate(prompt, 3, **GREEDY)
        return update, await task, plain

    update, out, plain = run(scenario, [url])
    assert update.success and out.num_segments == 2
    ids = prompt + list(out.output_ids)
    switch = len(prompt) + list(out.token_versions).index(1) - 1  # the last position the old weights forwarded
    r = out.routed_experts
    got = np.frombuffer(r.ids, dtype=np.uint8).reshape(-1, r.ids_per_token)
    assert got.shape == (len(ids) - 1, 4 * 2) and r.itemsize == 1
    a, b = _routing_of(tiny_moe, ids[:switch]), _routing_of(tiny_moe_b, ids[:-1])
    by_set = lambda x: np.sort(x.reshape(len(x), 4, 2), -1)  # noqa: E731 (two equal gates: either order)
    assert (by_set(got) == by_set(b)).all()
    assert (by_set(a) != by_set(b[:switch])).any()  # the two models route differently: the test can tell
    assert not plain.HasField("routed_experts")  # only when asked


def test_requests_still_queued_at_a_suspend_keep_their_engine_and_get_all_their_routing(make_engine_process, tiny_moe):
    """More requests than the engine runs at once (64): a suspend aborts the queued ones before their
    first forward, with no routing; they continue after resume with all of it, and the engine stays in
    rotation (an empty routing answer once took it out)."""
    _, url = make_engine_process(model=tiny_moe)
    prompts = [[1, 30 + i % 50, 31, 32] for i in range(80)]

    async def scenario(client, proxy):
        tasks = [
            asyncio.create_task(client.generate(p, 40, request_id=f"q{i}", return_routed_experts=True, **GREEDY))
            for i, p in enumerate(prompts)
        ]
        await decoding(proxy)
        await client.suspend(pb.SUSPEND_MODE_CONTINUE)
        await client.resume()
        return await asyncio.gather(*tasks), proxy.counters["retries"], [s.healthy for s in proxy.router.engines]

    outs, retries, healthy = run(scenario, [url])
    assert retries == 0 and healthy == [True]
    for p, out in zip(prompts, outs):
        r = out.routed_experts
        assert len(out.output_ids) == 40 and len(r.ids) == (len(p) + 40 - 1) * r.ids_per_token


def test_routing_asked_of_a_dense_model_is_invalid_argument_naming_the_field(embedded_engines):
    async def scenario(client, proxy):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.generate([1, 2, 3], 2, return_routed_experts=True)
        return e.value, await client.generate([1, 2, 3], 2)

    error, ok = run(scenario, embedded_engines)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("return_routed_experts:") and "no mixture-of-experts layers" in error.details()
    assert len(ok.output_ids) == 2  # and the proxy keeps serving


def teacher_forced(model_path, ids: list[int], start: int, temperature: float) -> list[float]:
    """log π(ids[i] | ids[:i]) at ``temperature`` for i >= start, from a fresh forward of the model."""
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float() / temperature, -1)
    return [logp[i - 1, ids[i]].item() for i in range(start, len(ids))]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_mu_across_an_update_is_each_tokens_own_versions_log_prob(
    make_engine_process, tiny_model, tiny_model_b, temperature
):
    """A sampled generation that spans suspend → update → resume: every token's behaviour log-prob
    equals a teacher-forced forward of the weights of the version it is tagged with, at the
    sampling temperature (the tokens after the switch belong to the new version, their prefix
    re-prefilled under it). This is the μ every off-policy correction divides by."""
    _, url = make_engine_process()
    prompt = [1, 30, 31, 32]
    sampling = {"temperature": temperature, "ignore_eos": True, "sampling_seed": 7}

    async def scenario(client, proxy):
        task = asyncio.create_task(client.generate(prompt, 400, request_id="sampled", **sampling))
        await decoding(proxy)
        await client.suspend(pb.SUSPEND_MODE_CONTINUE)
        await client.update_weights(tiny_model_b, 1)
        await client.resume()
        return await task

    out = run(scenario, [url])
    versions, ids, mu = list(out.token_versions), list(out.output_ids), list(out.behavior_logprobs)
    switch = versions.index(1)
    assert 0 < switch < len(ids) and set(versions[:switch]) == {0} and set(versions[switch:]) == {1}
    full = prompt + ids
    old = teacher_forced(tiny_model, full[: len(prompt) + switch], len(prompt), temperature)
    new = teacher_forced(tiny_model_b, full, len(prompt) + switch, temperature)
    err = [abs(a - b) for a, b in zip(old + new, mu, strict=True)]
    assert max(err) < 1e-3, f"max |μ - teacher-forced| {max(err):.2e} at token {err.index(max(err))} (switch {switch})"
    # the check can fail: the tokens after the switch under the old weights are far from μ
    stale = teacher_forced(tiny_model, full, len(prompt) + switch, temperature)
    assert sum(abs(a - b) for a, b in zip(stale, mu[switch:], strict=True)) / len(stale) > 1e-2


def test_a_proxy_started_in_front_of_updated_engines_serves_their_version(make_engine_process, tiny_model_b):
    """A restarted proxy must not report version 0 while its engines serve version 3."""
    _, url = make_engine_process()
    asyncio.run(engine_client(url).update_weights_from_disk(tiny_model_b, 3))

    async def scenario(client, proxy):
        return await client.stats(), await client.generate([1, 2], 3)

    stats, out = run(scenario, [url])
    assert stats.weight_version == 3 and stats.engines[0].weight_version == 3 and set(out.token_versions) == {3}


def test_a_proxy_started_in_front_of_paused_engines_resumes_them(make_engine_process):
    """A proxy killed between a weight update's pause and its resume left its engine paused; its
    successor starts unsuspended, so it resumes the engine: a request is answered, not held until
    its deadline (the SLURM run once waited out every generation after such a kill)."""
    _, url = make_engine_process()
    asyncio.run(engine_client(url).pause("abort"))

    async def scenario(client, proxy):
        return await client.stats(), await client.generate([1, 2], 3, timeout_s=20)

    stats, out = run(scenario, [url])
    assert not stats.suspended and out.finish_reason != common_pb2.FINISH_REASON_TIMEOUT and len(out.output_ids) >= 1


def test_a_proxy_started_while_a_colocated_trainer_holds_the_memory_leaves_it_to_the_trainer(make_engine_process):
    """Engines whose memory a colocated trainer holds refuse to resume: a starting proxy keeps them in
    rotation and paused, and the trainer's ResumeMemory through it gives the memory back and resumes."""
    _, url = make_engine_process()

    async def release():
        engine = engine_client(url)
        await engine.pause("abort")
        await engine.release_memory_occupation()
        await engine.close()

    asyncio.run(release())

    async def scenario(client, proxy):
        before = await client.stats()
        back = await client.resume_memory()
        return before, back, await client.generate([1, 2], 3, timeout_s=20)

    before, back, out = run(scenario, [url])
    assert before.engines[0].healthy and back.success, (before, back)
    assert out.finish_reason != common_pb2.FINISH_REASON_TIMEOUT and len(out.output_ids) >= 1


def test_suspend_abort_mode_and_gate(two_engines):
    async def scenario(client, proxy):
        task = asyncio.create_task(client.generate([1, 5], 1000, ignore_eos=True))
        await decoding(proxy)
        await client.suspend(pb.SUSPEND_MODE_ABORT)
        aborted = await task
        gated = await client.generate([1, 5], 2, timeout_s=0.5)  # waits at the closed gate until its deadline
        await client.resume()
        after = await client.generate([1, 5], 2)
        return aborted, gated, after

    aborted, gated, after = run(scenario, two_engines)
    assert aborted.finish_reason == common_pb2.FINISH_REASON_ABORT and 0 < len(aborted.output_ids) < 1000
    assert gated.finish_reason == common_pb2.FINISH_REASON_TIMEOUT and len(gated.output_ids) == 0
    assert len(after.output_ids) >= 1


def test_deadline_returns_partial_and_abort_rpc(two_engines):
    async def scenario(client, proxy):
        timed = await client.generate([1, 6], 1000, timeout_s=0.3, ignore_eos=True)
        task = asyncio.create_task(client.generate([1, 7], 1000, request_id="victim", ignore_eos=True))
        await decoding(proxy)
        n = await client.abort("victim")
        return timed, n.num_aborted, await task

    timed, n, victim = run(scenario, two_engines)
    assert timed.finish_reason == common_pb2.FINISH_REASON_TIMEOUT and len(timed.output_ids) > 0
    assert n == 1 and victim.finish_reason == common_pb2.FINISH_REASON_ABORT and len(victim.output_ids) < 1000


def test_a_stream_hands_tokens_over_as_made_and_they_join_to_the_result(two_engines, tiny_model):
    """GenerateStream (the agent gateway's streams): pieces of new tokens, then the result; with
    top_logprobs each position also carries its most likely tokens, greedy's first."""
    from rollout.sampling import SamplingParams
    from services.llm_proxy.client import ProxyGenerate

    async def scenario(client, proxy):
        port, pieces = ProxyGenerate(client), []
        sampling = SamplingParams(max_new_tokens=24, **GREEDY)
        streamed = await port.generate(
            [1, 40, 41], sampling, request_id="s", route="s", timeout_s=60, top_logprobs=3, on_tokens=pieces.append
        )
        unary = await port.generate([1, 40, 41], sampling, request_id="u", route="u", timeout_s=60, top_logprobs=3)
        return pieces, streamed, unary

    pieces, streamed, unary = run(scenario, two_engines)
    assert streamed.output_ids == greedy(tiny_model, [1, 40, 41], 24) == unary.output_ids
    assert [t for p in pieces for t in p] == streamed.output_ids and len(pieces) > 1  # incremental, all of it
    for gen in (streamed, unary):
        assert len(gen.top_logprobs) == 24
        for token, lp, top in zip(gen.output_ids, gen.behavior_logprobs, gen.top_logprobs, strict=True):
            assert len(top) == 3 and [x[1] for x in top] == sorted((x[1] for x in top), reverse=True)
            assert top[0][0] == token and top[0][1] == pytest.approx(lp, abs=1e-3)  # greedy: the most likely


def test_a_stream_whose_caller_goes_away_is_aborted(two_engines):
    async def scenario(client, proxy):
        req = pb.GenerateRequest(
            request_id="gone",
            input_ids=[1, 8],
            timeout_s=60,
            sampling_params=pb.SamplingParams(max_new_tokens=900, ignore_eos=True),
        )
        call = client.stub.GenerateStream(req, timeout=60)
        first = await call.read()
        call.cancel()
        for _ in range(100):  # the proxy aborts it at the engine and forgets it
            if not proxy.in_flight:
                break
            await asyncio.sleep(0.05)
        return first, dict(proxy.in_flight), proxy.counters

    first, in_flight, counters = run(scenario, two_engines)
    assert len(first.output_ids) >= 1 and not first.HasField("result")
    assert in_flight == {} and counters["finished_abort"] == 1


def test_failed_update_reports_per_engine_and_keeps_version(two_engines):
    async def scenario(client, proxy):
        before = proxy.weight_version
        res = await client.update_weights("/does/not/exist", 99)
        return before, res, await client.stats()

    before, res, stats = run(scenario, two_engines)
    assert not res.success and len(res.engines) == 2
    assert all(not e.success and "model_path" in e.message for e in res.engines), res.engines
    assert stats.weight_version == before and all(e.weight_version == before for e in stats.engines)


def test_dead_engine_leaves_rotation_and_comes_back(make_engine_process, tiny_model):
    port = free_port()
    proc_a, url_a = make_engine_process(port)
    _, url_b = make_engine_process()

    async def scenario(client, proxy):
        os.kill(proc_a.pid, signal.SIGKILL)
        proc_a.wait(10)
        outs = await asyncio.gather(*(client.generate([1, 2, 3], 4, route=f"k{i}", ignore_eos=True) for i in range(6)))
        down = await client.stats()
        make_engine_process(port)  # same address: the health loop must notice it again
        for _ in range(100):
            if all(e.healthy for e in (await client.stats()).engines):
                break
            await asyncio.sleep(0.1)
        return outs, down, await client.stats()

    outs, down, up = run(scenario, [url_a, url_b])
    assert all(len(o.output_ids) == 4 and o.engine == "engine-1" for o in outs)
    assert not down.engines[0].healthy and down.engines[0].failures_total >= 1
    assert all(e.healthy for e in up.engines)


def test_a_missed_health_probe_is_not_an_outage_but_missing_several_is(make_engine_process):
    """A busy engine may miss one /health probe; only ``health_failures_to_remove`` in a row take it out."""
    proc_a, url_a = make_engine_process()
    _, url_b = make_engine_process()

    async def stopped(client, seconds: float):  # the engine is frozen: its probes time out
        os.kill(proc_a.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)
            return await client.stats()  # still frozen: the health loop cannot have put it back yet
        finally:
            os.kill(proc_a.pid, signal.SIGCONT)

    async def scenario(client, proxy):
        await stopped(client, 0.5)  # at most two probes (0.2 s apart, 0.5 s timeout) miss
        await asyncio.sleep(1.0)
        blip = await client.stats()
        out = await stopped(client, 4.0)
        for _ in range(100):
            if (await client.stats()).engines[0].healthy:
                break
            await asyncio.sleep(0.1)
        return blip, out, await client.stats()

    blip, out, back = run(scenario, [url_a, url_b], health_check_timeout_s=0.5, health_failures_to_remove=3)
    assert blip.engines[0].healthy and blip.engines[0].failures_total == 0
    assert not out.engines[0].healthy and out.engines[0].failures_total == 1
    assert back.engines[0].healthy and back.engines[1].healthy


def test_grpc_health_service(two_engines):
    async def scenario(client, proxy):
        stub = health_pb2_grpc.HealthStub(client._channel)
        res = await stub.Check(health_pb2.HealthCheckRequest(service="rollmesh.v1.LLMProxy"), timeout=5)
        return res.status

    assert run(scenario, two_engines) == health_pb2.HealthCheckResponse.SERVING


def test_images_through_the_proxy_and_across_an_update_with_bad_ones_named(make_engine_process, tiny_vl):
    """A vision-language prompt's images go through the LLMProxy to the engine, and again with the
    continuation after suspend → update → resume (its prompt's placeholders expanded anew); an image
    over the size limit, or one the engine cannot read, is INVALID_ARGUMENT naming it, and the proxy
    keeps serving."""
    from transformers import AutoTokenizer

    from sample_buffer.vision import MAX_IMAGE_BYTES, image_bytes
    from tests.rollout.test_engine_vision import png

    _, url = make_engine_process(model=tiny_vl)
    start, pad, end = AutoTokenizer.from_pretrained(tiny_vl).convert_tokens_to_ids(
        ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
    )
    prompt, image = [1, start, pad, end, 70], image_bytes(png(28, 28, 0))

    async def scenario(client, proxy):
        one = await client.generate(prompt, 6, images=(image,), **GREEDY)
        task = asyncio.create_task(client.generate(prompt, 300, request_id="vl", images=(image,), **GREEDY))
        await decoding(proxy)
        await client.suspend(pb.SUSPEND_MODE_CONTINUE)
        update = await client.update_weights(tiny_vl, 1)  # the same weights: the continuation must agree
        await client.resume()
        errors = []
        for bad in ((b"x" * (MAX_IMAGE_BYTES + 1),), (b"not an image",), (image, image)):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.generate(prompt, 2, images=bad)
            errors.append(e.value)
        return one, update, await task, errors, await client.generate(prompt, 6, images=(image,), **GREEDY)

    one, update, spanned, errors, again = run(scenario, [url])
    assert one.prompt_tokens == len(prompt) - 1 + 16 and list(again.output_ids) == list(one.output_ids)
    assert update.success and spanned.num_segments == 2
    assert list(spanned.output_ids[:6]) == list(one.output_ids)  # the continuation saw the image again
    assert [e.code() for e in errors] == [grpc.StatusCode.INVALID_ARGUMENT] * 3
    assert [e.details().split(":")[0] for e in errors] == ["images[0]", "image_data[0]", "image_data"]


def _group(prompt, n, max_new, route="g", **sampling):
    request = pb.GenerateRequest(
        input_ids=prompt, route=route, sampling_params=pb.SamplingParams(max_new_tokens=max_new, **sampling)
    )
    return pb.GenerateGroupRequest(request=request, request_ids=[f"{route}/{i}" for i in range(n)])


def test_a_groups_samples_are_one_engine_call_each_answered_on_its_own(two_engines):
    """GenerateGroup: 4 samples of one prompt, in request_ids' order, each sampled on its own; one engine
    call for all of them where the engine samples n at once (the embedded engine), 4 on vLLM (its
    prefix cache shares the prompt). Bad groups are INVALID_ARGUMENT naming request_ids."""

    async def scenario(client, proxy):
        before = {e.name: e.requests_total for e in (await client.stats()).engines}
        out = await client.stub.GenerateGroup(_group([1, 40, 41], 4, 24, ignore_eos=True, temperature=1.0), timeout=60)
        after = {e.name: e.requests_total for e in (await client.stats()).engines}
        errors = {}
        dup = _group([1, 2], 2, 2)
        dup.request_ids[:] = ["same", "same"]
        tops = _group([1, 2], 2, 2)
        tops.request.top_logprobs = 2
        for name, req in {"duplicate": dup, "empty": _group([1, 2], 0, 2), "top_logprobs": tops}.items():
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.stub.GenerateGroup(req, timeout=30)
            errors[name] = (e.value.code(), e.value.details())
        # the engine serves on (sampled: without ignore_eos an early end of sequence was the model's)
        return (
            out,
            {k: after[k] - before.get(k, 0) for k in after},
            errors,
            await client.generate([1, 2], 2, ignore_eos=True),
        )

    out, calls, errors, ok = run(scenario, two_engines)
    assert [s.request_id for s in out.samples] == [f"g/{i}" for i in range(4)]
    assert all(len(s.output_ids) == 24 == len(s.behavior_logprobs) == len(s.token_versions) for s in out.samples)
    assert len({tuple(s.output_ids) for s in out.samples}) > 1  # sampled on their own
    assert len({s.engine for s in out.samples}) == 1  # the group's route: one engine
    assert sum(calls.values()) == (1 if getattr(two_engines, "api", "sglang") == "sglang" else 4)
    for name, (code, details) in errors.items():
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("request_ids:"), (name, details)
    assert len(ok.output_ids) == 2


def test_a_groups_sample_aborts_alone_and_the_rest_continue_across_an_update(make_engine_process, tiny_model_b):
    """A group of 3 long samples in one engine call: sample 0 aborted by its own id ends alone (abort,
    its tokens so far); a suspend → update → resume cuts the other two, which each continue on their
    own under the new weights, every token tagged with the version that made it."""
    _, url = make_engine_process()

    async def scenario(client, proxy):
        req = _group([1, 30, 31, 32], 3, 600, temperature=1.0, ignore_eos=True)
        task = asyncio.ensure_future(client.stub.GenerateGroup(req, timeout=120))
        await decoding(proxy)
        await client.abort(request_id="g/0")
        await asyncio.sleep(0.05)
        suspended = await client.suspend(pb.SUSPEND_MODE_CONTINUE)
        await client.update_weights(tiny_model_b, 1)
        await client.resume()
        return suspended, await task, await client.stats()

    suspended, out, stats = run(scenario, [url])
    first, *rest = out.samples
    assert first.finish_reason == common_pb2.FINISH_REASON_ABORT and 0 < len(first.output_ids) < 600
    assert set(first.token_versions) == {0}
    assert suspended.num_in_flight == 3  # the aborted sample's answer comes back with the group's call
    for s in rest:
        assert s.finish_reason == common_pb2.FINISH_REASON_LENGTH and len(s.output_ids) == 600
        assert s.num_segments == 2 and s.weight_version == 1
        versions = list(s.token_versions)
        switch = versions.index(1)
        assert switch > 0 and set(versions[:switch]) == {0} and set(versions[switch:]) == {1}
    assert stats.engines[0].requests_total == 1 + 2  # the group's call, then each continuation alone
