"""The benchmark command keeps working (tiny sizes; speed is never asserted here)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _quick(script: str) -> subprocess.CompletedProcess[str]:
    """``benchmarks/<script> --quick``, which must exit with status 0."""
    command = [sys.executable, os.path.join(ROOT, "benchmarks", script), "--quick"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_benchmarks_quick_prints_every_figure():
    done = _quick("run.py")
    for figure in ("P1", "P2", "P3", "P4", "P5", "P6", "P7", "P8"):
        assert f"\n{figure} " in done.stdout, f"{figure} missing from:\n{done.stdout}"


def test_gpu_benchmark_runs_or_says_it_needs_a_gpu():
    done = _quick("gpu.py")
    assert "no CUDA device here" in done.stdout or "step 2 x Linear(256)" in done.stdout, done.stdout


def test_mixture_benchmark_prints_every_figure():
    done = _quick("mixture.py")
    for figure in ("M1", "M2"):
        assert f"{figure} " in done.stdout, f"{figure} missing from:\n{done.stdout}"


def test_token_budget_benchmark_prints_balance_and_planning_time():
    done = _quick("token_budget.py")
    assert "T1 balance" in done.stdout and "\nT2 " in done.stdout, done.stdout
