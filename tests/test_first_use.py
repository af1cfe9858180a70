"""What a first user meets on a machine without a GPU: one clear error for CPU tensors without the interpreter,
`flashtile.bert_padding` reachable from the package, and the packaging metadata pip and setuptools read."""

import os
import subprocess
import sys

import flashtile

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _python(code: str, **env_changes) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_changes)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(flashtile.__file__)),
                                         env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_cpu_tensors_without_the_interpreter_raise_one_clear_error():
    code = """
import torch, flashtile
q = torch.randn(1, 8, 2, 16, dtype=torch.float16)
calls = {"flash_attn_func": lambda: flashtile.flash_attn_func(q, q, q),
         "kernel_paths": lambda: flashtile.kernel_paths(q, q, q),
         "flash_attn_with_kvcache": lambda: flashtile.flash_attn_with_kvcache(q, q, q),
         "scaled_dot_product_attention": lambda: flashtile.scaled_dot_product_attention(q, q, q)}
for name, f in calls.items():
    try:
        f()
        print(name, "ran")
    except RuntimeError as e:
        assert "TRITON_INTERPRET=1" in str(e), e
        print(name, "refused")
assert flashtile.last_kernel_paths() == {}, flashtile.last_kernel_paths()
"""
    proc = _python(code, CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["flash_attn_func", "refused", "kernel_paths", "refused", "flash_attn_with_kvcache",
                                   "refused", "scaled_dot_product_attention", "refused"]


def test_bert_padding_is_reachable_from_the_package():
    assert flashtile.bert_padding.unpad_input is not None and flashtile.bert_padding.pad_input is not None


def test_pyproject_license_is_an_spdx_string():
    tomllib = __import__("tomllib") if sys.version_info >= (3, 11) else None
    if tomllib is None:
        return
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        meta = tomllib.load(f)
    assert meta["project"]["license"] == "BSD-3-Clause"
    assert any(r.replace(" ", "").startswith("setuptools>=77") for r in meta["build-system"]["requires"])
