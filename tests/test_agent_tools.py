"""Tool-call parsing, the per-call deadline, the calculator and the Python sandbox's limits."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from miles.agent.calculator import Calculator
from miles.agent.sandbox import PythonSandbox
from miles.agent.tools import ToolCall, parse_tool_calls, run_call, schema, tool_response_message


def _call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# --- parsing --------------------------------------------------------------------------------


def test_parse_well_formed_and_malformed_calls_in_order() -> None:
    text = (
        "Let me compute. "
        + _call("calculator", expression="1+2")
        + "\n"
        + "<tool_call>{not json}</tool_call>"
        + '<tool_call>{"arguments": {}}</tool_call>'
        + '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
        + '<tool_call>{"name": "python", "arguments": [1]}</tool_call>'
        + '<tool_call>{"name": "calculator"'
    )
    calls, errors = parse_tool_calls(text)
    assert calls == [
        ToolCall(name="calculator", arguments={"expression": "1+2"}),
        ToolCall(name="python", arguments={"code": "print(1)"}),
    ]
    assert [e.error for e in errors] == ["malformed"] * 4
    assert "not valid JSON" in errors[0].text and 'string "name"' in errors[1].text
    assert "python must be a JSON object" in errors[2].text and "without </tool_call>" in errors[3].text
    assert parse_tool_calls("no calls here") == ([], [])


def test_tool_response_turn_and_schema() -> None:
    outcomes = [
        asyncio.run(
            run_call(
                {"calculator": Calculator()}, ToolCall(name="calculator", arguments={"expression": "6*7"})
            )
        )
    ]
    assert tool_response_message(outcomes) == {
        "role": "user",
        "content": "<tool_response>\n42\n</tool_response>",
    }
    assert schema(Calculator())["function"]["name"] == "calculator"


class _Sleeper:
    name, description, parameters, timeout_s = "sleep", "sleeps", {"type": "object"}, 0.3

    def __call__(self, arguments):
        time.sleep(arguments["s"])
        return "woke"


def test_deadline_unknown_tool_and_raising_tool_become_observations() -> None:
    tools = {"sleep": _Sleeper(), "calculator": Calculator()}
    t0 = time.perf_counter()
    out = asyncio.run(run_call(tools, ToolCall(name="sleep", arguments={"s": 3})))
    assert out.error == "timeout" and time.perf_counter() - t0 < 1.5
    assert asyncio.run(run_call(tools, ToolCall(name="sleep", arguments={"s": 0}))).text == "woke"
    unknown = asyncio.run(run_call(tools, ToolCall(name="search", arguments={})))
    assert unknown.error == "unknown_tool" and "calculator, sleep" in unknown.text
    bad = asyncio.run(run_call(tools, ToolCall(name="calculator", arguments={"expression": "1/0"})))
    assert bad.error == "raised" and "ZeroDivisionError" in bad.text


# --- calculator -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("123 * 456", "56088"),
        ("(2 + 3) * -4", "-20"),
        ("6 / 3", "2"),
        ("7 / 2", "3.5"),
        ("2 ** 10", "1024"),
        ("17 // 5", "3"),
        ("17 % 5", "2"),
        ("1 / 3", "0.333333333333"),
    ],
)
def test_calculator_values(expression: str, value: str) -> None:
    assert Calculator()({"expression": expression}) == value


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("__import__('os').system('true')", "unsupported element Call"),
        ("x + 1", "unsupported element Name"),
        ("9 ** 9 ** 9", "exceed 4096 bits"),
        ("'a' * 3", "unsupported element Constant"),
        ("1 +", "not an arithmetic"),
        ("True + 1", "unsupported element Constant"),
        ("1" * 300, "longer than 200"),
    ],
)
def test_calculator_refuses(expression: str, why: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=why):
        Calculator()({"expression": expression})
    assert time.perf_counter() - t0 < 0.5


# --- sandbox --------------------------------------------------------------------------------


def test_sandbox_runs_code_in_a_fresh_temporary_directory() -> None:
    box = PythonSandbox(wall_s=20)
    code = "import os\nprint(os.listdir('.'))\nopen('f.txt', 'w').write('x')\nprint(os.getcwd())\nprint(sorted(os.environ))"
    first, second = box({"code": code}).splitlines(), box({"code": code}).splitlines()
    assert (
        first == second == ["[]", "/work", "['HOME', 'LANG', 'PATH', 'PWD']"]
    )  # nothing left, nothing inherited
    assert box({"code": "raise SystemExit(3)"}) == "[exit code 3]"


def test_sandbox_memory_limit() -> None:
    box = PythonSandbox(memory_mb=200, wall_s=20)
    assert "MemoryError" in box({"code": "x = bytearray(400 * 2**20)"})
    assert box({"code": "x = bytearray(50 * 2**20); print(len(x))"}).strip() == str(50 * 2**20)
    out = box({"code": "import resource\nresource.setrlimit(resource.RLIMIT_AS, (2**40, 2**40))"})
    assert "ValueError" in out or "PermissionError" in out  # the hard limit cannot be raised back


def test_sandbox_cpu_and_wall_limits_kill_within_their_deadline() -> None:
    box = PythonSandbox(cpu_s=1, wall_s=3)
    t0 = time.perf_counter()
    assert "[killed: " in box({"code": "while True: pass"})
    assert time.perf_counter() - t0 < 3.5  # the CPU limit (1 s of CPU) fires first or the wall limit does
    t0 = time.perf_counter()
    out = asyncio.run(
        run_call({"python": box}, ToolCall(name="python", arguments={"code": "import time\ntime.sleep(60)"}))
    )
    assert out.error is None and out.text.endswith("[killed: wall time limit of 3 s]")
    assert time.perf_counter() - t0 < 5


def test_sandbox_has_no_network() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
        denied = PythonSandbox(wall_s=20)({"code": code})
        allowed = PythonSandbox(wall_s=20, network="allow")({"code": code})
    assert "connected" not in denied and ("OSError" in denied or "Error" in denied), denied
    assert allowed.strip() == "connected"  # the same code reaches the listener without the namespace
