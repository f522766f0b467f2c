"""Reading raw text with the `datasets` library: plain text, jsonl (also .gz) and parquet, fully offline."""

from __future__ import annotations

import os
from typing import List


def _builder(path: str) -> str:
    name = path[:-3] if path.endswith(".gz") else path
    if name.endswith((".jsonl", ".json")):
        return "json"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".txt"):
        return "text"
    raise ValueError(f"cannot tell the format of {path}: use .txt (one document per line), .jsonl[.gz] or .parquet")


def _check_lines(path: str, json_keys, is_json: bool) -> None:
    """Name the first line that is not UTF-8 text, and in a JSON-lines file the first that is not a JSON object or
    whose text is not a string (datasets' own errors say neither the file nor the line, or come as a traceback
    from inside pyarrow while a tool reads the rows)."""
    import gzip
    import json

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{number} is not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                                 f"{e.start + 1}); convert the file to UTF-8 (iconv -f latin1 -t utf-8, say)") from None
            if not is_json or not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{number} is not valid JSON ({e.msg} at column {e.colno}); fix or remove "
                                 "that line (one JSON object per line)") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number} is not a JSON object; each line must be an object like "
                                 '{"text": "..."}')
            for key in json_keys:
                value = record.get(key, "")
                if not isinstance(value, str):
                    kind = "null" if value is None else type(value).__name__
                    raise ValueError(f"{path}:{number}: {key!r} is {kind} ({json.dumps(value)[:40]}), not a string; "
                                     "fix or remove that line")


def load_text_dataset(paths: List[str], json_keys: List[str] = ("text",)):
    """One `datasets.Dataset` with a single "text" column (several json keys are joined with a blank line). A key
    that a line lacks (or a null in a parquet file) is an empty text there: None in the column."""
    import datasets

    for p in paths:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"input file {p} does not exist")
        if os.path.getsize(p) == 0:
            raise ValueError(f"input file {p} is empty; give a file with at least one document")
        if _builder(p) in ("json", "text"):
            _check_lines(p, json_keys, _builder(p) == "json")
    kinds = {_builder(p) for p in paths}
    if len(kinds) != 1:
        raise ValueError(f"mixing input formats {sorted(kinds)} in one call; preprocess each format separately")
    kind = kinds.pop()
    datasets.disable_progress_bars() if os.environ.get("MEGA_DEPTH_QUIET") else None
    ds = datasets.load_dataset(kind, data_files=list(paths), split="train")
    if len(ds) == 0:
        raise ValueError(f"{', '.join(paths)} holds no documents; give a file with at least one document")
    if kind == "text":
        return ds
    missing = [k for k in json_keys if k not in ds.column_names]
    if missing:
        raise ValueError(f"json keys {missing} not in the data (columns: {ds.column_names}); set --json-keys")
    if list(json_keys) == ["text"]:
        return ds.select_columns(["text"])
    # a key a line lacks is read as empty (datasets fills in None there, which would join as the word "None")
    return ds.map(lambda row: {"text": "\n\n".join(row[k] for k in json_keys if row[k])},
                  remove_columns=ds.column_names)
