"""The doorbell's protocol without a GPU (tests/doorbell_protocol.cpp:
kernels/doorbell_gather.cpp with threads standing for the GPU and for the
driver's host-function thread): every ring is answered exactly once, by one
answerer at a time, and none waits past a deadline, whether the doorbell
thread sleeps or spins, the wake-up node runs beside the copy or before it,
replays come back to back or after pauses around every bound, on one graph
or on four at once.  After pauses the wake-up nodes answer; back to back
the thread does; a node that runs before its ring hands it to the thread."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().with_name("doorbell_protocol.cpp")


@pytest.fixture(scope="module")
def phases(tmp_path_factory) -> dict[str, dict]:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler {cxx!r}")
    binary = tmp_path_factory.mktemp("doorbell") / "doorbell_protocol"
    subprocess.run([cxx, "-O2", "-std=c++17", "-pthread", "-o", str(binary), str(HARNESS)],
                   check=True, timeout=300)
    try:
        proc = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as hang:
        pytest.fail(f"the protocol hung: {hang.stdout}")
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    failures = [line for line in lines if "failure" in line]
    assert not failures and proc.returncode == 0, proc.stdout + proc.stderr
    assert lines[-1] == {"done": True}
    return {line["phase"]: line for line in lines if "phase" in line}


def answered(phase: dict) -> int:
    return phase["by_thread"] + phase["by_node"]


def test_every_ring_is_answered_once(phases):
    assert set(phases) == {"after_pauses", "back_to_back", "serialized", "always_spins",
                           "after_a_long_pause", "concurrent"}
    for name, phase in phases.items():
        assert answered(phase) == phase["replays"], name


def test_after_pauses_the_wake_up_node_answers(phases):
    # Pauses of 3 ms: the thread sleeps; no replay comes close to another.
    assert phases["after_pauses"]["by_node"] >= 1
    assert phases["after_pauses"]["thread_wakes"] == 0
    assert phases["after_a_long_pause"]["replays"] == 3


def test_back_to_back_the_thread_answers(phases):
    assert phases["back_to_back"]["by_thread"] >= 1


def test_a_node_run_before_its_ring_hands_it_to_the_thread(phases):
    serialized = phases["serialized"]
    assert serialized["by_node"] == 0 and serialized["by_thread"] == serialized["replays"]
    assert serialized["handed_over"] >= 1


def test_a_thread_that_always_spins_answers_every_ring(phases):
    spinning = phases["always_spins"]
    assert spinning["by_thread"] == spinning["replays"] and spinning["handed_over"] == 0
