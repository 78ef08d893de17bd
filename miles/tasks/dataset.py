"""Prompt datasets from files: JSON Lines, JSON or Parquet, loaded with Hugging Face ``datasets``.

Each row gives a prompt (``prompt_key``, a string), the reference its reward compares against
(``label_key``, any JSON value but null) and, optionally, a correct response for the warm start
(``response_key``; when unset a string label is the response, as for the built-in tasks).

Held-out split: a second file (``heldout_path``; training rows with a held-out prompt are dropped),
or a hashed fraction of prompts (``heldout_fraction``, the same sha256 split as the procedural
tasks), so a training prompt is never an evaluation prompt.

Chat template: prompts are user-turn contents; :func:`miles.models.tokenizer.encode_prompt` applies
the chat template when the rollout encodes them (the one place that does). A dataset whose prompts
are already fully formatted sets ``chat_template: false``; the task exposes it as
``task.chat_template`` and on every problem (``problem.chat_template``) for the encoder to honour.

Every malformed row fails loading with the file, the row (the 1-based line for JSON Lines) and the
field: a line that is not JSON, a row that is not an object, a missing or null field, a wrong type.

Images (``image_key``, for a vision-language model): the field holds one image or a list of them, each
a file path (relative paths are read from the data file's directory), raw bytes (a Parquet binary
column, or a ``{"bytes": ...}`` struct as Hugging Face image columns store them) or a
``data:image/...;base64,`` string. Every image is opened when the file loads: a missing or unreadable
one fails with the file, the row and the field. Two rows with the same prompt and other pictures are
different problems (the held-out split and de-duplication key on the prompt and the images' bytes).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from miles.tasks.procedural import in_heldout

log = logging.getLogger(__name__)

__all__ = ["DatasetProblem", "DatasetTask", "load_rows"]

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".pq": "parquet"}


@dataclass(frozen=True)
class DatasetProblem:
    """One row: the prompt, its label, the warm-start response (or None) and whether to chat-template it."""

    prompt: str
    label: Any
    response: str | None = None
    chat_template: bool = True
    images: tuple[bytes, ...] = ()

    @property
    def key(self) -> str:
        """What makes the problem distinct: the prompt, and the images' bytes when it has images."""
        if not self.images:
            return self.prompt
        return self.prompt + "\x00" + hashlib.sha256(b"".join(self.images)).hexdigest()


