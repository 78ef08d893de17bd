"""An agent written against the official openai client: it answers with the help of a calculator tool.

It imports nothing of miles (only the standard library here, and ``openai`` when run as a script), so it is
an agent as anyone would write it. Used as a rollout by examples/openai_agent.yaml
(``miles.agent.openai_rollout.openai_agent``): miles gives ``solve`` a client whose ``base_url`` is the
run's rollout server; every reply it gets was sampled by the policy, and the whole conversation becomes
one training sample. On its own, against any OpenAI-compatible server::

    python examples/openai_agent.py --base-url http://127.0.0.1:8000/v1 --api-key TOKEN "What is 12*34?"
"""

from __future__ import annotations

import ast
import json
import operator

BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (numbers, + - * / // % ** and parentheses), walked on its AST;
    integral results print as integers. Large powers are refused rather than computed."""
    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
            return UNARY[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
            a, b = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(b) * max(abs(a), 2).bit_length() > 4096:
                raise ValueError("the result would be too large")
            return BINARY[type(node.op)](a, b)
        raise ValueError(f"unsupported element {type(node).__name__} (only numbers and + - * / // % **)")

    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    result = value(ast.parse(expression.strip(), mode="eval").body)
    if isinstance(result, float) and result.is_integer() and abs(result) < 1e15:
        return str(int(result))
    return str(result) if isinstance(result, int) else format(result, ".12g")


def solve(client, prompt: str, max_turns: int = 3) -> str:
    """Ask the model; run each calculator call it makes and send the results back, up to ``max_turns``
    replies. Returns the last reply's text."""
    messages = [{"role": "user", "content": prompt}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            try:
                result = calculate(json.loads(call.function.arguments)["expression"])
            except Exception as e:  # the model sees the error and may try again
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return messages[-1].get("content") or ""


if __name__ == "__main__":
    import argparse

    import openai

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--api-key", required=True)
    p.add_argument("prompt")
    args = p.parse_args()
    print(solve(openai.OpenAI(base_url=args.base_url, api_key=args.api_key), args.prompt))
