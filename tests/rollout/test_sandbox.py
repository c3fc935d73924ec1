"""The code sandbox with real processes (bubblewrap, rlimits): programs that attack the machine are
contained, scored 0 with their cause counted, and the reward goes on scoring; the adaptive timeout
against the slides' formula; HumanEval's own solutions pass through the code reward."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import pytest
from pydantic import ValidationError

from rollout.config import RolloutConfig
from rollout.envs.humaneval_data import humaneval_rows
from rollout.verifiers.adaptive_timeout import AdaptiveTimeoutConfig, TimeoutAnchors, adaptive_timeout
from rollout.verifiers.code import CodeReward, CodeRewardConfig, extract_program, program_for
from rollout.verifiers.sandbox import Sandbox, SandboxConfig

SQUARE = json.dumps({"task_id": "sq", "tests": "assert square(3) == 9\nassert square(-2) == 4", "entry_point": None})
RIGHT = "```python\ndef square(x):\n    return x * x\n```"


@pytest.fixture(scope="module")
def reward():
    return CodeReward(CodeRewardConfig(timeout=AdaptiveTimeoutConfig(t_min_s=1.0, t_max_s=3.0, lam=2.0)))


def attack(body: str) -> str:
    return f"```python\n{body}\ndef square(x):\n    return x * x\n```"


def test_a_right_answer_scores_1_and_a_wrong_one_0(reward):
    assert reward(RIGHT, SQUARE) == 1.0
    assert reward("```python\ndef square(x):\n    return x + x\n```", SQUARE) == 0.0
    assert reward("no code at all", SQUARE) == 0.0


@pytest.mark.parametrize("exit_call", ["import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit"])
def test_a_wrong_answer_that_exits_0_before_the_tests_scores_0(reward, exit_call):
    """The known reward hack of code RL: leave with status 0 before a failing test can run."""
    before = reward.failures["early_exit"]
    assert reward(f"```python\ndef square(x):\n    return 0\n{exit_call}\n```", SQUARE) == 0.0
    assert reward.failures["early_exit"] == before + 1


def test_the_program_is_in_no_file_it_could_read():
    """It comes on stdin: the end marker in it is in no file the answer could print."""
    box = Sandbox()
    r = box.run("import sys, os\nprint(sys.argv, os.listdir('.'))", timeout_s=5)
    assert r.outcome == "ok" and r.stdout.strip() == "['-'] []"


def test_the_sandbox_sees_only_usr_and_its_scratch(tmp_path):
    box = Sandbox()
    (tmp_path / "secret").write_text("the project's file")
    probe = f"""
import os
for p in ("/etc/passwd", "/root", "/home", "/work", "{tmp_path}/secret", "{__file__}"):
    print(p, os.path.exists(p))
open("/box/note", "w").write("scratch works")
try:
    open("/dev/shm/big", "wb").write(b"x" * 64 * 1024 * 1024)  # more than its 16 MiB
    print("wrote /dev/shm/big")
except OSError as e:
    print("refused /dev/shm/big", type(e).__name__)
print(open("/box/note").read())
for p in ("/usr/evil", "/evil", "/dev/evil", "{tmp_path}/escaped"):
    try:
        open(p, "w").write("x")
        print("wrote", p)
    except OSError as e:
        print("refused", p, type(e).__name__)
print("uid", os.getuid())
"""
    r = box.run(probe, timeout_s=5)
    assert r.outcome == "ok", r.stderr
    assert "True" not in r.stdout and "wrote" not in r.stdout, r.stdout
    assert "scratch works" in r.stdout and r.stdout.count("refused") == 5
    assert "uid 0" not in r.stdout
    assert not (tmp_path / "escaped").exists()


@pytest.fixture
def listener():
    """A real TCP server on loopback that records whether anything reached it."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    srv.settimeout(0.2)
    reached = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                reached.append(srv.accept())
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield srv.getsockname()[1], reached
    stop.set()
    t.join(2)
    srv.close()


