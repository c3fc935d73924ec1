"""`rollmesh run` end to end on the quickstart config, cut down to a few steps."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.auth import TOKEN_ENV


def quickstart_cmd(model, run_dir, *overrides: str) -> list[str]:
    """``rollmesh run examples/quickstart.yaml`` on ``model``, writing to ``run_dir``, plus overrides."""
    cmd = [sys.executable, "-m", "launch.cli", "run", "examples/quickstart.yaml"]
    for o in (f"model_path={model}", f"train_loop.run_dir={run_dir}", *overrides):
        cmd += ["--set", o]
    return cmd


def _processes_with(variable: str) -> list[int]:
    """Live processes whose environment holds ``NAME=value`` ``variable``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and variable.encode() in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found


def test_rollmesh_run_on_vllm_engines(tiny_model, tmp_path):
    """The quickstart with `engine: {type: vllm}`: the launcher starts vLLM, the proxy speaks its
    API, the trainer's versions reach it from disk, held-out evaluation runs through it, and
    nothing of vLLM is left running after."""
    import yaml

    config = yaml.safe_load((Path("examples") / "quickstart.yaml").read_text())
    config["engine"] = {"type": "vllm", "enforce_eager": True, "executor": "uni", "max_running_requests": 128}
    path = tmp_path / "vllm.yaml"
    path.write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "run"
    cmd = quickstart_cmd(tiny_model, run_dir, "train_loop.steps=3", "controller.groups_per_step=2")
    cmd[cmd.index("examples/quickstart.yaml")] = str(path)
    mark = f"ROLLMESH_TEST_RUN={tmp_path.name}"  # inherited by every process the run starts, vLLM's too
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, ROLLMESH_TEST_RUN=tmp_path.name)
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^final: steps=3 .* heldout_accuracy=[\d.]+", proc.stdout, re.M), proc.stdout[-2000:]
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2, 3] and all(m["published"] for m in steps)
    assert not _processes_with(mark), "processes of the run (vLLM's among them) left running after it returned"


