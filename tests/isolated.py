"""Run a call in a child process, so that a crash fails one test instead of the whole run.

The extension's ops report bad input by throwing a C++ exception. Where a toolchain linked
libstdc++ statically into the extension, every such throw killed the process (SIGSEGV, abort),
and pytest lost the worker with all the tests it had yet to run. A CUDA device-side assert
likewise leaves the process's CUDA context unusable. Error-path tests therefore call into native
code through ``call_in_child(fn, *args, **kwargs)``: ``fn(*args, **kwargs)`` runs in a child
process, and the caller gets its return value, or its exception re-raised here with the same
type and message (the child's traceback as its ``__cause__``). If the child dies or hangs during
the call, the caller gets ChildCrashed, which names the call and its inputs, the signal or exit
status and the child's last stderr lines; the next call starts a fresh child.

``fn`` travels by reference (pickle): it must be a module-level function of an importable
module (``tests.*``, ``bert_fast.*``), not a lambda or a local function. Its arguments and its
result are pickled by value (tensors keep their shape, strides, dtype and device).

One child serves the whole session, one call at a time (``call_in_child``, ``shared_runner``;
``ChildRunner`` makes others). It starts at the first call, with multiprocessing's "spawn"
method: a fresh interpreter (fork after torch, OpenMP or CUDA have started is unsafe) with this
process's environment (TRITON_INTERPRET ...) and sys.path. Like every spawned process it first
imports the parent's main script: a script (not pytest) that calls this needs the
``if __name__ == "__main__":`` guard. Costs (2-core CPU machine, loaded): starting a child
~1.8 s (importing torch; its first extension op call then imports bert_fast, ~0.3 s), a call
~0.05 ms, ~1 ms for an extension op's call with a few small tensors (0.01 ms in-process).
"""

import atexit
import faulthandler
import functools
import importlib
import json
import multiprocessing
import os
import pathlib
import pickle
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback

import torch

DEFAULT_TIMEOUT_S = 300.0          # a call's; generous: a hang, not a slow call, should hit it
START_TIMEOUT_S = 120.0           # starting a child (importing torch), apart from its calls
STDERR_TAIL_LINES = 25


class ChildCrashed(Exception):
    """The child process died (a signal, or an exit) while running a call."""


class ChildTimedOut(ChildCrashed):
    """The call did not return within the runner's timeout; the child was stopped."""


class ChildTraceback(Exception):
    """The traceback, in the child, of an exception re-raised in the caller (as its cause)."""


# ---------------------------------------------------------------------------------------------
# The child

def _serve(conn, stderr_path):
    """The child's loop: run each pickled (fn, args, kwargs) and send back what came of it."""
    # stderr goes to a file that the parent reads after a crash; faulthandler writes the Python
    # stack of a fatal signal there (and on the SIGABRT the parent sends to a call that hangs).
    log = os.open(stderr_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 2)
    os.close(log)
    faulthandler.enable()
    # No core files: the stack above says where it crashed, and dumping a torch (+ CUDA) process
    # takes long and gigabytes, on every crash of a broken build.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    conn.send_bytes(b"ready")     # the parent times each call from here: starting is not the call's
    while True:
        try:
            request = conn.recv_bytes()
        except EOFError:          # the parent has gone: done
            return
        sys.stderr.flush()
        os.ftruncate(2, 0)        # the tail read after a crash is this call's output only
        try:
            fn, args, kwargs = pickle.loads(request)
            reply = pickle.dumps(("returned", fn(*args, **kwargs), False))
        except Exception as e:    # the call's, or unpickling / pickling a result
            reply = pickle.dumps(("raised", _exception_record(e), _leaves_cuda_unusable(e)))
        conn.send_bytes(reply)


def _leaves_cuda_unusable(error):
    """A CUDA error (a device-side assert, a fault) is sticky: every later CUDA call in this
    process fails too. The parent retires such a child, so it fails one call, not the rest."""
    return isinstance(error, torch.AcceleratorError) or "CUDA error" in str(error)


def _exception_record(error):
    try:
        pickled = pickle.dumps(error)
    except Exception:
        pickled = None
    kind = type(error)
    return {"module": kind.__module__, "qualname": kind.__qualname__, "message": str(error),
            "pickled": pickled, "traceback": "".join(traceback.format_exception(error))}


# ---------------------------------------------------------------------------------------------
# The parent