def test_no_network(reward, listener):
    port, reached = listener
    program = attack(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'leak')")
    assert reward(program, SQUARE) == 0.0
    time.sleep(0.3)
    assert reached == []  # the program's loopback is its own (an empty network namespace)
    assert reward(RIGHT, SQUARE) == 1.0  # and the reward goes on


@pytest.mark.parametrize(
    ("name", "body", "outcome", "within_s"),
    [
        ("spin forever", "while True:\n    pass", "timeout", 6),
        ("sleep forever", "import time\ntime.sleep(3600)", "timeout", 6),
        ("allocate 4 GiB", "x = bytearray(4 * 1024 ** 3)", "memory", 3),
        ("print gigabytes", "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", "output", 3),
        (
            "fork bomb",
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
            "timeout",
            6,
        ),
        ("segfault", "import ctypes\nctypes.string_at(0)", "killed", 3),
    ],
)
def test_an_attack_is_contained_scored_0_and_counted(reward, name, body, outcome, within_s):
    before = dict(reward.failures)
    t0 = time.monotonic()
    assert reward(attack(body), SQUARE) == 0.0
    assert time.monotonic() - t0 < within_s, name
    assert reward.failures[outcome] == before[outcome] + 1, (name, reward.outcomes)
    assert reward(RIGHT, SQUARE) == 1.0  # the next answer is scored as ever
    if name == "fork bomb":  # nothing of it outlives its run
        uids = range(
            reward.config.sandbox.uid_base, reward.config.sandbox.uid_base + reward.config.sandbox.max_concurrent
        )
        left = subprocess.run(["pgrep", "-u", ",".join(map(str, uids))], capture_output=True, text=True).stdout
        assert left.strip() == ""


def test_output_is_capped():
    box = Sandbox(SandboxConfig(max_output_bytes=4096))
    r = box.run("print('y' * 10**7)", timeout_s=5)
    assert r.outcome == "output" and len(r.stdout) <= 4096


