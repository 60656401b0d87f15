"""A process that ends, or is told to, while threads gather: sys.exit with a
daemon thread inside a gather and prefetches pending, and a SIGTERM handler
that joins a gathering thread while the main thread gathers too.

Each case runs in a subprocess with a timeout (SIGKILL: a process whose
handler deadlocked would ignore the SIGTERM of a plain timeout)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from test_process_safety import PRELUDE, write_rows


@pytest.fixture(scope="module")
def table_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("exit") / "t.safetensors"
    write_rows(path, 200_000)
    return path


def run(body: str, path, timeout: float = 60) -> subprocess.CompletedProcess:
    """PRELUDE + body in a fresh interpreter (argv[1] = path), killed and
    failed when it has not ended in `timeout` seconds."""
    script = PRELUDE + textwrap.dedent(body)
    try:
        return subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"hung: no end within {timeout} s\nstderr: {expired.stderr!r}")


# The daemon thread gathers and prefetches in a loop, the way a server's
# loader thread does, and leaves a prefetch pending that nobody takes.
EXIT_WHILE_GATHERING = """
t = ple.Table.from_safetensors(PATH, config=ple.GatherConfig("none", 0, 2))
rng = np.random.default_rng(int(sys.argv[2]))
started = threading.Event()

def loop():
    while True:
        ids = torch.from_numpy(rng.integers(0, t.num_rows, 200_000))
        t.prefetch(ids)
        t.prefetch(ids[:1000].clone())  # never taken: pending at exit
        started.set()
        t.gather_bytes(ids)
        torch.ops.ple.disk_gather(ids, t.handle)

threading.Thread(target=loop, daemon=True).start()
started.wait()
time.sleep(rng.uniform(0, 0.3))
sys.exit(3)
"""


def test_sys_exit_while_a_daemon_thread_gathers_exits_with_its_status(table_path):
    for run_number in range(10):
        script = PRELUDE + textwrap.dedent(EXIT_WHILE_GATHERING)
        try:
            result = subprocess.run([sys.executable, "-c", script, str(table_path), str(run_number)],
                                    capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired as expired:
            pytest.fail(f"run {run_number} hung\nstderr: {expired.stderr!r}")
        assert "terminate called" not in result.stderr, (run_number, result.stderr[-3000:])
        assert result.returncode == 3, (run_number, result.returncode, result.stderr[-3000:])


def test_a_sigterm_handler_that_joins_a_gathering_thread_finishes(table_path):
    """The main thread's gathers run Python's signal handlers (Ctrl-C); a
    handler that joins another gathering thread must not wait for a gather
    that waits for the main thread's."""
    in_a_gather = []
    for run_number in range(3):
        result = run(f"""
            t = ple.Table.from_safetensors(PATH, config=ple.GatherConfig("none", 0, 2))
            ids = torch.from_numpy(np.random.default_rng(0).integers(0, t.num_rows, 1_000_000))
            stop = threading.Event()
            gathers = []

            def work():
                while not stop.is_set():
                    check(ids, t.gather_bytes(ids))
                    gathers.append(1)

            worker = threading.Thread(target=work)
            worker.start()
            in_gather = []

            def on_term(signum, frame):
                in_gather.append(frame.f_code.co_name == "gather_bytes")
                stop.set()
                worker.join()
                print("joined after", len(gathers), "gathers; in a gather:", in_gather[0], flush=True)
                sys.exit(7)

            signal.signal(signal.SIGTERM, on_term)
            threading.Timer(0.3 + 0.1 * {run_number}, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
            while True:
                check(ids, t.gather_bytes(ids))
        """, table_path, timeout=60)
        assert result.returncode == 7, (run_number, result.returncode, result.stdout, result.stderr[-3000:])
        assert "joined after" in result.stdout, (result.stdout, result.stderr[-3000:])
        in_a_gather.append("in a gather: True" in result.stdout)
    # Otherwise the case was not made: the signal came between gathers each time.
    assert any(in_a_gather), in_a_gather