class DatasetTask:
    """Prompts and labels from ``path``; evaluation on ``heldout_path`` or a hashed ``heldout_fraction``."""

    def __init__(
        self,
        *,
        path: str,
        prompt_key: str = "prompt",
        label_key: str = "label",
        response_key: str | None = None,
        heldout_path: str | None = None,
        heldout_fraction: float = 0.1,
        eval_seed: int = 12345,
        format: Literal["auto", "json", "parquet"] = "auto",
        chat_template: bool = True,
        image_key: str | None = None,
    ) -> None:
        self.chat_template = chat_template
        keys = dict(prompt_key=prompt_key, label_key=label_key, response_key=response_key,
                    file_format=format, chat_template=chat_template, image_key=image_key)
        rows = load_rows(path, **keys)
        if heldout_path is not None:
            heldout = load_rows(heldout_path, **keys)
            held = {p.key for p in heldout}
            train = [p for p in rows if p.key not in held]
            if len(train) < len(rows):
                log.info("task: dropped %d training rows whose prompt is in %s", len(rows) - len(train), heldout_path)
        else:
            if not 0.0 < heldout_fraction < 1.0:
                raise ValueError(f"heldout_fraction: must be in (0, 1), found {heldout_fraction}")
            heldout = [p for p in rows if in_heldout(p.key, eval_seed, heldout_fraction)]
            train = [p for p in rows if not in_heldout(p.key, eval_seed, heldout_fraction)]
        if not train:
            raise ValueError(f"path: no training rows left in {path} after the held-out split "
                             f"({len(rows)} rows, {len(heldout)} held out); add rows or lower heldout_fraction")
        self.train_problems, self.heldout_problems = train, _distinct(heldout)

    def sample(self, n: int, rng: random.Random) -> list[DatasetProblem]:
        """``n`` training rows drawn uniformly with repeats, never from the evaluation split."""
        return [self.train_problems[rng.randrange(len(self.train_problems))] for _ in range(n)]

    def eval_problems(self, n: int) -> list[DatasetProblem]:
        """The first ``n`` distinct held-out prompts, in file order."""
        if n > len(self.heldout_problems):
            raise ValueError(f"eval_problems: the held-out split has {len(self.heldout_problems)} distinct prompts, "
                             f"asked for {n}; lower task.num_eval_prompts or add held-out rows")
        return self.heldout_problems[:n]

    def reference_response(self, problem: DatasetProblem) -> str:
        if problem.response is not None:
            return problem.response
        if isinstance(problem.label, str):
            return problem.label
        raise ValueError("the warm start needs a response text per row: set task.source.response_key to a "
                         f"column of correct responses (labels are {type(problem.label).__name__}), "
                         "or disable it with warm_start.steps=0")

    def corpus(self) -> list[str]:
        """Tokenizer text: prompts and responses of up to 2000 training rows."""
        problems = self.sample(min(2000, 4 * len(self.train_problems)), random.Random(0))
        responses = [p.response if p.response is not None else str(p.label) for p in problems]
        return [p.prompt for p in problems] + responses + ["0123456789"]

    def sft_examples(self, n: int, rng: random.Random) -> list[tuple]:
        """``n`` (prompt, response) pairs from the training split; (prompt, response, images) with images."""
        return [(p.prompt, self.reference_response(p), p.images) if p.images else (p.prompt, self.reference_response(p))
                for p in self.sample(n, rng)]


def _distinct(problems: list[DatasetProblem]) -> list[DatasetProblem]:
    seen: set[str] = set()
    out = []
    for p in problems:
        if p.key not in seen:
            seen.add(p.key)
            out.append(p)
    return out


_UNSET_HINT = {
    "response": "; without responses, task.source.response_key=null takes a string label as the response",
    "image": "; for a text-only file, task.source.image_key=null",
}
"""How to do without an optional field, added to the error when a file lacks it."""