def test_runs_at_once_are_bounded_by_max_concurrent():
    box = Sandbox(SandboxConfig(max_concurrent=2))
    t0 = time.monotonic()
    threads = [threading.Thread(target=box.run, args=("import time; time.sleep(0.5)", 5)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 1.0 <= time.monotonic() - t0 < 4.0  # 4 runs of 0.5 s, 2 at a time
    assert box.counts["ok"] == 4  # the start-up check is not counted


def test_adaptive_timeout_is_the_slides_formula():
    for anchor in (0.01, 0.3, 1.0, 4.0, 100.0):
        assert adaptive_timeout(anchor, 0.5, 10.0, 3.0) == min(max(0.5, 3.0 * anchor), 10.0)
    assert adaptive_timeout(None, 0.5, 10.0, 3.0) == 10.0  # no correct answer yet: the fixed limit
    anchors = TimeoutAnchors(AdaptiveTimeoutConfig(t_min_s=0.5, t_max_s=10, lam=2))
    anchors.correct("a", 0.4)
    anchors.correct("a", 1.5)
    anchors.correct("b", 0.1)
    assert anchors.timeout_for("a") == 3.0 and anchors.timeout_for("b") == 0.5
    assert anchors.timeout_for("new") == 3.0  # an unseen task: the anchor over all tasks
    fixed = TimeoutAnchors(AdaptiveTimeoutConfig(enabled=False, t_max_s=7))
    fixed.correct("a", 0.1)
    assert fixed.timeout_for("a") == 7
    with pytest.raises(ValidationError, match="t_min_s"):
        AdaptiveTimeoutConfig(t_min_s=5, t_max_s=1)


def test_a_run_that_would_only_time_out_is_stopped_at_the_adaptive_limit():
    reward = CodeReward(CodeRewardConfig(timeout=AdaptiveTimeoutConfig(t_min_s=0.5, t_max_s=8.0, lam=2.0)))
    assert reward(RIGHT, SQUARE) == 1.0  # the anchor: a fast correct run
    t0 = time.monotonic()
    assert reward(attack("while True:\n    pass"), SQUARE) == 0.0
    assert time.monotonic() - t0 < 3.0  # cut at max(0.5, 2 x anchor), not at the fixed 8 s
    assert reward.adaptive_cuts == 1 and reward.failures["timeout"] == 1


def test_the_program_is_the_last_code_block_and_continues_a_given_signature():
    assert extract_program("a\n```python\nx = 1\n```\nthen\n```\ny = 2\n```") == "y = 2\n"
    assert extract_program("```python\nz = 3\n") == "z = 3\n"  # cut by a length stop: still runs
    task = {"prompt": "def f(x):\n", "tests": "def check(c):\n    assert c(1) == 2\n", "entry_point": "f"}
    assert program_for("    return x + 1\n", task).startswith("def f(x):\n    return x + 1\n")
    whole = program_for("```python\ndef f(x):\n    return 2 * x\n```", task)
    assert whole.count("def f(") == 1 and whole.rstrip().endswith("check(f)")


def test_humaneval_solutions_pass_and_their_corruptions_fail(reward):
    rows = humaneval_rows(with_solutions=True)
    assert len(rows) == 164
    for row in rows[:12]:
        task = json.loads(row["answer"])
        assert reward(row["canonical_solution"], row["answer"]) == 1.0, task["task_id"]
        assert reward("    return None\n", row["answer"]) == 0.0, task["task_id"]


def test_the_code_reward_is_a_typed_variant_of_the_config():
    cfg = RolloutConfig(reward={"type": "code", "sandbox": {"memory_mb": 256}, "timeout": {"t_max_s": 5}})
    assert isinstance(cfg.reward, CodeRewardConfig) and cfg.reward.sandbox.memory_mb == 256
    assert RolloutConfig(reward="digit_answer").reward == "digit_answer"
    with pytest.raises(ValidationError, match="reward_workers.workers"):
        RolloutConfig(reward={"type": "code"}, reward_workers={"workers": 2})
    with pytest.raises(ValidationError, match="memory_gb"):
        RolloutConfig(reward={"type": "code", "sandbox": {"memory_gb": 1}})


DETACH = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:  # a grandchild in a session of its own: outside the run's process group
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):  # and off the run's pipes, so the run ends without it
            os.dup2(null, fd)
        time.sleep(60)
    os._exit(0)
print(os.getuid())
"""


@pytest.mark.parametrize("isolation", ["none", "bwrap"])
def test_a_detached_process_does_not_outlive_its_run(isolation):
    """With isolation none a program that detached (setsid + double fork) used to live on under the
    slot's uid, able to watch and signal the next answer's run there. Every process of the uid goes."""
    box = Sandbox(SandboxConfig(isolation=isolation, max_concurrent=1))
    r = box.run(DETACH, timeout_s=10)
    assert r.outcome == "ok", r
    uid = int(r.stdout.split()[-1])
    assert uid == box.config.uid_base  # the slot's own uid, not root
    lingering = subprocess.run(["pgrep", "-u", str(uid)], capture_output=True, text=True).stdout.split()
    assert lingering == []
    check = box.run("import os; print(open('/proc/self/status').read())", timeout_s=10)
    assert "NoNewPrivs:\t1" in check.stdout  # and nothing it execs gains privileges


def test_a_slots_uid_is_held_by_one_process_of_the_machine_at_a_time():
    """Two processes' sandboxes share uid_base: a run holds its uid through a lock file, so another
    process's run waits (and is never killed by this one's sweep of the uid)."""
    box = Sandbox(SandboxConfig(max_concurrent=1))
    other = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from rollout.verifiers.sandbox import Sandbox, SandboxConfig;"
            "box = Sandbox(SandboxConfig(max_concurrent=1)); print('ready', flush=True);"
            "r = box.run('import time; time.sleep(3); print(1)', 10);"
            "print(r.outcome, r.stdout.strip())",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert other.stdout.readline().strip() == "ready"  # its start-up check is over: what runs next is the sleep
    deadline = time.monotonic() + 30
    while not subprocess.run(["pgrep", "-u", str(box.config.uid_base)], capture_output=True).stdout:
        assert time.monotonic() < deadline and other.poll() is None, "the other process's run never started"
        time.sleep(0.02)
    mine = box.run("print(2)", timeout_s=0.5)  # its run holds the uid for 3 s
    assert mine.outcome == "busy" and "in use by another process" in mine.stderr
    assert other.communicate(timeout=30)[0].split() == ["ok", "1"]  # and was left alone (its run, its output)
    assert box.run("print(2)", timeout_s=5).stdout.strip() == "2"


EQUAL_TO_EVERYTHING = [
    "class E:\n    def __eq__(self, other):\n        return True\ndef square(x):\n    return E()",
    "class E(int):\n    __eq__ = lambda self, other: True\ndef square(x):\n    return E(0)",
    "class E:\n    __eq__ = bool\ndef square(x):\n    return E()",  # a builtin as __eq__: truthy for 9 and 4
    "class E:\n    def __eq__(self, other):\n        return True\ndef square(x):\n    return [E()][0]",
    "from unittest.mock import ANY\ndef square(x):\n    return ANY",  # a library's object equal to all
    "class E:\n    __eq__ = id\ndef square(x):\n    return E()",
    "ns = {}\nexec('def eq(s, o): return True', ns)\nclass E:\n    __eq__ = ns['eq']\ndef square(x):\n    return E()",
    "from fractions import Fraction\nFraction.__eq__ = lambda s, o: True\ndef square(x):\n    return Fraction(0)",
    "from collections import namedtuple\nP = namedtuple('P', 'a')\nP.__eq__ = lambda s, o: True\n"
    "def square(x):\n    return P(0)",
]


@pytest.mark.parametrize("body", EQUAL_TO_EVERYTHING)
def test_an_object_equal_to_everything_passes_no_test(reward, body):
    """The equality trick: `assert square(3) == 9` passed for any object whose __eq__ says yes."""
    assert reward(f"```python\n{body}\n```", SQUARE) == 0.0


def test_values_of_the_standard_librarys_classes_still_compare_by_their_own_equality(reward):
    tests = (
        "assert f(1) == Fraction(1, 3)\nassert g() == (1, 2)\nassert h() == {'a': [1, (2, 3)]}\n"
        "assert f(2) == Fraction(2, 3), 'with a message'"
    )
    task = json.dumps({"tests": "from fractions import Fraction\n" + tests})
    answer = (
        "from __future__ import annotations\nfrom fractions import Fraction\nfrom collections import namedtuple\n"
        "P = namedtuple('P', 'x y')\ndef f(n):\n    return Fraction(n, 3)\ndef g():\n    return P(1, 2)\n"
        "def h():\n    return {'a': [1, (2, 3)]}\n"
    )
    assert reward(answer, task) == 1.0
    assert reward(answer.replace("Fraction(n, 3)", "Fraction(n, 4)"), task) == 0.0


def test_a_class_the_tests_define_compares_by_its_own_equality(reward):
    """A ListNode the task's tests bring (with their __eq__) is the tests' word, not the answer's."""
    tests = (
        "class Node:\n    def __init__(self, v, nxt=None):\n        self.v, self.nxt = v, nxt\n"
        "    def __eq__(self, o):\n        return isinstance(o, Node) and (self.v, self.nxt) == (o.v, o.nxt)\n"
        "assert rev(Node(1, Node(2))) == Node(2, Node(1))\n"
    )
    answer = "def rev(n):\n    out = None\n    while n:\n        out, n = Node(n.v, out), n.nxt\n    return out\n"
    assert reward(answer, json.dumps({"tests": tests})) == 1.0
    assert reward(answer.replace("Node(n.v, out)", "Node(n.v + 1, out)"), json.dumps({"tests": tests})) == 0.0
