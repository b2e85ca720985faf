"""Fails when the tree speaks of how the project was made rather than of the product
(CONTRIBUTING.md, "Writing"): "session", "issue N", "lent", a conversation's "turn" (this /
next / previous turn, turn N), in any tracked text file or file name.

    python tools/check_words.py            # the tracked files (git ls-files); exit 1 on a hit
    python tools/check_words.py PATH ...   # these files only

A dataset's "first turn" (MT-bench, ShareGPT) and the verb ("turns on") are not diary words.
A line that names the words on purpose (this checker's documentation and tests) carries the
marker ALLOW.
"""

import re
import subprocess
import sys

# (letters only around a word: "session23" and "e2e_session8" count too)
PATTERNS = [
    re.compile(r"(?<!new_)(?<![a-z])sessions?(?![a-z])", re.IGNORECASE),  # not start_new_session
    re.compile(r"(?<![a-z])issues?[ _#-]*\d+", re.IGNORECASE),
    re.compile(r"(?<![a-z])lent(?![a-z])", re.IGNORECASE),
    re.compile(r"\b(?:this|next|previous|last|earlier|later|each|every) turn\b", re.IGNORECASE),
    re.compile(r"\bturn[ _#-]*\d+", re.IGNORECASE),
]
# files that are not the project's words: third-party data, binary weights, this checker
SKIP_SUFFIXES = (".safetensors", ".png", ".gguf", ".so")
SKIP = {"tools/check_words.py"}
ALLOW = "check_words: allow"


def tracked_files() -> list:
    out = subprocess.run(["git", "ls-files"], capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines() if f]


def hits(path: str) -> list:
    """[(line number, line)] of path's diary words (line 0: the file name itself)."""
    found = [(0, path)] if any(p.search(path) for p in PATTERNS) else []
    if path in SKIP or path.endswith(SKIP_SUFFIXES):
        return found
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if ALLOW not in line and any(p.search(line) for p in PATTERNS):
                    found.append((n, line.rstrip()))
    except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
        pass
    return found


def main(argv: list) -> int:
    files = argv or tracked_files()
    bad = [(f, n, line) for f in files for n, line in hits(f)]
    for f, n, line in bad:
        print(f"{f}:{n}: {line}" if n else f"{f}: file name", file=sys.stderr)
    if bad:
        print(
            f"check_words: {len(bad)} line(s) speak of how the project was made, not of the "
            "product (CONTRIBUTING.md, Writing)",
            file=sys.stderr,
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
