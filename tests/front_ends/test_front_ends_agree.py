"""The same mixed-precision run with overflowing steps agrees across plain PyTorch, Lightning, Fabric and Ignite.

One stepping engine serves every front end (``shardplug.core.stepping.amp``): identical skip reports (fused
AdamW included), identical scheduler positions, identical parameters. The run itself is
``tests/scripts/amp_front_ends.py``, in a subprocess (Lightning and Fabric start a process group).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
pytest.importorskip("shardplug_lightning")
pytest.importorskip("shardplug_ignite")

SCRIPT = Path(__file__).parents[1] / "scripts" / "amp_front_ends.py"
FRONT_ENDS = ("plain", "ignite", "lightning", "fabric")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("amp") / "results.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("kind", ["sgd", "adamw", "adamw_fused", "two"])
def test_every_front_end_steps_identically(results: dict, kind: str) -> None:
    runs = results[kind]
    reference = runs["plain"]
    for name in FRONT_ENDS[1:]:
        run = runs[name]
        assert run["skips"] == reference["skips"], name
        assert (run["last_epoch"], run["lr"], run["scale"]) == (
            reference["last_epoch"],
            reference["lr"],
            reference["scale"],
        ), name
        assert run["params"] == reference["params"], name  # bit for bit: the same updates
    for name in ("lightning", "fabric"):
        assert runs[name]["scheduler_type"] == "PreparedScheduler"


@pytest.mark.parametrize("kind", ["sgd", "adamw", "adamw_fused"])
def test_overflowing_steps_are_skipped_and_do_not_move_the_scheduler(results: dict, kind: str) -> None:
    run = results[kind]["plain"]
    # batches 1 and 4 overflow: both skipped (the fused optimizer too, which the scaler calls)
    assert run["skips"] == [[False], [True], [False], [False], [True], [False]]
    assert run["last_epoch"] == 4  # 6 batches, 4 real steps


@pytest.mark.parametrize("kind", ["sgd", "adamw", "adamw_fused", "two"])
def test_the_scheduler_the_user_created_reads_right_after_each_step(results: dict, kind: str) -> None:
    """On the CPU the skip flag is on the host: nothing is deferred, so the scheduler the user created (not
    the prepared wrapper) reads the real updates so far right after each step, as in torch, in every front end."""
    for name in FRONT_ENDS:
        run = results[kind][name]
        real = [sum(not all(row) for row in run["skips"][: i + 1]) for i in range(len(run["skips"]))]
        assert run["epochs"] == real, name