def test_the_multi_domain_example_trains_each_domain_and_scores_each_held_out_set(tiny_model, tmp_path):
    """`examples/multi-domain.yaml` (math scored by math-verify, code run against its asserts in the
    sandbox, a format task by word count), cut to 2 steps of 3 groups of 4 answers and 3 held-out
    problems a domain, scored at step 1 too, on the tiny model (its bytes tokenizer spells every
    domain's text; SmolLM2 took 4 minutes alone on a slow 2-core machine and timed out beside the other
    worker): the steps train the domains by weight, and each domain's held-out set is scored with its
    own reward, before, during and after, in a table, heldout.jsonl and the summary `rollmesh compare`
    reads. (What SmolLM2 learns on them in 40 steps is `make examples`' and docs/examples.md's.)"""
    import yaml

    config = yaml.safe_load(Path("examples/multi-domain.yaml").read_text())
    for d in config["env_manager"]["domains"]:
        cut = tmp_path / f"{d['name']}_heldout.jsonl"
        cut.write_text("".join(Path(d["heldout_path"]).read_text().splitlines(keepends=True)[:3]))
        d["heldout_path"] = str(cut)
    run_dir = tmp_path / "run"
    config["model_path"] = tiny_model
    config["buffer"]["filter_zero_variance"] = False  # a random model's groups mostly score all 0: keep them
    config["train_loop"] |= {"run_dir": str(run_dir), "steps": 2}
    config["controller"]["groups_per_step"] = 3
    config["env_manager"] |= {"group_size": 4, "num_workers": 6}
    config["run"]["eval_every"] = 1
    path = tmp_path / "multi-domain.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run(
        [sys.executable, "-m", "launch.cli", "run", str(path)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout.split("held-out accuracy before training:", 1)[1].split("\n")[:6]
    assert "over all domains" in table[0] and "prompts  accuracy" in table[1]
    assert {line.split()[0] for line in table[2:5]} == {"math", "code", "format"}
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2] and all(m["published"] for m in steps)
    trained = {d: [m.get(f"domain/{d}/groups", 0) for m in steps] for d in ("math", "code", "format")}
    assert [sum(n) for n in zip(*trained.values(), strict=True)] == [3, 3]  # every slot a domain's
    assert all(sum(n) >= 1 for n in trained.values()), trained  # 6 slots at 0.4/0.4/0.2: each within one
    assert all(0.0 <= v <= 1.0 for m in steps for k, v in m.items() if k.endswith("/reward_mean"))
    scores = [json.loads(x) for x in (run_dir / "heldout.jsonl").read_text().splitlines()]
    assert scores[0]["when"] == "before training" and scores[-1]["when"] == "after training"
    assert any(s["when"].startswith("at step") for s in scores)  # the periodic one, while training went on
    assert all(set(s["by_domain"]) == {"math", "code", "format"} for s in scores)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["heldout_by_domain_after"]) == {"math", "code", "format"}
    assert summary["heldout_after"] == pytest.approx(sum(summary["heldout_by_domain_after"].values()) / 3)
    logs = proc.stdout + proc.stderr + (run_dir / "logs" / "env_manager.log").read_text()
    assert "skipping fork() handlers" not in logs  # sandboxes start without a fork in a gRPC process
    # `rollmesh compare` reads the run back: the held-out scores it printed, the curve's two steps
    plot = tmp_path / "compare.png"
    cmp = subprocess.run(
        [sys.executable, "-m", "launch.cli", "compare", str(run_dir), "--out", str(plot), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cmp.returncode == 0, cmp.stderr[-2000:]
    row = json.loads(cmp.stdout.splitlines()[-1])[str(run_dir)]
    assert (row["heldout_before"], row["heldout_after"]) == (summary["heldout_before"], summary["heldout_after"])
    assert row["steps"] == 2 and len(row["reward_by_window"]) == 2 and plot.stat().st_size > 1000


# Two mesh start-ups and 5 steps; the bound leaves room for the other worker's vLLM tests beside it.
@pytest.mark.timeout(600)
def test_the_quickstart_trains_reports_resumes_where_it_stopped_and_stops_on_sigterm(tiny_digits, tmp_path):
    """The quickstart cut to 4 synchronous steps of 4 groups: it reports the held-out accuracy before and after,
    its progress and its reward curve; then the whole mesh starts again in the same run directory:
    the engines serve the checkpoint's weights from the start (held-out accuracy as at step 4), the
    trainer goes on at step 5 and the metrics continue; SIGTERM then stops it and every service. How
    far it learns is a learning curve, `make examples`' (300 steps: held-out 0.91-1.00); that a step
    moves the policy towards rewarded answers is tests/trainer/test_engine.py's. (It asserted learning
    within 50 steps here until one run of many did not: 50 steps of 1,280 answers each are a curve,
    not a behaviour.)

    Both runs take the mesh's other paths at once: the episodes and the held-out answers are scored by
    a reward service the run starts (`reward: {type: service}`); the trainer runs under torchrun
    (run.trainer_procs=2: two gloo ranks (FSDP2) train on whole groups, rank 0 publishes over the
    http_buckets transport and logs, and both resume from the checkpoint); a teacher (on-policy
    distillation) of the policy's own weights, on its own engine and LLMProxy, scores every group (its
    log-probs are the sampling engine's, so the student's gap to it starts at ~0); and no token is in
    the environment (rollmesh run makes one and every service gets it)."""
    model = tiny_digits
    run_dir = tmp_path / "run"
    # A quarter of its batch (4 groups of 8 a step): the steps, the report and the resume are what is tested.
    sync = ("train_loop.checkpoint_every=4", "controller.async_ratio=0", "controller.groups_per_step=4")
    paths = (
        "env_manager.reward={type: service}",
        "reward_service.reward=digit_answer",
        "run.trainer_procs=2",
        "train_loop.publisher.type=http_buckets",
        "train_loop.publisher.bucket_mb=1",
        f"teachers=[{{name: self, model_path: {model}}}]",
        "env_manager.teacher=self",
        "env_manager.teacher_top_k=4",
    )
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    cmd = quickstart_cmd(model, run_dir, "train_loop.steps=4", *sync, *paths)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    trainer_log = run_dir / "logs" / "trainer.log"
    log = trainer_log.read_text() if trainer_log.exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + log[-3000:]
    before = re.search(r"held-out accuracy before training: ([\d.]+)", proc.stdout)
    final = re.search(
        r"^final: steps=4 reward_mean_last5=[\d.]+ heldout_accuracy=([\d.]+) wall_s=[\d.]+$", proc.stdout, re.M
    )
    assert before and final, proc.stdout[-2000:]
    assert float(before.group(1)) < 0.25  # the format prior answers digits, at chance on which one
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2, 3, 4] and all(m["published"] for m in steps)  # rank 0 only writes
    assert all(0 <= m["reward_mean"] <= 1 for m in steps), steps
    assert re.search(r"^step 4/4  reward [\d.]+ .* elapsed [\d:]+  eta 0:00$", proc.stdout, re.M), proc.stdout[-1000:]
    assert f"reward curve: {run_dir / 'reward_curve.png'}" in proc.stdout
    assert (run_dir / "reward_curve.png").stat().st_size > 1000
    assert "trainer: 2 rank(s)" in log and "weights over http_buckets" in log
    ckpt = run_dir / "checkpoints" / "step_4"
    assert (ckpt / "COMPLETE").exists() and (ckpt / "extra_rank1.pt").exists()
    assert (run_dir / "weights" / "v4" / "model.safetensors").exists()  # the restore point
    # Every trained token scored by the teacher; at the policy's first weights the gap is the engines' numerics.
    assert all(m["taught_share"] == 1.0 for m in steps) and abs(steps[0]["teacher_kl"]) < 1e-3, steps
    # and its top 4 at each: at the policy's own weights the forward KL to them is -log of the policy's
    # mass on them, which is at least 4 / vocabulary (they are its 4 most likely)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    assert 0 <= steps[0]["teacher_top_kl"] <= math.log(vocab / 4) and all(m["teacher_top_kl"] >= 0 for m in steps)
    # The EnvManager's workers started after the first evaluation and were stopped before the last;
    # its Stats went into the summary: at least the 4 x 4 groups trained were put.
    rollouts = json.loads((run_dir / "summary.json").read_text())["rollouts"]
    assert rollouts["running"] is False and rollouts["groups_put"] >= 4 * 4, rollouts
    assert re.search(rf"^rollouts: {rollouts['groups_put']} groups put, failures: ", proc.stdout, re.M)
    # Every trained episode (4 steps x 4 groups x 8) and the held-out answers, before and after, were scored there.
    scored = re.search(r"scored (\d+) answers \(\{'ok': (\d+)\}\)", (run_dir / "logs" / "reward.log").read_text())
    heldout = len(Path("examples/find_digit_heldout.jsonl").read_text().splitlines())
    assert scored and int(scored.group(1)) == int(scored.group(2)) >= 4 * 4 * 8 + 2 * heldout
    leftovers = subprocess.run(["pgrep", "-f", f"train_loop.run_dir={run_dir}"], capture_output=True, text=True)
    assert leftovers.stdout.strip() == "", "services still running after rollmesh run returned"

    # The second run is stopped with SIGTERM once it has trained a step: every service goes with it.
    metrics = run_dir / "metrics.jsonl"
    proc = subprocess.Popen(
        quickstart_cmd(model, run_dir, "train_loop.steps=1000", *sync, *paths),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and len(metrics.read_text().splitlines()) < 5:
            time.sleep(0.5)
        os.kill(proc.pid, signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert proc.returncode == 130, out[-3000:]
    at_resume = re.search(r"held-out accuracy at resume: ([\d.]+)", out)
    assert "resuming from" in out and at_resume, out[-2000:]
    # Greedy answers from the same weights; only batching can flip a near-tie.
    assert abs(float(at_resume.group(1)) - float(final.group(1))) <= 0.05, out[-2000:]
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert steps[:5] == list(range(1, 6)), steps  # step 5 followed step 4
    time.sleep(1)
    leftovers = subprocess.run(["pgrep", "-f", f"train_loop.run_dir={run_dir}"], capture_output=True, text=True)
    assert leftovers.stdout.strip() == "", "services still running after SIGTERM"


@pytest.mark.timeout(900)
def test_every_service_killed_mid_run_comes_back_and_no_group_is_lost_or_trained_twice(tiny_model):
    """`rollmesh bench chaos` without its undisturbed baseline, on a fixed schedule: the engine,
    LLMProxy, controller, SampleBuffer, redis-server, EnvManager, trainer, and a teacher's engine and
    LLMProxy (the run distills from one) each get SIGKILL 0.2 s after a step ends (the buffer on
    Redis); the run trains every step, and every group the buffer stored is accounted for. (The
    bench kills at random moments within a step.)"""
    from launch.bench.chaos_bench import SERVICES, TEACHER_SERVICES, run

    lines: list[str] = []
    result = run(tiny_model, steps_between=1, baseline=False, progress=lines.append, kill_delay_s=0.2, teacher=True)
    shown = json.dumps(result)  # every number, whatever fails (how long each took is the bench's to report)
    assert list(result["kill_to_next_step_s"]) == [*SERVICES, *TEACHER_SERVICES], lines
    # 0.0: a step already under way when the service died (rounded to 0.1 s)
    assert all(s >= 0 for s in result["kill_to_next_step_s"].values()), shown
    assert list(result["kill_to_serving_again_s"]) == [*SERVICES, *TEACHER_SERVICES]
    assert all(s >= 0 for s in result["kill_to_serving_again_s"].values()), shown
    # each came back (a restarted controller that cannot restore yet exits and is started again)
    assert all(n >= 1 for n in result["restarts_by_the_launcher"].values()), shown
    assert result["groups_lost"] == 0 and result["groups_trained_twice"] == 0, shown
    assert result["groups_trained"] == 2 * result["steps"], shown  # every step of the curve, 2 groups each
    assert (
        result["groups_consumed"]
        >= result["groups_trained"] + result["groups_trained_by_a_killed_trainer_before_its_checkpoint"]
    )


@pytest.mark.parametrize(
    "example, env, provider_args",
    [("calculator", "calculator", ["dataset_path=examples/math/sum1_train.jsonl", "reward=math_verify"])],
)
def test_the_agentic_examples_run_through_a_provider(tiny_model, tmp_path, example, env, provider_args):
    """The README's two commands for an agentic example: a provider process, then `rollmesh run`
    (cut to 2 steps of 2 groups on the tiny model). Multi-turn episodes reach the trainer over gRPC.
    (The other examples take the same path with other environments, which tests cover on their own:
    GEM's guess_number in tests/rollout/test_envs.py, a provider over HTTP in
    tests/services/test_env_provider.py, digit_retry's tries in tests/rollout/test_envs.py; `make
    examples` runs each whole.)"""
    from services.processes import start_provider_process, stop_process

    provider, address, url = start_provider_process(env, provider_args)  # gRPC's address, HTTP's URL
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "launch.cli", "run", f"examples/agentic/{example}.yaml"]
    overrides = [
        f"model_path={tiny_model}",
        f"train_loop.run_dir={run_dir}",
        "train_loop.steps=2",
        "controller.groups_per_step=2",
        "env_manager.group_size=4",
        "env_manager.num_workers=4",
        "buffer.filter_zero_variance=false",
        "trainer.num_threads=1",
        "run.heldout_episodes=4",
    ]
    for o in [*overrides, f"env_manager.env.addresses=[{address}]"]:
        cmd += ["--set", o]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
        metrics = httpx.get(url + "/metrics").text
    finally:
        stop_process(provider)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
    summary = json.loads((run_dir / "summary.json").read_text())  # held-out: unseen seeds, greedy, through it
    assert 0.0 <= summary["heldout_before"] <= 1.0 and 0.0 <= summary["heldout_after"] <= 1.0
    steps = re.search(r'rollmesh_provider_events_total\{event="step"\} ([\d.]+)', metrics)
    assert steps and float(steps.group(1)) >= 2 * 2 * 4  # every episode of 2 steps x 2 groups x 4 stepped it


def test_the_external_agent_example_trains_on_the_agents_sessions(tiny_model, tmp_path):
    """The README's two commands for training an external agent: `rollmesh run` with the gateway in
    place of the EnvManager (cut to 2 steps of 2 groups on the tiny model), and the agent script
    against it until the run ends and the gateway goes away."""
    from services.processes import free_port, wait_http_healthy

    port, run_dir = free_port(), tmp_path / "run"
    cmd = [sys.executable, "-m", "launch.cli", "run", "examples/agent/train_agent.yaml"]
    for o in [
        f"model_path={tiny_model}",
        f"train_loop.run_dir={run_dir}",
        "train_loop.steps=2",
        "controller.groups_per_step=2",
        f"gateway.port={port}",
    ]:
        cmd += ["--set", o]
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_http_healthy(f"http://127.0.0.1:{port}/health", 300, run)
        agent = subprocess.run(
            [
                sys.executable,
                "examples/agent/digit_agent.py",
                "--url",
                f"http://127.0.0.1:{port}",
                "--concurrency",
                "2",
                "--group-size",
                "4",
                "--key-file",
                str(run_dir / "agent.key"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        out, _ = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.send_signal(signal.SIGTERM)
            run.wait(30)
    assert run.returncode == 0, out[-3000:]
    assert agent.returncode == 0, agent.stdout[-2000:] + agent.stderr[-2000:]
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2] and all(m["published"] for m in steps)
    assert all(m["turns_mean"] >= 1.0 for m in steps)  # the agent's sessions, one or two turns each
    assert re.search(r"^final: steps=2 .* heldout_accuracy=[\d.]+", out, re.M), out[-2000:]


def test_the_vision_example_trains_on_pictures_through_the_whole_mesh(tiny_vl, tmp_path):
    """`examples/vision-digits.yaml` cut to 3 steps on a tiny Qwen2-VL: pictures from the environment
    reach the engine, the buffer keeps each once per group, the trainer sees them and publishes its
    vision tower with the rest, and the held-out pictures are scored before and after."""
    from rollout.envs.digit_pictures import digit_picture_rows
    from rollout.envs.reasoning_gym_data import write_jsonl

    heldout, run_dir = tmp_path / "heldout.jsonl", tmp_path / "run"
    write_jsonl(digit_picture_rows(20, 1), heldout)
    cmd = [sys.executable, "-m", "launch.cli", "run", "examples/vision-digits.yaml", "--fresh"]
    for o in (
        f"model_path={tiny_vl}",
        f"train_loop.run_dir={run_dir}",
        f"run.heldout_path={heldout}",
        "train_loop.steps=3",
        "controller.groups_per_step=4",
        "env_manager.generate.size=40",
    ):
        cmd += ["--set", o]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "held-out accuracy before training:" in proc.stdout
    final = re.search(r"^final: steps=3 reward_mean_last5=[\d.]+ heldout_accuracy=([\d.]+)", proc.stdout, re.M)
    assert final and 0.0 <= float(final.group(1)) <= 1.0
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3] and all(s["published"] for s in steps)
    assert steps[-1]["tokens"] > 0
