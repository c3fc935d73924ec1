"""Write the quickstart's task: find the one digit hidden in a short string of letters.

    python examples/make_find_digit.py   # rewrites examples/find_digit_{train,heldout}.jsonl

The skill (attend to the digit, copy it) generalises to strings never seen in training, so
held-out accuracy measures learning, not memorisation. Held-out strings never occur in train.
"""

import json
import random
import string
from pathlib import Path


def make(rng: random.Random) -> dict:
    letters = [rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 5))]
    digit = str(rng.randint(0, 9))
    letters.insert(rng.randint(0, len(letters)), digit)
    return {"prompt": "".join(letters), "answer": digit}


def main(n_train: int = 500, n_heldout: int = 100) -> None:
    here = Path(__file__).parent
    rng = random.Random(1)
    train = [make(rng) for _ in range(n_train)]
    seen = {r["prompt"] for r in train}
    heldout = []
    while len(heldout) < n_heldout:
        row = make(rng)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            heldout.append(row)
    for name, rows in (("train", train), ("heldout", heldout)):
        (here / f"find_digit_{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
