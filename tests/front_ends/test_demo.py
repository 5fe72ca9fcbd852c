"""The Quick start demo launches 2 gloo processes and prints each process's batches."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_demo_prints_the_per_process_assignment():
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "demo.py")], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert (
        "process 1: 4 batches [[3, 4, 5], [9, 10, 11], [15, 16, 17], [0, 1, 2]]" in out
    )  # docs/sharding.md worked example, n=21, b=3
    assert "process 0: 6 batches [[0, 1], [4, 5], [8, 9], [12, 13], [16, 17], [20, 0]]" in out  # split
    assert "process 1: 3 batches [[3, 4, 5], [9, 10, 11], [15, 16, 17]]" in out  # even_batches=False


def test_resume_and_resize_example_is_exact():
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "resume_and_resize.py")],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed on 3 processes" in done.stdout
    assert "50/50 samples seen, missing [], duplicated []" in done.stdout and "exact=True" in done.stdout
