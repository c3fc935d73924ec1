"""`rollmesh launch slurm` on a real SLURM cluster (two nodes on this machine, tests/deploy/slurm_cluster.py):
the quickstart as a batch job whose services are job steps, the engine on a node of its own; a
killed step restarted; scancel stopping every step; and what is refused before anything runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from launch.config import ConfigError, load_config
from launch.slurm import check_gpus, check_transport, engine_node_gpus, job_script
from tests.deploy.slurm_cluster import SlurmCluster, pids_with
from tests.deploy.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    c.runs = tmp_path_factory.mktemp("slurm_runs")  # the jobs' run directories, and only theirs
    yield c
    c.cancel_all(str(c.runs))  # nothing of a failed test's job outlives it (other tests' processes do)
    c.stop()


def launch(cluster: SlurmCluster, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "launch.cli", "launch", "slurm", "examples/quickstart.yaml", *args]
    env = dict(cluster.env, **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def quickstart(model: str, run_dir: Path, steps: int) -> list[str]:
    sets = [f"model_path={model}", f"train_loop.run_dir={run_dir}", f"train_loop.steps={steps}"]
    sets += ["slurm.engine_nodes=1", "run.heldout_path=null", "controller.async_ratio=0"]
    sets += ["controller.groups_per_step=4"]  # a quarter of the quickstart's batch: the steps are what is tested
    sets += ["slurm.time_limit='10:00'"]  # Slurm's own backstop, whatever the test does
    return [a for s in sets for a in ("--set", s)]


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.timeout(400)
def test_the_quickstart_runs_as_job_steps_and_a_killed_step_is_restarted(cluster, tiny_model, tmp_path):
    run_dir = cluster.runs / tmp_path.name
    secret = "a-token-of-the-users-own"  # from the launching shell: in tokens.env, and nowhere Slurm keeps
    done = launch(cluster, *quickstart(tiny_model, run_dir, 12), env={"ROLLMESH_TOKEN": secret})
    assert done.returncode == 0, done.stderr
    job = done.stdout.split()[-1]
    assert f"scancel {job}" in done.stdout
    out = run_dir / "slurm" / f"job-{job}.out"
    try:
        # The services as steps: the engine on the second node, the rest on the first.
        steps = wait_for(
            lambda: (s := cluster.steps(job)) and {x["Name"] for x in s} >= {"engine", "rollmesh"} and s,
            120,
            f"no engine and service steps: {out.read_text() if out.exists() else ''}",
        )
        assert {x["NodeList"] for x in steps if x["Name"] == "engine"} == {"n1"}, steps
        assert {x["NodeList"] for x in steps if x["Name"] == "rollmesh"} == {"n0"}, steps
        wait_for(lambda: steps_done(run_dir) >= 1, 180, f"no step trained: {out.read_text()}")
        # SIGKILL the LLMProxy's process: its step ends, and the run starts it again as a new step.
        proxy = [p for p in pids_with(str(run_dir)) if b"llm-proxy" in Path(f"/proc/{p}/cmdline").read_bytes()]
        proxy = [p for p in proxy if Path(f"/proc/{p}/cmdline").read_bytes().startswith(sys.executable.encode())]
        assert len(proxy) == 1, proxy
        os.kill(proxy[0], signal.SIGKILL)
        ended = cluster.wait_job(job, 240)
    finally:
        cluster.run("scancel", job, check=False)
    log = out.read_text()
    assert ended["JobState"] == "COMPLETED" and ended["ExitCode"] == "0:0", (ended, log[-3000:])
    assert "llm-proxy exited" in log and "restart 1" in log, log[-3000:]
    assert "http://127.0.0.2:" in log, log[-3000:]  # the engine, dialled at the second node's address
    targets = {t["labels"]["job"]: t["targets"] for t in json.loads((run_dir / "prometheus_targets.json").read_text())}
    assert all(t.startswith("127.0.0.2:") for t in targets["engine"]), targets  # scraped where it runs
    assert all(t.startswith("127.0.0.1:") for t in targets["launcher"] + targets["trainer"]), targets
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == list(range(1, 13))
    assert (run_dir / "logs" / "engine-0.log").exists() and (run_dir / "logs" / "proxy.log").exists()
    # The tokens: in a file only this user reads; not in the script, the job's output or Slurm's state.
    tokens = run_dir / "slurm" / "tokens.env"
    assert f"ROLLMESH_TOKEN={secret}" in tokens.read_text() and oct(tokens.stat().st_mode & 0o777) == "0o600"
    assert secret not in (run_dir / "slurm" / "job.sh").read_text() and secret not in log
    kept = [p for p in (cluster.dir / "state").rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert not kept, kept
    assert not pids_with(str(run_dir)), "a process of the run outlived its job"


@pytest.mark.timeout(300)
def test_sigterm_to_the_run_stops_every_step(cluster, tiny_model, tmp_path):
    """SIGTERM to the batch step alone (`scancel --batch`): the run stops its steps itself. (A plain
    `scancel` has Slurm signal every step as well.)"""
    run_dir = cluster.runs / tmp_path.name
    done = launch(cluster, *quickstart(tiny_model, run_dir, 200))
    assert done.returncode == 0, done.stderr
    job = done.stdout.split()[-1]
    try:
        # once the engine and the first services are up as steps (the mesh starting, nothing to lose)
        wait_for(lambda: len(cluster.steps(job)) >= 4, 120, "the services' steps did not start")
        cluster.run("scancel", "--batch", "--signal=TERM", job)
        ended = cluster.wait_job(job, 60)
    finally:
        cluster.run("scancel", job, check=False)
    assert ended["JobState"] in ("FAILED", "CANCELLED"), ended  # interrupted: the run exits 130
    assert "interrupted: stopping the mesh" in (run_dir / "slurm" / f"job-{job}.out").read_text()
    wait_for(lambda: not pids_with(str(run_dir)), 30, lambda: f"left running: {pids_with(str(run_dir))}")


def test_a_job_asking_for_gpus_the_cluster_lacks_is_refused_naming_the_option(cluster, tiny_model, tmp_path):
    done = launch(cluster, *quickstart(tiny_model, tmp_path / "run", 1), "--set", "slurm.gpus_per_node=1")
    assert done.returncode == 1
    assert "sbatch refused" in done.stderr and "slurm.gpus_per_node" in done.stderr, done.stderr
    assert "gres" in done.stderr.lower(), done.stderr  # Slurm's own words


def test_launcher_slurm_outside_a_job_says_how_to_submit(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    cmd = [sys.executable, "-m", "launch.cli", "run", "examples/quickstart.yaml", "--launcher", "slurm"]
    cmd += ["--set", f"train_loop.run_dir={tmp_path}"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert done.returncode == 2
    assert "SLURM_JOB_ID is not set" in done.stdout and "rollmesh launch slurm" in done.stdout


def test_what_the_job_could_not_place_is_refused_before_submitting():
    cfg = load_config(
        None,
        ["devices.placement=disaggregated", "devices.engine_gpus=[0]", "devices.trainer_gpus=[1]"],
    )
    with pytest.raises(ValueError, match="slurm.gpus_per_node: 0, but devices places 2 GPU"):
        check_gpus(cfg)
    cfg.slurm.gpus_per_node = 2
    check_gpus(cfg)
    cfg = load_config(None, ["run.num_engines=4", "slurm.engine_nodes=8"])
    with pytest.raises(ValueError, match="slurm.engine_nodes: 8 nodes for run.num_engines=4"):
        check_gpus(cfg)
    # engines of their own nodes take GPUs whenever the job asks for some, whatever `devices` says
    cfg = load_config(None, ["run.num_engines=4", "slurm.engine_nodes=1", "slurm.gpus_per_node=2"])
    with pytest.raises(ValueError, match="each engine node runs engines of 4 GPU"):
        check_gpus(cfg)
    # a collective weight group does not reach across nodes yet
    cfg = load_config(None, ["slurm.engine_nodes=1", "train_loop.publisher.type=collective", "trainer.dtype=float32"])
    with pytest.raises(ValueError, match="train_loop.publisher: collective across nodes"):
        check_transport(cfg)


def test_engines_take_their_nodes_gpus_in_turn():
    # 4 engines of 2 GPUs over 2 nodes: engines 0 and 2 on the first, 1 and 3 on the second
    assert [engine_node_gpus(i, 2, 2, 4) for i in range(4)] == ["0,1", "0,1", "2,3", "2,3"]
    assert engine_node_gpus(0, 1, 1, 0) is None


def test_the_job_script_holds_options_and_no_secret(tmp_path):
    cfg = load_config(None, ["slurm.partition=gpu", "slurm.time_limit='2:00:00'", "slurm.gpus_per_node=8"])
    cfg.slurm.sbatch_args = ["--account=rl"]
    text = job_script(cfg, Path("examples/quickstart.yaml"), ["train_loop.steps=3"], tmp_path)
    for line in ("#SBATCH --partition=gpu", "#SBATCH --time=2:00:00", "#SBATCH --gres=gpu:8", "#SBATCH --account=rl"):
        assert line in text
    assert "--launcher slurm --set train_loop.steps=3" in text and "--fresh" not in text  # a requeue resumes
    assert f". {tmp_path / 'tokens.env'}" in text and "TOKEN=" not in text
    with pytest.raises(ConfigError, match="slurm.time_limit: .*quoted string"):  # YAML's 2:00:00 is 7200
        load_config(None, ["slurm.time_limit=2:00:00"])
