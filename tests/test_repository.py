"""What the repository promises a reader beyond the code: short commit subjects (details in the body), and source
comments that cite Notes and docs/ rather than numbered runs of a notebook."""

import os
import re
import subprocess

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
# The last commit before the rule: history up to it keeps its long subjects.
RULE_SINCE = "ac0810d"


def _git(*args):
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True)


def test_commit_subjects_are_at_most_72_characters():
    if _git("rev-parse", "--verify", "--quiet", f"{RULE_SINCE}^{{commit}}").returncode != 0:
        pytest.skip(f"not a git checkout with {RULE_SINCE} in its history (a shallow clone?)")
    subjects = _git("log", "--format=%s", f"{RULE_SINCE}..HEAD").stdout.splitlines()
    long = [s for s in subjects if len(s) > 72]
    assert not long, f"commit subjects over 72 characters (put the details in the body): {long}"


def _source_lines():
    for folder, _, files in os.walk(os.path.join(ROOT, "src", "flashtile")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                for n, line in enumerate(open(path, encoding="utf-8"), 1):
                    yield f"{os.path.relpath(path, ROOT)}:{n}", line


def test_source_comments_cite_notes_not_runs():
    """No session, run, issue number or PERF.md version as a reference: those do not last; Notes and docs do."""
    pattern = re.compile(r"\b[Ss]essions?\b|PERF\.md|\bS\d+-\d+\b|\bv\d+\b|\b[Ii]ssue \d+")
    found = [f"{where}: {line.strip()}" for where, line in _source_lines() if pattern.search(line)]
    assert not found, "cite the Note or the docs/ page instead:\n" + "\n".join(found)


def test_tools_cited_in_the_source_exist():
    found = [f"{where}: tools/{name}" for where, line in _source_lines()
             for name in re.findall(r"\btools/([\w.]+\.(?:py|sh))", line)
             if not os.path.exists(os.path.join(ROOT, "tools", name))]
    assert not found, "the source cites tools that are gone:\n" + "\n".join(found)
