"""A process that ends, or is told to, while threads gather: sys.exit with
daemon threads inside gathers and prefetches pending, with daemon threads
held inside each of ple's calls until Python finalizes, and a SIGTERM
handler that joins gathering threads while the main thread gathers too.

Each case runs with one gathering thread and with 16, whose gathers run on
16 threads each: more native threads than CPUs on any machine these tests
run on, so that CI's two cores see the interleavings of a many-core machine
too.  Each case runs in a subprocess with a timeout (SIGKILL: a process whose
handler deadlocked would ignore the SIGTERM of a plain timeout)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from test_process_safety import PRELUDE, write_rows

# (threads gathering, threads each gather runs on, forked children that exit)
LOADS = {"one thread": (1, 2, 10), "16 threads": (16, 16, 10)}


@pytest.fixture(scope="module")
def table_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("exit") / "t.safetensors"
    write_rows(path, 200_000)
    return path


def run(script: str, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """`script` in a fresh interpreter, killed and failed when it has not
    ended in `timeout` seconds."""
    try:
        return subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"hung: no end within {timeout} s\nstdout: {expired.stdout!r}\n"
                    f"stderr: {expired.stderr!r}")


# Python's atexit runs its hooks last registered first.  This one, registered
# before weakref's (which the finalize below registers, before torch makes
# any), runs after every finalizer that is to run at exit, torch's undoing of
# its operator libraries included, and keeps the interpreter up a while
# longer, with the daemon threads gathering all the while.
LATE_EXIT_HOOK = """
import atexit, time, weakref
atexit.register(time.sleep, 0.2)
weakref.finalize(atexit, lambda: None)
"""

# Forked children (two at a time, so that on two cores each one's threads
# contend with the other's too), then the process itself, each start threads
# that gather and prefetch in a loop by every route, the way a server's
# loader threads do, leave prefetches pending that nobody takes, and exit
# with status 3 at a random moment once all of them gather.  A child's
# stderr goes to a file of its own; the process prints what each child's
# exit status and stderr were when they were not 3 and nothing.
EXIT_WHILE_GATHERING = """
import tempfile

THREADS, GATHER_THREADS, CHILDREN = (int(a) for a in sys.argv[2:5])

