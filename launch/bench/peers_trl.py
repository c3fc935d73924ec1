"""TRL's GRPOTrainer on one of rollmesh's tasks, as a user of TRL would write it: `rollmesh bench peers`
runs this file with the peers' environment's Python (`.venv-peers`: TRL and what it needs, pinned in
`launch/bench/peers_bench.py`), never rollmesh's own. It imports from rollmesh only the task's reward
function (`rollout.rewards`, on PYTHONPATH), so both sides score answers with the same code.

Everything the task fixes is set to the task's value (model, data, reward, group size, prompts a step,
learning rate and its schedule, weight decay, gradient clip, answer length, temperature, one update a
batch, no KL); everything else is TRL's default. The held-out set is scored greedily every
``--eval-every`` steps by a callback whose time is measured and taken out of the wall clock, so TRL's
time to a held-out score is its training time alone. Prints one JSON line (and writes ``--out``).

    python launch/bench/peers_trl.py --task TASK.json --out result.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", required=True, help="the task as JSON (peers_bench.Task)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    task = json.loads(Path(args.task).read_text())

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rollout.rewards import REWARDS

    if task["threads"]:
        torch.set_num_threads(task["threads"])
    score = REWARDS[task["reward"]]
    rows = [json.loads(line) for line in Path(task["train_path"]).read_text().splitlines() if line.strip()]
    heldout = [json.loads(line) for line in Path(task["heldout_path"]).read_text().splitlines() if line.strip()]
    chat = lambda text: [{"role": "user", "content": text}]  # noqa: E731  (rollmesh renders the same one turn)
    data = Dataset.from_list([{"prompt": chat(r["prompt"]), "answer": str(r["answer"])} for r in rows])
    tok = AutoTokenizer.from_pretrained(task["model_path"])
    tok.padding_side = "left"

    def reward(completions, answer, **_):
        return [score(c[0]["content"] if isinstance(c, list) else c, a) for c, a in zip(completions, answer)]

    config = GRPOConfig(
        output_dir=task["out_dir"],
        use_cpu=True,
        seed=task["seed"],
        max_steps=task["steps"],
        per_device_train_batch_size=task["prompts_per_step"] * task["group_size"],
        gradient_accumulation_steps=1,
        num_generations=task["group_size"],
        max_completion_length=task["max_new_tokens"],
        temperature=task["temperature"],
        learning_rate=task["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        num_iterations=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )

    def heldout_accuracy(model) -> float:
        model.eval()
        right = 0
        with torch.no_grad():
            for i in range(0, len(heldout), 64):
                part = heldout[i : i + 64]
                texts = [
                    tok.apply_chat_template(chat(r["prompt"]), add_generation_prompt=True, tokenize=False) for r in part
                ]
                enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
                out = model.generate(
                    **enc, max_new_tokens=task["max_new_tokens"], do_sample=False, pad_token_id=tok.pad_token_id
                )
                for r, ids in zip(part, out[:, enc["input_ids"].shape[1] :]):
                    right += score(tok.decode(ids, skip_special_tokens=True), str(r["answer"])) >= 1.0
        model.train()
        return right / len(heldout)

    class Clock(TrainerCallback):
        """Step ends (training wall clock, the held-out scoring taken out) and held-out scores."""

        def __init__(self) -> None:
            self.t0 = self.cpu0 = None
            self.evaluating = 0.0
            self.ends: list[float] = []
            self.cpu: list[float] = []
            self.heldout: list[dict] = []

        def on_train_begin(self, args, state, control, model=None, **kw):
            self.heldout.append({"step": 0, "accuracy": heldout_accuracy(model), "train_wall_s": 0.0})
            self.t0, self.cpu0 = time.perf_counter(), _cpu_s()

        def on_step_end(self, args, state, control, model=None, **kw):
            now, cpu = time.perf_counter(), _cpu_s()
            self.ends.append(now - self.t0 - self.evaluating)
            self.cpu.append(cpu - self.cpu0)
            last = state.global_step == task["steps"]
            if last or (task["eval_every"] and state.global_step % task["eval_every"] == 0):
                acc = heldout_accuracy(model)
                self.heldout.append({"step": state.global_step, "accuracy": acc, "train_wall_s": self.ends[-1]})
                self.evaluating += time.perf_counter() - now
                self.cpu0 += _cpu_s() - cpu  # the scoring's CPU is not the training's either

    clock = Clock()
    trainer = GRPOTrainer(
        model=task["model_path"],
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=tok,
        callbacks=[clock],
    )
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    steps = [b - a for a, b in zip([0.0, *clock.ends], clock.ends)]
    logged = [h for h in trainer.state.log_history if "reward" in h]
    generated = sum(h.get("completions/mean_length", 0.0) for h in logged) * config.per_device_train_batch_size
    out = {
        "side": "trl",
        "trl_version": __import__("trl").__version__,
        "steps": len(steps),
        "step_s_median": statistics.median(steps),
        "step_s_min": min(steps),
        "step_s_max": max(steps),
        "train_wall_s": clock.ends[-1],
        "wall_s": total,
        "heldout": clock.heldout,
        "rewards": [h["reward"] for h in logged],
        "generated_tokens_per_s": generated / clock.ends[-1],
        "cpu_s_per_step": {"trl": clock.cpu[-1] / len(steps)},
        "threads": torch.get_num_threads(),
    }
    Path(args.out).write_text(json.dumps(out))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
