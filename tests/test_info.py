"""``python -m bert_fast.info``: its report, and --require-extension, which install.sh and CI use
to fail when the install did not build the extension."""

import subprocess
import sys

import pytest

from bert_fast import extension, info


def test_report_names_every_backend():
    text = "\n".join(info.report())
    for name in ("torch ", "triton ", "cuda ", "auto "):
        assert f"  {name}" in text


@pytest.mark.parametrize("value, expected", [
    ("torch", "BERT_FAST_BACKEND=torch: modules built without backend= run torch"),
    ("tpu", "BERT_FAST_BACKEND=tpu: every module built without backend= fails: unknown backend 'tpu' "
            "(from the BERT_FAST_BACKEND environment variable)")])
def test_report_says_what_bert_fast_backend_selects(monkeypatch, value, expected):
    monkeypatch.setenv("BERT_FAST_BACKEND", value)
    assert info.report()[-1].startswith(expected)
    monkeypatch.delenv("BERT_FAST_BACKEND")
    assert "BERT_FAST_BACKEND" not in "\n".join(info.report())


@pytest.mark.parametrize("choice, problem, expected", [
    ("cuda", None, "cuda (triton inside CUDA-graph captures) on CUDA inputs"),
    ("triton", "no kernel image is available", "triton (not cuda: no kernel image is available) on CUDA inputs"),
])
def test_report_says_what_auto_runs_on_this_gpu(monkeypatch, choice, problem, expected):
    """With a GPU: auto's choice there, why not cuda, and that graph captures run triton."""
    import torch
    from bert_fast import backend
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(info, "_device", lambda: "cuda: a stand-in GPU")
    monkeypatch.setattr(backend, "backend_for", lambda name, device: choice)
    monkeypatch.setattr(extension, "kernel_image_problem", lambda index=None: problem)
    auto = [line for line in info.report() if line.startswith("  auto")]
    assert auto == [f"  auto    (default) torch on CPU inputs, {expected}"]


@pytest.mark.parametrize("state, problem", [
    ({"loaded_from": None, "error": "bert_fast._C could not be imported (No module named 'bert_fast._C')"},
     "not available: bert_fast._C could not be imported"),
    ({"loaded_from": "JIT build (bert_fast_ext)", "error": None}, "loaded from JIT build"),
])
def test_require_extension_fails_without_the_installed_build(monkeypatch, capsys, state, problem):
    monkeypatch.setattr(extension, "load", lambda: state["loaded_from"] is not None)
    for key, value in state.items():
        monkeypatch.setitem(extension._state, key, value)
    assert info.main(["--require-extension"]) == 1
    assert problem in capsys.readouterr().err
    assert info.main([]) == 0      # without the flag: a report, whatever is missing


def test_require_extension_passes_with_the_installed_build(monkeypatch):
    monkeypatch.setattr(extension, "load", lambda: True)
    monkeypatch.setitem(extension._state, "loaded_from", "bert_fast._C (built by setup.py)")
    assert info.installed_extension_problem() is None


def test_module_entry_point_exit_status():
    # The exit status is what install.sh's `set -e` sees.
    result = subprocess.run([sys.executable, "-m", "bert_fast.info", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "--require-extension" in result.stdout
    result = subprocess.run([sys.executable, "-m", "bert_fast.info", "--no-such-flag"], capture_output=True, text=True)
    assert result.returncode == 2


def test_no_jit_forbids_compiling_when_no_build_loads(monkeypatch):
    monkeypatch.setattr(extension, "load", lambda: False)
    monkeypatch.setenv("BERT_FAST_NO_JIT", "1")
    with pytest.raises(RuntimeError, match="BERT_FAST_NO_JIT=1 forbids compiling one"):
        extension.build_extension(verbose=False)