def gather_then_exit(seed):
    t = ple.Table.from_safetensors(PATH, config=ple.GatherConfig("none", 0, GATHER_THREADS))
    started = threading.Barrier(THREADS + 1)

    def loop(rng):
        first = True
        while True:
            ids = torch.from_numpy(rng.integers(0, t.num_rows, 200_000 // THREADS))
            t.prefetch(ids)
            t.prefetch(ids[:1000].clone())  # never taken: pending at exit
            if first:
                first = False
                started.wait()
            t.gather_bytes(ids)
            torch.ops.ple.disk_gather(ids, t.handle)
            ple.gather(t, ids[:1000])
            t.config = t.config

    for k in range(THREADS):
        threading.Thread(target=loop, args=(np.random.default_rng([seed, k]),), daemon=True).start()
    started.wait()
    time.sleep(np.random.default_rng(seed).uniform(0, 0.3))
    sys.exit(3)

def fork_child(seed):
    stderr = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:
        os.dup2(stderr.fileno(), 2)
        gather_then_exit(seed)  # raises SystemExit: the child ends with it
    return seed, pid, stderr

for first in range(0, CHILDREN, 2):
    for seed, pid, stderr in [fork_child(seed) for seed in range(first, min(first + 2, CHILDREN))]:
        status = wait_child(pid, 60)
        stderr.seek(0)
        said = stderr.read().decode(errors="replace")
        if (status, said) != (3, ""):
            print(f"child {seed}: exit status {status}, stderr {said[-3000:]!r}", flush=True)
gather_then_exit(CHILDREN)
"""


@pytest.mark.parametrize("load", LOADS)
def test_sys_exit_while_daemon_threads_gather_exits_with_its_status(table_path, load):
    """No abort (a native thread destroyed joinable, a gather coming back to
    a finalized interpreter) and no error of torch's (the operators undone
    while the daemon threads still call them): every exit status is
    sys.exit's, and stderr says nothing."""
    threads, gather_threads, children = LOADS[load]
    script = LATE_EXIT_HOOK + PRELUDE + textwrap.dedent(EXIT_WHILE_GATHERING)
    result = run(script, [str(table_path), str(threads), str(gather_threads), str(children)])
    assert (result.returncode, result.stdout, result.stderr) == (3, "", ""), (
        result.returncode, result.stdout[-6000:], result.stderr[-3000:])


# Every call of ple that lets go of the GIL, by each route a program takes to
# it: a daemon thread each, held there (native.hold_calls_until_exit) until
# Python finalizes, then let go.  CPython before 3.14 ends a thread that comes
# back for the GIL then with pthread_exit, whose unwinding must not meet a
# frame it cannot pass (a noexcept destructor taking the GIL back aborts the
# process).
CALLS = {
    "Table.gather_bytes": "t.gather_bytes(ids)",
    "Table.prefetch": "t.prefetch(ids)",
    "ple.gather": "ple.gather(t, ids)",
    "torch.ops.ple.disk_gather": "torch.ops.ple.disk_gather(ids, t.handle)",
    "torch.ops.ple.disk_gather_bytes": "torch.ops.ple.disk_gather_bytes(ids, t.handle)",
    "Table.config": "t.config = ple.GatherConfig('none', 0, 2)",
    "Table.place": "t.place(host_rows=100)",
    "Table.drop_prefetches": "t.drop_prefetches()",
    "Table.prefetched_bytes": "t.prefetched_bytes()",
    "Table.drop_page_cache": "t.drop_page_cache()",
    "Table.close": "t.close()",
    "Table.from_safetensors": "ple.Table.from_safetensors(PATH)",
}

# Replaces the std::terminate handler (ple's, which makes such a thread wait)
# with libstdc++'s default, as a library loaded after ple may: ple's own calls
# must not need it.
REPLACE_TERMINATE_HANDLER = """
import ctypes
libstdcxx = ctypes.CDLL("libstdc++.so.6")
libstdcxx._ZSt13set_terminatePFvvE.restype = ctypes.c_void_p
libstdcxx._ZSt13set_terminatePFvvE(ctypes.cast(
    libstdcxx._ZN9__gnu_cxx27__verbose_terminate_handlerEv, ctypes.c_void_p))
"""

EXIT_WHILE_HELD = """
from ple.kernels.native import native

CALLS = eval(sys.argv[2])
ids = torch.arange(1000)

def call(statement):
    t = ple.Table.from_safetensors(PATH)  # one each: one of them is closed
    exec(statement)

native.hold_calls_until_exit()
for statement in CALLS.values():
    threading.Thread(target=call, args=(statement,), daemon=True).start()
deadline = time.monotonic() + 30
while native.held_calls() < len(CALLS):
    assert time.monotonic() < deadline, f"{native.held_calls()} of {len(CALLS)} calls held"
    time.sleep(0.001)
if sys.argv[3] == "replaced":
    exec(REPLACE_TERMINATE_HANDLER)
sys.exit(3)
"""


@pytest.mark.parametrize("terminate_handler", ["ple's", "replaced"])
def test_sys_exit_while_daemon_threads_are_held_inside_each_call(table_path, terminate_handler):
    """Each of ple's calls, on a daemon thread, lets go of the GIL and is held
    there until Python finalizes, then comes back: the process exits with
    sys.exit's status and says nothing, whoever handles std::terminate."""
    script = (PRELUDE + f"REPLACE_TERMINATE_HANDLER = {REPLACE_TERMINATE_HANDLER!r}\n"
              + textwrap.dedent(EXIT_WHILE_HELD))
    result = run(script, [str(table_path), repr(CALLS), terminate_handler], timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (3, "", ""), (
        result.returncode, result.stdout[-3000:], result.stderr[-3000:])


# Daemon threads running Python code inside ple's operators (their kernels
# are Python functions, which torch's dispatcher calls from C++) when Python
# finalizes: CPython ends each when it next waits for the GIL there.  A
# Table.gather_bytes that spins stands in for the kernels' own Python code.
EXIT_WHILE_IN_KERNELS = """
CALLS = ["torch.ops.ple.disk_gather(ids, t.handle)",
         "torch.ops.ple.disk_gather_bytes(ids, t.handle)", "ple.gather(t, ids)"]
t = ple.Table.from_safetensors(PATH)
ids = torch.arange(1000)
inside = threading.Semaphore(0)

def spin(self, ids, owner=0):
    inside.release()
    while True:
        pass

ple.Table.gather_bytes = spin
for statement in CALLS:
    threading.Thread(target=exec, args=(statement, globals()), daemon=True).start()
for _ in CALLS:
    assert inside.acquire(timeout=30)
if sys.argv[2] == "replaced":
    exec(REPLACE_TERMINATE_HANDLER)
sys.exit(3)
"""


@pytest.mark.parametrize("terminate_handler", ["ple's", "replaced"])
def test_sys_exit_while_daemon_threads_run_python_inside_ple_operators(table_path,
                                                                      terminate_handler):
    """A thread that Python ends inside an operator's kernel is not unwound
    through torch's dispatcher (whose frames take the GIL back or give it up
    on the way): the process exits with sys.exit's status and says nothing."""
    script = (PRELUDE + f"REPLACE_TERMINATE_HANDLER = {REPLACE_TERMINATE_HANDLER!r}\n"
              + textwrap.dedent(EXIT_WHILE_IN_KERNELS))
    result = run(script, [str(table_path), terminate_handler], timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (3, "", ""), (
        result.returncode, result.stdout[-3000:], result.stderr[-3000:])


# The main thread gathers from `a` until a gather of it runs the SIGTERM
# handler, which stops and joins the threads that gather from `b` meanwhile
# (other tables, so that their gathers count apart; one worker pool for all).
# The case is made only if the handler runs inside the main thread's gather,
# while that gather holds its turn at the pool: there a handler that joins
# threads whose gathers wait for that turn deadlocks unless the turn is
# yielded.  Polls at every check make a signal that arrives inside a gather
# run its handler there (by default a gather polls every 50 ms, and a short
# one never); the watcher sends the signal only while the main thread has let
# go of the GIL inside the gather.  A signal that still comes after the
# gather (the main thread's last check passed before the watcher ran) is let
# be, and the next gather gets another.
SIGTERM_WHILE_GATHERING = """
from ple.kernels.native import native

THREADS, GATHER_THREADS = (int(a) for a in sys.argv[2:4])
config = ple.GatherConfig("none", 0, GATHER_THREADS)
a = ple.Table.from_safetensors(PATH, config=config)
ids = torch.from_numpy(np.random.default_rng(0).integers(0, a.num_rows, 200_000))
stop = threading.Event()
gathers_after_stop = []

def work(b):
    while True:
        check(ids, b.gather_bytes(ids))
        if stop.is_set():
            gathers_after_stop.append(1)
            return

workers = [threading.Thread(target=work, args=(ple.Table.from_safetensors(PATH, config=config),))
           for _ in range(THREADS)]
for worker in workers:
    worker.start()

# "gather": the main thread is between its call of native.gather and that
# call's return; "counted": a's gathers that had ended when it started one.
state = {"gather": False, "counted": 0, "attempt": 0, "sent": 0}

def on_term(signum, frame):
    if not (state["gather"] and a.stats()["calls"] == state["counted"]):
        return  # after the gather: the next one gets another signal
    stop.set()
    for worker in workers:
        worker.join()
    print(f"joined inside gather {state['attempt']}; the workers gathered "
          f"{len(gathers_after_stop)} times after the stop", flush=True)
    sys.exit(7)

def profile(frame, event, arg):
    if arg is native.gather:
        # The last thing done before the call: no handler runs in between.
        state["gather"] = event == "c_call"

def watch():
    # Runs only while the main thread lets go of the GIL.
    while True:
        if state["gather"] and state["sent"] < state["attempt"]:
            state["sent"] = state["attempt"]
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0)

signal.signal(signal.SIGTERM, on_term)
native.set_poll_interval(0)
threading.Thread(target=watch, daemon=True).start()
for attempt in range(1, 51):
    state["attempt"], state["counted"] = attempt, a.stats()["calls"]
    sys.setprofile(profile)
    rows = a.gather_bytes(ids)
    sys.setprofile(None)
    check(ids, rows)
print("no signal came inside a gather in 50 gathers", flush=True)
sys.exit(1)
"""


@pytest.mark.parametrize("load", LOADS)
def test_a_sigterm_handler_that_joins_gathering_threads_finishes(table_path, load):
    """The main thread's gathers run Python's signal handlers (Ctrl-C); a
    handler that joins other gathering threads must not wait for gathers
    that wait for the main thread's."""
    threads, gather_threads, _ = LOADS[load]
    script = PRELUDE + textwrap.dedent(SIGTERM_WHILE_GATHERING)
    result = run(script, [str(table_path), str(threads), str(gather_threads)])
    assert result.returncode == 7, (result.returncode, result.stdout, result.stderr[-3000:])
    assert "joined inside gather" in result.stdout, (result.stdout, result.stderr[-3000:])


# Daemon threads inside torch's own operators (torch lets go of the GIL around
# them) when Python exits: CPython ends each as it comes back for the GIL, in
# torch's frames, which reach std::terminate of the process's libstdc++.  ple's
# handler there parks such a thread; it is put back at exit where a library
# replaced it since ple's import (here: ctypes, as another library would), and
# it is set in the process's libstdc++ even where ple's own is another copy
# (seen on the GPU machine: the default handler aborted).
EXIT_WHILE_IN_TORCH = """
import ctypes
if sys.argv[2] == "replaced after import":
    libstdcxx = ctypes.CDLL("libstdc++.so.6")
    libstdcxx._ZSt13set_terminatePFvvE.restype = ctypes.c_void_p
    libstdcxx._ZSt13set_terminatePFvvE(ctypes.cast(
        libstdcxx._ZN9__gnu_cxx27__verbose_terminate_handlerEv, ctypes.c_void_p))
a = torch.randn(1500, 1500)
inside = threading.Semaphore(0)

def multiply():
    inside.release()
    while True:
        torch.mm(a, a)

for _ in range(2):
    threading.Thread(target=multiply, daemon=True).start()
for _ in range(2):
    assert inside.acquire(timeout=30)
time.sleep(0.1)
sys.exit(3)
"""


@pytest.mark.parametrize("handler", ["ple's", "replaced after import"])
def test_sys_exit_while_daemon_threads_run_torch_operators(table_path, handler):
    script = PRELUDE + textwrap.dedent(EXIT_WHILE_IN_TORCH)
    for _ in range(3):
        result = run(script, [str(table_path), handler], timeout=60)
        assert (result.returncode, result.stdout, result.stderr) == (3, "", ""), (
            result.returncode, result.stdout[-3000:], result.stderr[-3000:])
