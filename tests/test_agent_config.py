"""The agent example configs compose, validate and build; tool targets go through the allowlist."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from miles.agent.calculator import Calculator
from miles.agent.rollout import tool_loop
from miles.config import ConfigError, validate

EXAMPLES = Path(__file__).parents[1] / "examples"


def _compose(name: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(EXAMPLES), version_base="1.3"):
        return validate(compose(config_name=name, overrides=overrides))


def test_agent_calculator_builds_its_tools() -> None:
    from miles.core.run import build_components

    parts = build_components(_compose("agent_calculator", []))
    fn = parts["generate_fn"]
    assert isinstance(fn, functools.partial) and fn.func is tool_loop
    (tool,) = fn.keywords["tools"]
    assert isinstance(tool, Calculator) and tool.timeout_s == 1.0
    assert type(parts["task"]).__name__ == "CalculatorArithmeticTask"


def test_a_tool_outside_the_allowlist_is_refused_before_import() -> None:
    from miles.core.run import build_components

    run = _compose("agent_calculator", ["rollout.generate_fn.tools.0._target_=os.system"])
    with pytest.raises(ConfigError, match=r"tools\[0\]: 'os.system' is not allowed"):
        build_components(run)


def test_openai_agent_config_builds() -> None:
    pytest.importorskip("openai")
    from miles.agent.openai_rollout import openai_agent
    from miles.core.run import build_components

    fn = build_components(_compose("openai_agent", []))["generate_fn"]
    assert fn.func is openai_agent and fn.keywords["agent"].func.__name__ == "solve"


def test_the_openai_agent_example_imports_nothing_of_miles() -> None:
    """examples/openai_agent.py is an agent as anyone would write it: the standard library and openai."""
    import ast
    import sys
    from pathlib import Path

    tree = ast.parse((Path(__file__).resolve().parents[1] / "examples" / "openai_agent.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert imported - {"__future__", "openai"} <= set(sys.stdlib_module_names), imported
    assert "openai" in imported and "miles" not in imported