def _rebuild_exception(record):
    """The child's exception with the same type and message; RuntimeError naming that type when
    it cannot be rebuilt here."""
    candidates = []
    if record["pickled"] is not None:
        candidates.append(lambda: pickle.loads(record["pickled"]))

    def from_type():
        kind = importlib.import_module(record["module"])
        for name in record["qualname"].split("."):
            kind = getattr(kind, name)
        return kind(record["message"])

    candidates.append(from_type)
    for rebuild in candidates:
        try:
            error = rebuild()
        except Exception:
            continue
        if isinstance(error, BaseException) and str(error) == record["message"]:
            return error
    return RuntimeError(f"(in the child) {record['module']}.{record['qualname']}: {record['message']}")


def describe(value, limit=80):
    """A short readable summary of a call's input: tensors by dtype, shape, device, strides when
    not contiguous, their values when small and the range of larger integer ones."""
    if isinstance(value, torch.Tensor):
        return _describe_tensor(value)
    if isinstance(value, (list, tuple)):
        inner = ", ".join(describe(v, limit) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _describe_tensor(t):
    parts = [str(t.dtype).removeprefix("torch."), str(tuple(t.shape)), str(t.device)]
    if not t.is_contiguous():
        parts.append(f"stride={t.stride()}")
    if t.device.type != "meta" and t.numel():
        try:
            if t.numel() <= 8:
                parts.append(f"values={t.tolist()}")
            elif not (t.is_floating_point() or t.is_complex()):     # ids: the range says if one is out of it
                parts.append(f"range=[{t.min().item()}, {t.max().item()}]")
        except Exception:        # the values are a courtesy: the shape alone still names the input
            pass
    return f"tensor({', '.join(parts)})"


def describe_call(fn, args, kwargs):
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    inputs = [describe(a) for a in args] + [f"{k}={describe(v)}" for k, v in kwargs.items()]
    return f"{name}({', '.join(inputs)})"


def _stopped_how(exitcode):
    if exitcode is None:
        return "closed its pipe but did not exit; killed it"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


class ChildRunner:
    """A child process that runs calls one at a time (see the module's docstring)."""

    def __init__(self, timeout=DEFAULT_TIMEOUT_S):
        self.timeout = timeout
        self.starts = 0                    # how many children it has started (for its tests)
        self._process = self._conn = self._stderr_path = None

    def call(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) in the child: its result, or its exception raised here."""
        __tracebackhide__ = True     # pytest: a failure shows the test's line and the message
        request = pickle.dumps((fn, args, kwargs))     # an unpicklable fn fails here, as itself
        if self._process is None or not self._process.is_alive():
            self._start()
        try:
            self._conn.send_bytes(request)
            answered = self._conn.poll(self.timeout)   # also True when the child dies (EOF)
            reply = self._conn.recv_bytes() if answered else None
        except (EOFError, BrokenPipeError, ConnectionResetError):
            raise ChildCrashed(self._crash_report(fn, args, kwargs)) from None
        if reply is None:
            raise ChildTimedOut(self._timeout_report(fn, args, kwargs))
        kind, value, retire = pickle.loads(reply)
        if retire:
            self.close()             # the next call starts a fresh child
        if kind == "returned":
            return value
        raise _rebuild_exception(value) from ChildTraceback(value["traceback"])

    def close(self):
        """Stop the child and remove its stderr file."""
        if self._process is not None:
            self._conn.close()
            # Killed, not asked to exit: it holds nothing to save, and tearing down torch takes
            # ~0.5 s that every retired child would cost.
            self._process.kill()
            self._process.join()
        if self._stderr_path is not None:
            try:
                os.unlink(self._stderr_path)
            except FileNotFoundError:
                pass
        self._process = self._conn = self._stderr_path = None

    def _start(self):
        self.close()
        context = multiprocessing.get_context("spawn")
        fd, self._stderr_path = tempfile.mkstemp(prefix="bert_fast_child_", suffix=".stderr")
        os.close(fd)
        conn, child_end = context.Pipe()
        process = context.Process(target=_serve, args=(child_end, self._stderr_path), daemon=True,
                                  name="tests.isolated child")
        process.start()
        child_end.close()            # so that the child's death reads as EOF here
        self._process, self._conn = process, conn
        self.starts += 1
        try:
            ready = conn.poll(START_TIMEOUT_S) and conn.recv_bytes() == b"ready"
        except EOFError:
            ready = False
        if not ready:
            hung = process.is_alive()
            self.close()
            how = (f"did not start within {START_TIMEOUT_S:g} s" if hung
                   else f"{_stopped_how(process.exitcode)} while starting")
            raise ChildCrashed(f"the child process {how}; its error, if any, is on this process's stderr")

    def _stderr_tail(self):
        try:
            with open(self._stderr_path, errors="replace") as f:
                lines = f.read().splitlines()[-STDERR_TAIL_LINES:]
        except OSError:
            return ""
        if not lines:
            return "\n(nothing on its stderr during the call)"
        return f"\n--- the child's stderr during the call (last {len(lines)} lines) ---\n" + "\n".join(lines)

    def _crash_report(self, fn, args, kwargs):
        self._process.join(timeout=10)
        exitcode = self._process.exitcode
        report = (f"the child process running {describe_call(fn, args, kwargs)} {_stopped_how(exitcode)}"
                  f"{self._stderr_tail()}")
        self.close()                 # the next call starts a fresh child
        return report

    def _timeout_report(self, fn, args, kwargs):
        # SIGABRT first: faulthandler writes where the child's Python code was stuck.
        os.kill(self._process.pid, signal.SIGABRT)
        self._process.join(timeout=5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        report = (f"the child process running {describe_call(fn, args, kwargs)} did not return within "
                  f"{self.timeout:g} s; stopped it{self._stderr_tail()}")
        self.close()
        return report


shared_runner = ChildRunner()
atexit.register(shared_runner.close)


def call_in_child(fn, *args, **kwargs):
    """fn(*args, **kwargs) in the session's shared child (see the module's docstring)."""
    __tracebackhide__ = True
    return shared_runner.call(fn, *args, **kwargs)


# ---------------------------------------------------------------------------------------------
# The extension's ops (tests/test_ext_*.py)

def call_ext_op(name, *args):
    """torch.ops.bert_fast.<name>(*args), run in the child: it loads the extension there first
    (the tests' ``ops`` fixture has built it, so this only loads the cached build)."""
    import bert_fast

    bert_fast.build_extension(verbose=False)
    return getattr(torch.ops.bert_fast, name)(*args)


class ExtOpsInChild:
    """``torch.ops.bert_fast`` with every call run in the shared child:
    ``ExtOpsInChild().ext_add_layernorm_fwd(x, ...)``."""

    def __getattr__(self, name):
        if not name.startswith("ext_"):
            raise AttributeError(name)
        return functools.partial(call_in_child, call_ext_op, name)


class BackgroundProcess:
    """A long command (a compile for a GPU: a minute or more of one core) that runs beside the
    rest of the suite: started once per session, by conftest.py when collection ends (on the
    2-core CI machine the tests keep one core, this the other), or else by the first test that
    reads it. It runs at a lower priority (nice 10), so that the tests in the foreground keep
    their core when several such commands run at once. Its output, and what it writes under
    ``workdir`` (a directory of its own; ``env(workdir)`` gives the variables it is run with),
    are removed at exit."""

    def __init__(self, command, env=None, cwd=None):
        self.command, self.env, self.cwd, self.process = list(command), env, cwd, None
        self.workdir = pathlib.Path(tempfile.mkdtemp(prefix="bert_fast-background-"))
        atexit.register(self._clean_up)

    def start(self):
        if self.process is None:
            env = self.env(self.workdir) if self.env else None
            with open(self.workdir / "stdout", "w") as out, open(self.workdir / "stderr", "w") as err:
                self.process = subprocess.Popen(self.command, cwd=self.cwd, env=env, stdout=out, stderr=err,
                                                preexec_fn=lambda: os.nice(10))
        return self

    def stdout(self, timeout=900):
        """The command's output once it has exited; the test fails with its stderr if it failed."""
        self.start().process.wait(timeout)
        out, err = ((self.workdir / name).read_text() for name in ("stdout", "stderr"))
        assert self.process.returncode == 0, f"{' '.join(self.command)} failed:\n{out[-3000:]}\n{err[-6000:]}"
        return out

    def _clean_up(self):
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


class BackgroundCall(BackgroundProcess):
    """``fn(*args)`` in a BackgroundProcess of its own (``python -m tests.isolated``): ``fn`` a
    module-level function of an importable module, its arguments and its result JSON values.
    ``result()`` waits for it; a crash or an exception fails the test with the child's stderr."""

    def __init__(self, fn, *args):
        super().__init__([sys.executable, "-m", "tests.isolated", f"{fn.__module__}:{fn.__name__}",
                          json.dumps(args)], cwd=pathlib.Path(__file__).resolve().parent.parent)

    def result(self):
        return json.loads(self.stdout().splitlines()[-1])


if __name__ == "__main__":
    _module, _name = sys.argv[1].split(":")
    print(json.dumps(getattr(importlib.import_module(_module), _name)(*json.loads(sys.argv[2]))))
