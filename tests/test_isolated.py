"""tests/isolated.py: calls run in a child process; results and exceptions come back as they
were, and a crash or a hang of the child is one failed call that names its inputs."""

import os
import signal
import sys
import time

import pytest
import torch

from tests.isolated import ChildCrashed, ChildTimedOut, call_in_child, describe, shared_runner


# Module-level: the child finds them by reference.

def add_and_scale(x, y, scale=1.0):
    return (x + y) * scale


def raise_value_error(message):
    raise ValueError(message)


class NeedsTwoArguments(Exception):
    def __init__(self, code, detail):
        super().__init__(f"code {code}: {detail}")


def raise_unrebuildable(code):
    raise NeedsTwoArguments(code, "cannot be rebuilt from its message alone")


def raise_cuda_error():
    raise torch.AcceleratorError("CUDA error: device-side assert triggered")


def report_environment():
    return os.environ.get("TRITON_INTERPRET"), os.getpid()


def crash_with(signal_number, tensor):
    print(f"about to crash on a tensor of shape {tuple(tensor.shape)}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal_number)


def abort_on(_):
    os.abort()


def sleep_for(seconds):
    time.sleep(seconds)


def test_a_return_value_round_trips():
    x = torch.arange(12.0).view(3, 4).t()         # non-contiguous: strides travel too
    out = call_in_child(add_and_scale, x, torch.ones(4, 3), scale=2.0)
    assert torch.equal(out, (x + 1) * 2)
    assert call_in_child(add_and_scale, "a", "b", scale=3) == "ababab"


def test_the_child_sees_this_process_environment():
    interpret, child_pid = call_in_child(report_environment)
    assert interpret == os.environ.get("TRITON_INTERPRET") and child_pid != os.getpid()
    assert call_in_child(report_environment)[1] == child_pid, "one child serves the calls"


def test_an_exception_round_trips_with_its_type_and_message():
    with pytest.raises(ValueError, match=r"^bad input \(4,\)$") as error:
        call_in_child(raise_value_error, "bad input (4,)")
    assert "raise_value_error" in str(error.value.__cause__), "the child's traceback is its cause"


def test_an_exception_that_cannot_be_rebuilt_comes_back_as_a_runtime_error_naming_its_type():
    with pytest.raises(RuntimeError, match=r"NeedsTwoArguments: code 7: cannot be rebuilt"):
        call_in_child(raise_unrebuildable, 7)


# The tests that stop a child use the shared one too, in this order: each needs a child to stop,
# and the fresh child that the crash test checks for is the one the next test stops.

def test_a_cuda_error_comes_back_and_retires_the_child():
    _, pid = call_in_child(report_environment)
    with pytest.raises(torch.AcceleratorError, match="^CUDA error: device-side assert triggered$"):
        call_in_child(raise_cuda_error)
    with pytest.raises(ProcessLookupError):           # gone: the next call gets a fresh child
        os.kill(pid, 0)


def test_a_hang_hits_the_timeout_names_the_input_and_stops_the_child(monkeypatch):
    _, pid = call_in_child(report_environment)        # started: the timeout times the call alone
    monkeypatch.setattr(shared_runner, "timeout", 1)
    with pytest.raises(ChildTimedOut, match=r"sleep_for\(60\) did not return within 1 s; stopped it") as hang:
        call_in_child(sleep_for, 60)
    assert "in sleep_for" in str(hang.value), "faulthandler's stack says where it hung"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_crash_names_the_input_and_the_next_call_gets_a_fresh_child():
    _, first_pid = call_in_child(report_environment)
    with pytest.raises(ChildCrashed) as crash:
        call_in_child(crash_with, signal.SIGSEGV, torch.zeros(2, 3, dtype=torch.int32))
    message = str(crash.value)
    assert ("tests.test_isolated.crash_with(<Signals.SIGSEGV: 11>, "
            "tensor(int32, (2, 3), cpu, values=[[0, 0, 0], [0, 0, 0]])) was killed by SIGSEGV") in message
    assert "about to crash on a tensor of shape (2, 3)" in message, "the child's stderr tail"
    assert "Fatal Python error" in message and "in crash_with" in message, "faulthandler's stack"
    starts = shared_runner.starts
    _, second_pid = call_in_child(report_environment)
    assert second_pid != first_pid and shared_runner.starts == starts + 1


def test_an_abort_names_the_input():
    # What an uncaught C++ exception does (std::terminate).
    with pytest.raises(ChildCrashed, match=r"tests\.test_isolated\.abort_on\(tensor\(int64, \(2,\), cpu, "
                                           r"values=\[5, 6\]\)\) was killed by SIGABRT"):
        call_in_child(abort_on, torch.tensor([5, 6]))


def test_describe_summarises_inputs():
    ids = torch.arange(20).view(4, 5)
    assert describe(ids) == "tensor(int64, (4, 5), cpu, range=[0, 19])"
    assert describe(ids.t()) == "tensor(int64, (5, 4), cpu, stride=(1, 5), range=[0, 19])"
    assert describe(torch.zeros(100)) == "tensor(float32, (100,), cpu)"
    assert describe(torch.empty(2, 8, device="meta")) == "tensor(float32, (2, 8), meta)"
    assert describe((None, 1e-5, [True])) == "(None, 1e-05, [True])"
    assert describe("x" * 200).endswith("...") and len(describe("x" * 200)) == 80
