"""Arithmetic questions scored by grpo.py's math reward (the default for any task without its own):

python grpo.py data.dataset_name=examples.arithmetic:task
"""

import numpy as np


def task(n: int, seed: int) -> list[dict]:
    """Rows {"question": "What is a op b?", "answer"}, a and b in 0..99, op one of + - *."""
    rng = np.random.default_rng(seed)
    a, b, ops = rng.integers(0, 100, n), rng.integers(0, 100, n), rng.choice(list("+-*"), n)
    answers = {"+": a + b, "-": a - b, "*": a * b}
    return [{"question": f"What is {a[i]} {ops[i]} {b[i]}?", "answer": str(answers[ops[i]][i])} for i in range(n)]
