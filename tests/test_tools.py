"""The maintained scripts of tools/ (the README lists them): each parses its arguments and imports what it needs
on a machine without a GPU (`--help`), and each shell script is valid bash. They run for real only on the GPU
machine; what they measure is in docs/perf.md."""

import os
import subprocess
import sys

import pytest

TOOLS = os.path.join(os.path.dirname(__file__), "..", "tools")
SRC = os.path.join(os.path.dirname(__file__), "..", "src")


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(TOOLS) if f.endswith(".py")))
def test_python_tool_parses_its_arguments(name):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.join(TOOLS, name), "--help"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage" in proc.stdout


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(TOOLS) if f.endswith(".sh")))
def test_shell_tool_is_valid_bash(name):
    subprocess.run(["bash", "-n", os.path.join(TOOLS, name)], check=True)


def test_readme_lists_every_tool():
    readme = open(os.path.join(TOOLS, "..", "README.md")).read()
    for name in os.listdir(TOOLS):
        if name.endswith((".py", ".sh")):
            assert name in readme, f"README.md does not list tools/{name}"
