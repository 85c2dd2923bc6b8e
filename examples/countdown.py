"""Countdown (TinyZero's task): reach the target with each given number once and + - * /. A task and its reward,
plugged in through the hooks any task uses:

    python grpo.py data.dataset_name=examples.countdown:task env.reward_fn=examples.countdown:reward

`task(n, seed)` returns n rows, `reward(prompt, completion, answer)` scores one completion. The reward parses the
boxed equation with `ast` and a whitelist of operators: model output is never evaluated as code.
"""

import ast
import contextlib
import operator
from fractions import Fraction
from typing import Optional

import numpy as np

from plumbing import extract_boxed

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def task(n: int, seed: int) -> list[dict]:
    """Rows {"question", "answer": {"numbers", "target"}}, each target reachable by construction."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        numbers = [int(x) for x in rng.integers(1, 100, int(rng.integers(3, 5)))]
        target = Fraction(numbers[0])
        for x in numbers[1:]:
            op = rng.choice(["+", "-", "*"] + (["/"] if target % x == 0 else []))
            target = {"+": target + x, "-": target - x, "*": target * x, "/": target / x}[op]
        question = f"Using the numbers {numbers}, create an equation that equals {int(target)}. Use + - * / and each"
        rows.append(
            {"question": question + " number exactly once.", "answer": {"numbers": numbers, "target": int(target)}}
        )
    return rows


def arithmetic(expr: str, used: list) -> Optional[Fraction]:
    """The exact value of numbers, + - * / and parentheses (each number appended to `used`); else None."""

    def value(node) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            used.append(node.value)
            return Fraction(str(node.value))
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("not allowed")

    with contextlib.suppress(SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return value(ast.parse(expr.strip(), mode="eval").body) if len(expr) <= 100 else None
    return None


def reward(prompt: str, completion: str, answer: dict) -> float:
    """1.0 if the last boxed equation uses each given number once, integers only, and equals the target."""
    expr, used = extract_boxed(completion), []
    result = arithmetic(expr.split("=")[0], used) if expr is not None else None
    integers = all(type(x) is int for x in used)
    return float(result == answer["target"] and sorted(used) == sorted(answer["numbers"]) and integers)
