"""Structured-output coverage on real schemas: `python -m minisgl.benchmark.coverage DIR`.

DIR holds one folder per subset of JSON schemas (e.g. samples of JSONSchemaBench's Glaiveai2K,
Github_easy, ..., one schema per `.json` file; a file that wraps its schema in `{"schema": ...}`
or `{"json_schema": ...}` is unwrapped). Per subset: the share of schemas accepted (checked and
compiled against the model's vocabulary as the server does for `response_format` `json_schema`),
the refusals counted by reason, and for accepted schemas the answers of the model (chat,
temperature 0, `--max-tokens`) with the share of those ending with `stop` that `jsonschema`
finds valid (the target: all of them). Prints tables, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import jsonschema

from minisgl.benchmark.common import Row, emit_json, print_table
from minisgl.constrain import GrammarError
from minisgl.core import Constraint
from minisgl.llm import LLM

PROMPT = "Write one JSON object that follows this JSON schema, and nothing else.\n{}"


def load(path: Path) -> Any:
    value = json.loads(path.read_text())
    for key in ("json_schema", "schema"):
        if isinstance(value, dict) and isinstance(value.get(key), dict):
            return value[key]
    return value


def reason(message: str) -> str:
    """A refusal's reason without where it happened or the schema's own names and values."""
    message = re.sub(r"^json_schema: ", "", message)
    message = re.sub(r"^at /\S*: ", "", message)
    message = re.sub(r"`[^`]*`(, `[^`]*`)*(?=,? (which|are not|do not))", "`...`", message)
    message = re.sub(r"choices \d+ and \d+", "choices", message)
    return re.split(r"; |: use | \(", message)[0][:90]


def subset(llm: LLM, folder: Path, max_tokens: int, generate: int) -> tuple[Row, Counter[str]]:
    refusals: Counter[str] = Counter()
    accepted: list[tuple[str, Any]] = []
    files = sorted(folder.glob("*.json"))
    for path in files:
        schema = load(path)
        text = json.dumps(schema)
        try:
            llm.scheduler.grammars.compiler.compile(Constraint("json_schema", text))
        except GrammarError as e:
            refusals[reason(str(e))] += 1
            continue
        accepted.append((text, schema))
    row: Row = {"subset": folder.name, "schemas": len(files), "accepted": len(accepted)}
    row["accepted_share"] = round(len(accepted) / max(len(files), 1), 3)
    asked = accepted[:generate]
    convs = [[{"role": "user", "content": PROMPT.format(text)}] for text, _ in asked]
    params = [{"temperature": 0.0, "max_tokens": max_tokens, "json_schema": t} for t, _ in asked]
    outs = llm.chat(convs, params, use_tqdm=False) if asked else []
    stops = [(o["text"], s) for o, (_, s) in zip(outs, asked) if o["finish_reason"] == "stop"]
    row["generated"], row["stop"] = len(outs), len(stops)
    row["valid"] = sum(_valid(text, schema) for text, schema in stops)
    row["valid_share"] = round(row["valid"] / len(stops), 3) if stops else None
    return row, refusals


def _valid(text: str, schema: Any) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", type=Path, help="a folder of subset folders of .json schemas")
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--generate", type=int, default=8, help="accepted schemas answered per subset")
    args = p.parse_args()
    llm = LLM(args.model)
    rows, reasons = [], []
    for folder in sorted(d for d in args.data.iterdir() if d.is_dir()):
        row, refusals = subset(llm, folder, args.max_tokens, args.generate)
        rows.append(row)
        reasons += [{"subset": folder.name, "count": n, "reason": r} for r, n in refusals.items()]
    columns = ["subset", "schemas", "accepted", "accepted_share", "generated", "stop", "valid"]
    print_table("Coverage per subset", rows, columns)
    print_table(
        "Refusals", sorted(reasons, key=lambda r: -r["count"]), ["subset", "count", "reason"]
    )
    emit_json({"subsets": rows, "refusals": reasons, "max_tokens": args.max_tokens})


if __name__ == "__main__":
    main()
