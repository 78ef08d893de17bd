"""An agent written against the official openai client: it answers with the calculator's help.

Used as a rollout by examples/openai_agent.yaml (``miles.agent.openai_rollout.openai_agent``):
miles gives ``solve`` a client whose ``base_url`` is the run's rollout server; every reply it
gets was sampled by the policy, and the whole conversation becomes one training sample.
"""

from __future__ import annotations

import json

from miles.agent.calculator import Calculator

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": Calculator.description,
                                           "parameters": Calculator.parameters}}]
CALCULATOR = Calculator()


def solve(client, prompt: str, max_turns: int = 3) -> None:
    """Ask the model; run each calculator call it makes and send the results back, up to ``max_turns`` replies."""
    messages = [{"role": "user", "content": prompt}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return
        for call in reply.tool_calls:
            try:
                result = CALCULATOR(json.loads(call.function.arguments))
            except Exception as e:  # the model sees the error and may try again
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