def load_rows(
    path: str,
    *,
    prompt_key: str = "prompt",
    label_key: str = "label",
    response_key: str | None = None,
    file_format: Literal["auto", "json", "parquet"] = "auto",
    chat_template: bool = True,
    image_key: str | None = None,
) -> list[DatasetProblem]:
    """Every row of ``path`` as a :class:`DatasetProblem`; a malformed row raises ``ValueError`` naming
    the file, the row (line for JSON Lines) and the field."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"path: no such file {str(file)!r}")
    kind = _FORMATS.get(file.suffix.lower()) if file_format == "auto" else file_format
    if kind not in ("json", "parquet"):
        raise ValueError(f"format: cannot tell the format of {str(file)!r} from its suffix; use .jsonl, .json or "
                         "a .parquet file, or set task.source.format to json or parquet")
    import datasets

    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(kind, data_files=str(file), split="train")
    except Exception as e:  # datasets/pyarrow say "row 1" at best: find the line and the field ourselves
        if kind == "json":
            _scan_json_lines(file, prompt_key, label_key, response_key)
        raise ValueError(f"{file}: could not be loaded as {kind}: {e} ({e.__cause__ or ''})") from e
    fields = ({"prompt": prompt_key, "label": label_key} | ({"response": response_key} if response_key else {})
              | ({"image": image_key} if image_key else {}))
    columns = {}
    for role, key in fields.items():
        if key not in ds.column_names:
            where = _where(file, kind, 0)
            raise ValueError(f"{where}: missing field {key!r} ({role}_key); the file's fields are "
                             f"{', '.join(map(repr, ds.column_names))}{_UNSET_HINT.get(role, '')}")
        columns[role] = ds[key]
    problems = []
    for i in range(len(ds)):
        row = {role: col[i] for role, col in columns.items()}
        for role in ("prompt", "response"):
            if role in row and not isinstance(row[role], str):
                raise ValueError(_bad(file, kind, i, fields[role], "a string", row[role]))
        if row["label"] is None:
            raise ValueError(_bad(file, kind, i, label_key, "a value", None))
        images = _images(file, kind, i, image_key, row["image"]) if image_key else ()
        problems.append(DatasetProblem(prompt=row["prompt"], label=row["label"], response=row.get("response"),
                                       chat_template=chat_template, images=images))
    if not problems:
        raise ValueError(f"{file}: no rows")
    return problems


def _images(file: Path, kind: str, index: int, key: str, value: Any) -> tuple[bytes, ...]:
    """A row's images as bytes, each opened once to check it; errors name the file, the row and the field."""
    if value is None:
        raise ValueError(_bad(file, kind, index, key, "an image or a list of images", None))
    out = []
    items = value if isinstance(value, list) else [value]
    for j, item in enumerate(items):
        where = f"{_where(file, kind, index)}: field {key!r}" + (f"[{j}]" if isinstance(value, list) else "")
        if isinstance(item, dict):  # a Hugging Face image struct
            item = item.get("bytes") or item.get("path")
        if isinstance(item, str) and item.startswith("data:image/") and ";base64," in item:
            try:
                item = base64.b64decode(item.split(";base64,", 1)[1], validate=True)
            except ValueError:
                raise ValueError(f"{where}: a data URI whose base64 does not decode") from None
        elif isinstance(item, str):
            p = Path(item).expanduser()
            p = p if p.is_absolute() else file.parent / p
            if not p.is_file():
                raise ValueError(f"{where}: image file {str(p)!r} does not exist")
            item = p.read_bytes()
        if not isinstance(item, bytes | bytearray):
            raise ValueError(f"{where}: expected an image path or bytes, found {type(item).__name__}")
        _open_image(bytes(item), where)
        out.append(bytes(item))
    return tuple(out)


def _open_image(data: bytes, where: str) -> None:
    """Decode ``data`` once with Pillow; ``ValueError`` naming ``where`` if it is not a readable image."""
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"{where}: unreadable image ({e})") from None


def _bad(file: Path, kind: str, index: int, key: str, expected: str, found: Any) -> str:
    what = "missing or null" if found is None else f"expected {expected}, found {type(found).__name__} {found!r:.80}"
    return f"{_where(file, kind, index)}: field {key!r}: {what}"


def _where(file: Path, kind: str, index: int) -> str:
    """``file:line N`` for JSON Lines (blank lines are skipped by the loader), ``file: row N`` otherwise."""
    if kind == "json" and file.suffix.lower() == ".jsonl":
        with file.open("rb") as f:
            seen = -1
            for line_no, line in enumerate(f, start=1):
                if line.strip():
                    seen += 1
                    if seen == index:
                        return f"{file}:line {line_no}"
    return f"{file}: row {index + 1}"


def _scan_json_lines(file: Path, prompt_key: str, label_key: str, response_key: str | None) -> None:
    """Raise ``ValueError`` at the first line of a JSON Lines file that is not a valid row; return if none."""
    if file.suffix.lower() != ".jsonl":
        return
    with file.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{file}:line {line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object with fields {prompt_key!r} and {label_key!r}, "
                                 f"found {type(row).__name__}")
            for key, expected in ((prompt_key, str), (label_key, None), (response_key, str)):
                if key is None:
                    continue
                if row.get(key) is None:
                    raise ValueError(f"{where}: field {key!r}: missing or null")
                if expected is not None and not isinstance(row[key], expected):
                    raise ValueError(f"{where}: field {key!r}: expected a string, found {type(row[key]).__name__}")
