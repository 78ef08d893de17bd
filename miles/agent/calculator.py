"""A calculator tool: arithmetic on numbers, evaluated by walking Python's AST (no ``eval``).

Accepted: integer and float literals, ``+ - * / // % **``, unary ``+``/``-`` and parentheses.
Anything else (names, calls, attributes, strings, comparisons) is refused with an error naming the
construct. Work is bounded before it is done: the expression is at most ``max_chars`` long, and an
integer power or product whose result would exceed ``max_bits`` bits is refused, so ``9**9**9`` is
an error, not a hang. Integral results print as integers (``6/3`` gives ``2``); other floats print
with 12 significant digits.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class Calculator:
    """Tool ``calculator(expression)``: the value of an arithmetic expression."""

    name = "calculator"
    description = "Evaluate an arithmetic expression with + - * / // % ** and parentheses."
    parameters = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}

    def __init__(self, *, timeout_s: float = 1.0, max_chars: int = 200, max_bits: int = 4096) -> None:
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self.max_bits = max_bits

    def __call__(self, arguments: dict[str, Any]) -> str:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            raise ValueError(f'"expression" must be a string, found {type(expression).__name__}')
        return format_number(self.evaluate(expression))

    def evaluate(self, expression: str) -> int | float:
        """The value of ``expression``; raises ``ValueError`` (or ``ZeroDivisionError``) saying why not."""
        if len(expression) > self.max_chars:
            raise ValueError(f"expression longer than {self.max_chars} characters")
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except SyntaxError as e:
            raise ValueError(f"not an arithmetic expression: {e.msg}") from None
        return self._eval(tree.body)

    def _eval(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            a, b = self._eval(node.left), self._eval(node.right)
            self._check_size(node.op, a, b)
            value = _BINARY[type(node.op)](a, b)
            if isinstance(value, complex) or (isinstance(value, float) and not math.isfinite(value)):
                raise ValueError("the result is not a finite real number")
            return value
        raise ValueError(f"unsupported element {type(node).__name__} (only numbers and + - * / // % **)")

    def _check_size(self, op: ast.operator, a: int | float, b: int | float) -> None:
        """Refuse integer results over ``max_bits`` bits before computing them."""
        if not (isinstance(a, int) and isinstance(b, int)):
            if isinstance(op, ast.Pow) and abs(b) > 10_000:
                raise ValueError("exponent too large")
            return
        if isinstance(op, ast.Pow):
            bits = a.bit_length() * b if b > 0 else 0
        elif isinstance(op, ast.Mult):
            bits = a.bit_length() + b.bit_length()
        else:
            bits = max(a.bit_length(), b.bit_length()) + 1
        if bits > self.max_bits:
            raise ValueError(f"the result would exceed {self.max_bits} bits")


def format_number(value: int | float) -> str:
    """``56088`` for integers and integral floats, else 12 significant digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else format(value, ".12g")
