"""Prompt datasets from JSONL / Parquet files: loading, splits, row errors, and the shipped example."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from miles.tasks.dataset import DatasetTask, load_rows

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "data"


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_example_dataset_task_runs_end_to_end_on_cpu() -> None:
    """The shipped example: split files, warm-start pairs, tokenizer corpus, and math-verify scoring."""
    from miles.models.tokenizer import encode_prompt, train_tokenizer
    from miles.rewards.math import math_verify_reward

    task = DatasetTask(path=str(EXAMPLE / "fractions.jsonl"), heldout_path=str(EXAMPLE / "fractions_heldout.jsonl"),
                       response_key="response")
    evals = task.eval_problems(64)
    assert len({p.prompt for p in evals}) == 64
    train = task.sample(500, random.Random(0))
    assert not {p.prompt for p in evals} & {p.prompt for p in train}
    for p in train[:12] + evals[:8]:
        assert math_verify_reward(task.reference_response(p), p.label) == 1.0  # "7/6" vs "\frac{7}{6}"
        assert math_verify_reward("1/1000", p.label) == 0.0
    tok = train_tokenizer(task.corpus(), 320)
    assert max(len(encode_prompt(tok, p)) + len(tok.encode(r)) for p, r in task.sft_examples(200, random.Random(1))) < 64


def test_example_data_is_what_the_script_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_example_data", EXAMPLE.parent / "make_example_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "OUT", tmp_path)
    module.main()
    for name in ("fractions.jsonl", "fractions_heldout.jsonl"):
        assert (tmp_path / name).read_text() == (EXAMPLE / name).read_text()


def test_hashed_heldout_fraction_and_custom_keys(tmp_path: Path) -> None:
    rows = [{"question": f"q{i}", "answer": i % 7, "extra": [i]} for i in range(400)] + [{"question": "q1", "answer": 1}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    task = DatasetTask(path=str(path), prompt_key="question", label_key="answer", heldout_fraction=0.25)
    held = {p.prompt for p in task.heldout_problems}
    assert 60 < len(held) < 140 and len(task.heldout_problems) == len(held)  # distinct prompts
    assert not held & {p.prompt for p in task.train_problems}
    assert DatasetTask(path=str(path), prompt_key="question", label_key="answer",
                       heldout_fraction=0.25).eval_problems(20) == task.eval_problems(20)
    assert all(isinstance(p.label, int) for p in task.train_problems)
    with pytest.raises(ValueError, match="response_key"):  # integer labels are not response texts
        task.sft_examples(1, random.Random(0))
    with pytest.raises(ValueError, match="num_eval_prompts"):
        task.eval_problems(1000)


def test_parquet_loads_like_jsonl(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": f"What is {i} + 1?", "label": str(i + 1)} for i in range(50)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    write_jsonl(tmp_path / "d.jsonl", rows)
    assert load_rows(str(tmp_path / "d.parquet")) == load_rows(str(tmp_path / "d.jsonl"))
    task = DatasetTask(path=str(tmp_path / "d.parquet"), heldout_fraction=0.2, chat_template=False)
    assert task.chat_template is False and all(p.chat_template is False for p in task.sample(5, random.Random(0)))
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "label": "1"}, {"prompt": None, "label": "2"}]),
                   tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad\.parquet: row 2: field 'prompt': missing or null"):
        load_rows(str(tmp_path / "bad.parquet"))


GOOD = {"prompt": "What is 1 + 1?", "label": "2"}


@pytest.mark.parametrize(
    ("bad_row", "message"),
    [
        ('{"prompt": "b", label}', r"line 4: not valid JSON"),
        ("[1, 2]", r"line 4: expected a JSON object with fields 'prompt' and 'label', found list"),
        ('"just text"', r"line 4: expected a JSON object .* found str"),
        ({"prompt": "b"}, r"line 4: field 'label': missing or null"),
        ({"prompt": "b", "label": None}, r"line 4: field 'label': missing or null"),
        ({"prompt": 5, "label": "2"}, r"line 4: field 'prompt': expected a string, found int"),
        ({"prompt": ["a"], "label": "2"}, r"line 4: field 'prompt': expected a string, found list"),
    ],
)
def test_malformed_row_names_file_line_and_field(tmp_path: Path, bad_row: object, message: str) -> None:
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD, GOOD, "", bad_row, GOOD])  # line 3 is blank
    with pytest.raises(ValueError, match=rf"data\.jsonl:{message}"):
        load_rows(str(path))


def test_missing_column_and_bad_paths(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "a", "label": "1"}])
    with pytest.raises(ValueError, match=r"d\.jsonl:line 1: missing field 'prompt' \(prompt_key\); the file's fields are 'q', 'label'"):
        load_rows(str(path))
    with pytest.raises(ValueError, match=r"missing field 'response' \(response_key\).*response_key=null takes a string"):
        load_rows(str(path), prompt_key="q", response_key="response")
    with pytest.raises(ValueError, match=r"missing field 'img' \(image_key\).*image_key=null"):
        load_rows(str(path), prompt_key="q", image_key="img")
    with pytest.raises(ValueError, match="no such file"):
        load_rows(str(tmp_path / "nope.jsonl"))
    (tmp_path / "d.csv").write_text("prompt,label\n")
    with pytest.raises(ValueError, match="format"):
        load_rows(str(tmp_path / "d.csv"))


@pytest.mark.parametrize("path,line", [
    ("/nonexistent/data.jsonl", "data error: task.source: path: no such file '/nonexistent/data.jsonl'"),
    ("BAD", "data error: task.source: BAD:line 2: field 'label': missing or null"),
])
def test_bad_user_data_is_one_clear_line_not_a_traceback(tmp_path: Path, path: str, line: str) -> None:
    import subprocess
    import sys

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1", "label": "2", "response": "2"}\n{"prompt": "2+2", "response": "4"}\n')
    path, line = path.replace("BAD", str(bad)), line.replace("BAD", str(bad))
    out = subprocess.run([sys.executable, "-m", "miles", "task=jsonl", f"task.source.path={path}", "tracking=none"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 2
    assert line in out.stderr + out.stdout
    assert "Traceback" not in out.stderr + out.stdout
