"""Shared fixtures: a tiny model built once per session, real engine server processes."""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
import threading
import weakref

import pytest

from services.auth import CONTROL_TOKEN_ENV, PROVIDER_TOKEN_ENV, TOKEN_ENV
from services.processes import start_engine_process, stop_process
from tests.engines import TEST_LOAD_ROOTS, EnginePool, start_vllm_engines
from trainer.tiny_model import TinyModelConfig, build_tiny_model

# Every service a test starts, in this process or as a child, checks these tokens (each its roles');
# every client sends them. Environment providers check a token of their own.
for _name in (TOKEN_ENV, CONTROL_TOKEN_ENV, PROVIDER_TOKEN_ENV):
    os.environ.setdefault(_name, f"test-{_name.lower()}-" + secrets.token_urlsafe(16))


# Two workers on two cores: one torch thread each. With torch's default (a thread per core) each worker's
# OpenMP threads spin against the other's, and a test of many small ops (an MoE's expert loop) ran 50x
# slower (27 s against 0.5 s).
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)


# `make test` runs two workers (pytest-xdist). Tests that share something machine-wide run on one
# worker: a module's costly service (a Tinker service, a SLURM cluster), the session's vLLM servers
# (started once, not once a worker) and the code sandbox's uids (uid_base + slot in every process:
# two processes' runs would share one process limit, so a fork bomb in one could starve the other).
# The scheduler below reads these groups off the test ids: xdist's own `--dist loadgroup` marks them
# by rewriting `item._nodeid`, which pytest 9.2 no longer reads (its ids live in `_id`), and the
# "grouped" tests had been spread over both workers.
_GROUPS = {
    # One Tinker service (its base model and engine) for the file, not one on each worker.
    "tinker": ("tests/services/test_tinker.py",),
    "slurm": ("tests/deploy/test_slurm.py",),  # one cluster (munged, slurmctld, two slurmd)
    "vllm": (
        "tests/services/test_vllm_engine.py",
        "tests/services/test_vllm_lora.py",
        "tests/services/test_llm_proxy.py",
        "::test_rollmesh_run_on_vllm_engines",
        "::test_each_run_is_served_its_own_adapter_at_its_own_version[vllm]",
    ),
    "sandbox": (
        "tests/rollout/test_sandbox.py",
        "tests/launch/test_reward_bench.py",
        "tests/services/test_reward_service.py",
        "::test_the_multi_domain_example_trains_each_domain_and_scores_each_held_out_set",
    ),
}
# The slowest files first, so that two workers share them rather than one ending the run alone.
_FIRST = ("tests/test_run_e2e.py", "tests/launch/test_async_bench.py")
# Marked `serial`: `make test` runs them after the two workers, alone on the machine. They time what a
# process does against the clock (a sandbox's kill at its deadline, an event loop's longest stall, a
# scrape within its interval), and under the other worker's load they failed.
_SERIAL = ("tests/rollout/test_sandbox.py", "tests/rollout/test_reward_pool.py", "tests/deploy/test_prometheus.py")


def pytest_addoption(parser):
    parser.addoption(
        "--serial-files",
        action="store_true",
        help="collect only the files that hold serial tests (`make test`'s second run: importing the others took 7 s)",
    )


def pytest_ignore_collect(collection_path, config):
    if (
        config.getoption("serial_files")
        and collection_path.name.startswith("test_")
        and collection_path.suffix == ".py"
    ):
        return None if collection_path.as_posix().endswith(_SERIAL) else True
    return None


