"""Write the example prompt dataset under examples/data/ (deterministic; rerun to regenerate).

    python examples/make_example_data.py

``fractions.jsonl``: ``"What is 1/2 + 1/3?"`` with the reduced answer as a LaTeX label
(``"\\frac{5}{6}"``, or ``"2"`` for a whole number), scored by
:func:`miles.rewards.math.math_verify_reward`, so ``5/6``, ``\\frac{5}{6}`` and ``10/12`` all count.
``fractions_heldout.jsonl``: the evaluation file (no prompt of it is in the training file).
Each row also has ``response``: a correct plain answer (``5/6``) that the warm start trains on.
Used by ``task=jsonl`` (conf/task/jsonl.yaml) and tests/test_datasets.py.
"""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

OUT = Path(__file__).resolve().parent / "data"


def rows(seed: int = 0, max_denominator: int = 6) -> list[dict[str, str]]:
    """Every ``a/b op c/d`` (op ``+`` or ``-`` with a non-negative result), shuffled under ``seed``."""
    out = []
    for b in range(2, max_denominator + 1):
        for d in range(2, max_denominator + 1):
            for a in range(1, b):
                for c in range(1, d):
                    for op in "+-":
                        x, y = Fraction(a, b), Fraction(c, d)
                        value = x + y if op == "+" else x - y
                        if value < 0:
                            continue
                        plain = str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
                        latex = (str(value.numerator) if value.denominator == 1
                                 else f"\\frac{{{value.numerator}}}{{{value.denominator}}}")
                        out.append({"prompt": f"What is {a}/{b} {op} {c}/{d}?", "label": latex, "response": plain})
    random.Random(seed).shuffle(out)
    return out


def main() -> None:
    data = rows()
    heldout, train = data[:64], data[64:]
    OUT.mkdir(parents=True, exist_ok=True)
    for name, part in (("fractions.jsonl", train), ("fractions_heldout.jsonl", heldout)):
        with (OUT / name).open("w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
        print(f"wrote {len(part)} rows to {OUT / name}")


if __name__ == "__main__":
    main()
