"""Every ```python example``` block of README.md runs as written, each in a fresh interpreter (with
TRITON_INTERPRET=1 where there is no GPU, as the README tells a CPU user to start Python). A block that needs an
optional package (transformers) is skipped when it is not installed."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

import flashtile

README = os.path.join(os.path.dirname(__file__), "..", "README.md")
OPTIONAL = ("transformers",)


def _examples() -> list[tuple[str, str]]:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    blocks = []
    for match in re.finditer(r"^```python example\n(.*?)^```", text, flags=re.S | re.M):
        heading = re.findall(r"^### (.+)$", text[:match.start()], flags=re.M)
        blocks.append((heading[-1] if heading else "top", match.group(1)))
    return blocks


EXAMPLES = _examples()


def test_the_readme_has_examples():
    assert len(EXAMPLES) >= 6


@pytest.mark.parametrize("heading, code", EXAMPLES, ids=[h for h, _ in EXAMPLES])
def test_example_runs(heading, code):
    for package in OPTIONAL:
        if re.search(rf"^\s*(from|import) {package}\b", code, flags=re.M) and not importlib.util.find_spec(package):
            pytest.skip(f"{package} is not installed")
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(flashtile.__file__)),
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"README example under '{heading}' failed:\n{proc.stderr[-4000:]}"