def xdist_group_of(nodeid: str) -> str | None:
    """The group a test runs in (all of a group on one worker), or None: any worker."""
    return next((group for group, where in _GROUPS.items() if any(w in nodeid for w in where)), None)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(_SERIAL):
            item.add_marker(pytest.mark.serial)
    first = {f: i for i, f in enumerate(_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))  # stable within each


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, present when `-n` is given
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """Each group is one unit of work, sent whole to one worker; every other test is its own unit."""

        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid) or nodeid

    return GroupScheduling(config, log)


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test(request):
    """A test that runs `rollmesh run` and fails (its timeout, pytest-timeout's) kills only its direct
    child: the services that child started kept running, on two cores, through the rest of the suite.
    After each test with a tmp_path, every process whose command line names that directory is killed, and
    every process those started."""
    if "tmp_path" not in request.fixturenames:
        yield
        return
    where = str(request.getfixturevalue("tmp_path"))  # now: it is torn down before this fixture's end
    yield
    import signal
    from pathlib import Path

    def named(args: list[str]) -> bool:
        return any(
            a == where or a.startswith(where + "/") or f"={where}/" in a or a.endswith(f"={where}") for a in args
        )

    parent, doomed = {}, set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            parent[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if named((proc / "cmdline").read_bytes().decode(errors="replace").split("\0")):
                doomed.add(int(proc.name))
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
    while True:  # and whatever they started
        more = {pid for pid, ppid in parent.items() if ppid in doomed} - doomed
        if not more:
            break
        doomed |= more
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class _LoopRecordingPolicy(asyncio.DefaultEventLoopPolicy):
    """The default policy, keeping a weak reference to each loop it makes (asyncio.run's among them)."""

    loops: weakref.WeakSet = weakref.WeakSet()

    def new_event_loop(self):
        loop = super().new_event_loop()
        self.loops.add(loop)
        return loop


asyncio.set_event_loop_policy(_LoopRecordingPolicy())


def _print_tasks(loop) -> None:
    tasks = asyncio.all_tasks(loop)
    print(f"\n+++ {len(tasks)} asyncio tasks of a loop still running near the test's timeout +++", file=sys.stderr)
    for task in tasks:
        print(f"--- {task!r}", file=sys.stderr)
        task.print_stack(limit=12, file=sys.stderr)


@pytest.fixture(autouse=True)
def _hung_loops_show_their_tasks(request):
    """pytest-timeout's dump shows a test hung in asyncio.run as its main thread in `select`: which
    coroutine waits on what is in the loop's tasks. Twenty seconds before the timeout, each running loop
    prints its tasks' stacks (to the test's captured stderr, shown with its failure)."""
    marker = request.node.get_closest_marker("timeout")
    timeout = float(marker.args[0] if marker and marker.args else request.config.getini("timeout") or 0)
    if timeout <= 30:
        yield
        return

    def dump() -> None:
        for loop in list(_LoopRecordingPolicy.loops):
            if loop.is_running():
                loop.call_soon_threadsafe(_print_tasks, loop)

    timer = threading.Timer(timeout - 20, dump)
    timer.daemon = True
    timer.start()
    yield
    timer.cancel()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelConfig(seed=0)))


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory) -> str:
    """The tiny model's shape as a Qwen3-MoE: 8 experts, top-2, in each of 4 layers."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_moe"), TinyModelConfig(arch="qwen3-moe", seed=0)))


@pytest.fixture(scope="session")
def tiny_vl(tmp_path_factory) -> str:
    """A tiny Qwen2-VL: the dense decoder at half the tiny model's size, a 2-block vision tower, 4-pixel patches."""
    cfg = TinyModelConfig(arch="qwen2-vl", hidden_size=64, num_hidden_layers=2, seed=0)
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_vl"), cfg))


@pytest.fixture(scope="session")
def smollm2() -> str:
    """SmolLM2-135M-Instruct, as `make test` converts it (converted here if a bare pytest runs first)."""
    from pathlib import Path

    from trainer.packaged_models import convert

    path = Path(__file__).resolve().parents[1] / "models" / "smollm2"
    if not (path / "config.json").exists():
        convert("smollm2-135m-instruct", path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_digits() -> str:
    """The quickstart's model (examples/quickstart.yaml): the tiny model after its format-only warm-up,
    as `make test` builds it (built here if a bare pytest runs first)."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "models" / "tiny-digits"
    if not (path / "model.safetensors").exists():  # written after config.json
        build_tiny_model(path, TinyModelConfig(digit_prior_steps=100))  # the Makefile's recipe
    return str(path)


@pytest.fixture(scope="session")
def tiny_model_b(tmp_path_factory) -> str:
    """Same architecture, other weights: what a weight update switches to."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_b"), TinyModelConfig(seed=1)))


@pytest.fixture(scope="session")
def engine_url(tiny_model):
    proc, url = start_engine_process(tiny_model, extra=TEST_LOAD_ROOTS)
    yield url
    stop_process(proc)


@pytest.fixture(scope="session")
def vllm_engines(tiny_model):
    """Two vLLM servers (from `make vllm`'s environment) serving the tiny model, for the session.
    A test that updates their weights puts the tiny model back (at a later version)."""
    engines = start_vllm_engines(tiny_model, 2)
    yield engines
    for p in engines.procs:
        stop_process(p, 30)


@pytest.fixture(scope="session")
def engine_pool():
    pool = EnginePool()
    yield pool
    pool.close()


# What a pooled engine may be started with: the session's models (never one a test wrote into its own
# folder), and no argument but the data type.
_POOLED_EXTRAS = {(), ("dtype=bfloat16",)}


@pytest.fixture
def make_engine_process(tiny_model, engine_pool, request):
    """Engine processes for one test: an idle one of the pool's where one fits, reset as new
    (tests/engines.py), else a new process. After the test each is given back to the pool, or stopped."""
    session_models = {
        tiny_model,
        *(request.getfixturevalue(f) for f in ("tiny_vl", "tiny_moe") if f in request.fixturenames),
    }
    taken, procs = [], []

    def start(port: int | None = None, model: str | None = None, extra: tuple[str, ...] = ()):
        model = model or tiny_model
        args = [*TEST_LOAD_ROOTS, *extra]
        if port is None and model in session_models and tuple(extra) in _POOLED_EXTRAS:
            proc, url = engine_pool.start(model, args)
            taken.append((model, args, proc, url))
        else:
            proc, url = start_engine_process(model, port, extra=args)
            procs.append(proc)
        return proc, url

    yield start
    try:
        for model, args, proc, url in taken:
            engine_pool.give_back(model, args, proc, url)
    finally:
        for p in procs:
            stop_process(p)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    from services.processes import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()
