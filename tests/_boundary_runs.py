"""The boundary matrix's runs: positions saved at an epoch's boundaries resume exactly in every front end, on the
same, fewer and more processes (``tests/resume/test_boundaries.py``, a class per front end).

One matrix (``tests/_boundaries.py`` holds the oracle and its points): a run of 2 epochs is saved after
the first, a middle and the last optimizer step of epoch 0, inside an accumulation cycle, at the
epoch's end and after its epoch-end validation, killed with SIGKILL at the first step of epoch 1,
and each saved position is resumed on another number of processes (2 -> 1, 3 -> 2, 3 -> 1, 1 -> 2,
2 -> 3, and the same) to the end of epoch 1: every sample once per epoch (padding marked), the
documented number of batches and optimizer / scheduler steps. Each front end saves its own way:
Lightning by ``ModelCheckpoint`` and ``Trainer.fit(ckpt_path=...)``, Fabric by ``fabric.save`` /
``fabric.load``, Ignite by ``Checkpoint`` and ``Checkpoint.load_objects``, plain PyTorch by
``torch.save`` of ``state_dict()``. Real gloo processes: one scenario program for every front end
(``tests/scripts/boundaries.py``, with an adapter per front end) launches its own; the jobs of a front end (its
setups' first runs, relays and resumed runs) share its runs, one process group for several jobs of one number of
processes (:func:`programs`).

The setups split the options between them (accumulation, ``drop_last``, workers, a seeded and an
agreed shuffle, a validation loop), each with the layouts that meet it; Fabric and Ignite, whose
processes import their framework for seconds, meet fewer (2 -> 1, 2 -> 3, 1 -> 2, 3 -> 2). Every front
end steps at the new layout's cycles of the epoch (the one accumulation rule after a resume).

Relays (:data:`RELAYS`): a second kill and resize inside the epoch after a first resized resume. One position
of a first run is resumed on another number of processes, which saves after every batch of its epoch and is
killed in the next; its positions after its first batch, a middle one and, where ``drop_last`` leaves it, the
first after which the third layout has no step left in the epoch, join the resumed runs of that layout (the
same oracle, from the relay's counters). Lightning also resumes each relay position saved after a resume
from an epoch's last step with the epoch progress an older shardplug left there (``<point>-old``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
from _boundaries import Setup, check_resumed, relay_epoch, relay_points, relayed, rows_until

SCRIPTS = Path(__file__).resolve().parent / "scripts"

Layouts = tuple[tuple[int, tuple[int, ...]], ...]
"""``((resumed on M processes, from the first runs on (N, ...)), ...)``"""

LIGHTNING: dict[str, tuple[Setup, Layouts]] = {
    # setup id: (setup, ((resumed on M, from (N, ...)), ...))
    "seeded": (Setup(n=37), ((1, (2, 3)), (2, (3, 2)), (3, (2,)))),
    "agreed-accumulate3-droplast-workers2-validation": (
        Setup(n=64, accumulation=3, drop_last=True, workers=2, shuffle="agreed", validation=True),
        ((2, (1, 3)), (1, (3,))),
    ),
}

PLAIN: dict[str, tuple[Setup, Layouts]] = {
    # the setups of the front ends without an epoch-end validation of their own
    "seeded": LIGHTNING["seeded"],
    "agreed-accumulate3-droplast-workers2": (
        Setup(n=64, accumulation=3, drop_last=True, workers=2, shuffle="agreed"),
        ((2, (1, 3)), (1, (3,))),
    ),
}

FABRIC = {
    # fewer layouts (each process imports Lightning, or Ignite, for seconds): 2 -> 1, 2 -> 3, 1 -> 2, 3 -> 2
    "seeded": (PLAIN["seeded"][0], ((1, (2,)), (3, (2,)))),
    "agreed-accumulate3-droplast-workers2": (PLAIN["agreed-accumulate3-droplast-workers2"][0], ((2, (1, 3)),)),
}
MIXTURE: dict[str, tuple[Setup, Layouts]] = {
    # a shardplug.Mixture, resized from 3 to 2 processes (its first run on 3 is one more run of the front end), at
    # a step inside the epoch and at its end (the seeded setup meets every point)
    "mixture": (Setup(n=38, shuffle="mixture", points=("middle_step", "epoch_end")), ((2, (3,)),)),
}
LIGHTNING = {**LIGHTNING, **MIXTURE}
IGNITE = {**FABRIC, **MIXTURE}


Relay = tuple[int, str, int, tuple[int, ...]]
"""``(first run on N, its point, relayed on M, resumed on (K, ...))``: a first run's position resumed on M
processes (the relay, itself saved after every batch of its first epoch), and the relay's positions resumed
on each K (a second kill and resize after a first resized resume)."""

RELAYS: dict[str, Relay] = {
    # setup id: relay; each K is a layout the setup's matrix already resumes on (no process group more than the
    # relay's own: the relay's positions join the resumed runs)
    "seeded": (2, "last_step", 3, (1,)),  # from an epoch's last step, then inside the next epoch, onto fewer
    "agreed-accumulate3-droplast-workers2": (3, "first_step", 1, (2,)),  # onto more: no step left at the end
    "agreed-accumulate3-droplast-workers2-validation": (3, "first_step", 1, (2,)),
}
FEWER_RELAYS: dict[str, Relay] = {**RELAYS, "seeded": (2, "last_step", 1, (3,))}  # Fabric and Ignite: onto more


def run_script(front_end: str, out: Path, processes: int, jobs: list[dict[str, Any]], expect_killed: bool) -> None:
    """Run ``scripts/boundaries.py FRONT_END PROCESSES JOBS`` (it launches its own processes) in ``out``, in a
    session of its own; fail with its output. What it leaves running (DataLoader workers and fork servers of a
    killed run) is killed after."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    log = out / "output.log"
    with open(log, "w") as output:
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "boundaries.py"), front_end, str(processes), json.dumps(jobs)],
            cwd=out,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=300)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    wanted = -signal.SIGKILL if expect_killed else 0
    modes = [(job["mode"], Path(job["out"]).parent.name) for job in jobs]
    assert code == wanted, (
        f"{front_end} on {processes} {modes}: exit {code}, wanted {wanted}:\n{log.read_text()[-8000:]}"
    )


def first_rows(folder: Path, processes: int) -> list[list[Any]]:
    return [
        [json.loads(line) for line in (folder / f"first_rank{r}.jsonl").read_text().splitlines()]
        for r in range(processes)
    ]


@dataclass(frozen=True)
class Job:
    """One run of a scenario (``key``: ``("first", setup id, N)``, ``("relay", setup id)`` or ``("resume", setup
    id, M)``) on ``processes``, ``kills``: it ends in a SIGKILL, ``after``: the jobs whose positions it loads,
    ``spec``: what the scenario program is given (see ``scripts/boundaries.py``)."""

    key: tuple[Any, ...]
    processes: int
    kills: bool
    after: frozenset[tuple[Any, ...]]
    spec: dict[str, Any]


def programs(jobs: list[Job]) -> list[list[Job]]:
    """The jobs as runs of the scenario program, in order, with the fewest processes started in all: each run is
    one process group, its jobs of one number of processes in turn. A killing job ends its run, so a run holds
    one at most: every order of the killing jobs is tried, each other job (in the order of ``jobs``, which lists a
    job after those it loads) joining the first run of its number of processes after the jobs it loads, or a run
    of its own at the end."""
    best: list[list[Job]] = []
    for order in itertools.permutations([job for job in jobs if job.kills]):
        runs, sizes = [[job] for job in order], [job.processes for job in order]
        ran = {job.key: i for i, job in enumerate(order)}  # the run of each job placed
        for job in jobs:
            if not job.kills:
                start = max((ran[key] + (runs[ran[key]][-1].key == key) for key in job.after), default=0)
                i = next((i for i in range(start, len(runs)) if sizes[i] == job.processes), len(runs))
                if i == len(runs):
                    runs.append([])
                    sizes.append(job.processes)
                runs[i].insert(len(runs[i]) - (1 if runs[i] and runs[i][-1].kills else 0), job)
                ran[job.key] = i
        position = {job.key: (i, j) for i, run in enumerate(runs) for j, job in enumerate(run)}
        if all(position[key] < position[job.key] for job in jobs for key in job.after):
            if not best or _cost(runs) < _cost(best):
                best = runs
    assert best, f"no order runs every job after the jobs it loads: {[job.key for job in jobs]}"
    return best


def _cost(runs: list[list[Job]]) -> tuple[int, int]:
    """Processes started, runs."""
    return sum(run[0].processes for run in runs), len(runs)


def scenario_runs(
    front_end: str,
    setups: dict[str, tuple[Setup, Layouts]],
    factory: pytest.TempPathFactory,
    relays: dict[str, Relay] | None = None,
) -> dict[str, Any]:
    """Every setup's first runs (killed), relay and resumed runs of the scenario program in ``front_end``, by
    setup id: ``{"first": {N: rows per rank}, "resumed": {M: each rank's JSON}, "relay": rows per rank}``; the
    jobs of all setups share the program's runs (:func:`programs`)."""
    jobs: list[Job] = []
    roots: dict[str, Path] = {}
    for name, (setup, layouts) in setups.items():
        root = roots[name] = factory.mktemp(f"{front_end}-{name}")
        jobs += _jobs(name, setup, layouts, (relays or {}).get(name), root)
    for index, run in enumerate(programs(jobs)):
        out = factory.mktemp(f"{front_end}-run{index}")
        run_script(front_end, out, run[0].processes, [job.spec for job in run], expect_killed=run[-1].kills)
    runs: dict[str, Any] = {}
    for name, (_, layouts) in setups.items():
        root = roots[name]
        relay = (relays or {}).get(name)
        runs[name] = {
            "first": {n: first_rows(root / f"first{n}", n) for n in sorted({n for _, s in layouts for n in s})},
            "resumed": {
                m: [json.loads((root / f"resumed{m}" / f"resume_rank{r}.json").read_text()) for r in range(m)]
                for m, _ in layouts
            },
            "relay": None if relay is None else first_rows(root / f"relay{relay[2]}", relay[2]),
        }
    return runs


def _jobs(name: str, setup: Setup, layouts: Layouts, relay: Relay | None, root: Path) -> list[Job]:
    """The jobs of setup ``name``: its first runs, its relay and its resumed runs, each writing to a folder of
    ``root`` (``first<N>``, ``relay<M>``, ``resumed<M>``)."""

    def job(folder: str, processes: int, kills: bool, after: list[str], mode: str, *sources: str) -> Job:
        spec = {"setup": asdict(setup), "mode": mode, "out": str(root / folder), "sources": list(sources)}
        return Job((folder, name), processes, kills, frozenset((f, name) for f in after), spec)

    firsts = sorted({n for _, sources in layouts for n in sources})
    jobs = [job(f"first{n}", n, True, [], "first") for n in firsts]
    more: dict[int, list[str]] = {}
    if relay is not None:
        n, point, m, resumed_on = relay
        epoch = relay_epoch(point)
        jobs.append(
            job(f"relay{m}", m, epoch == 0, [f"first{n}"], "relay", f"{root / f'first{n}' / 'ckpt'}:{n}:{point}")
        )
        for k in resumed_on:
            points = ",".join(f"{p}={b}" for p, b in relay_points(setup, (n, point), m, k).items())
            more[k] = [f"{root / f'relay{m}' / 'ckpt'}:{m}:{epoch}:{points}"]
    for m, sources in layouts:
        after = [f"first{n}" for n in sources] + ([f"relay{relay[2]}"] if relay is not None and m in more else [])
        ckpts = [f"{root / f'first{n}' / 'ckpt'}:{n}" for n in sources] + more.get(m, [])
        jobs.append(job(f"resumed{m}", m, False, after, "resume", *ckpts))
    return jobs


def relay_cases(setups: dict[str, tuple[Setup, Layouts]], relays: dict[str, Relay], old: bool = False) -> list[Any]:
    """The parameters of every relay case of ``setups`` (``old``: also each position of a relay resumed from an
    epoch's last step with the epoch progress an older shardplug left there, ``<point>-old``: Lightning)."""
    cases = []
    for name, (n, point, m, resumed_on) in relays.items():
        if name in setups:
            for k in resumed_on:
                for p in relay_points(setups[name][0], (n, point), m, k):
                    for variant in (p, f"{p}-old") if old and relay_epoch(point) else (p,):
                        cases.append(pytest.param(name, k, variant, id=f"{name}-{n}to{m}to{k}-{variant}"))
    return cases


def check_relay(setup: Setup, runs: dict[str, Any], relay: Relay, after: int, point: str) -> None:
    """The oracle on the relay of ``setup`` saved at ``point`` and resumed on ``after`` processes."""
    n, first_point, m, _ = relay
    batch = relay_points(setup, (n, first_point), m, after)[point.removesuffix("-old")]
    first = [rows_until(rows, first_point, setup, n) for rows in runs["first"][n]]
    before, saved = relayed(runs["relay"], batch, first)
    ranks = runs["resumed"][after]
    run = [rank["resumed"][f"relay{m}:{point}"] for rank in ranks]
    fresh = [rank["fresh"] for rank in ranks]
    check_resumed(
        setup,
        point,
        before,
        [r["rows"] for r in run],
        [tuple(r["counters"]) for r in run],
        fresh=[f["rows"] for f in fresh],
        factor=fresh_factor(fresh[0]),
        relayed=saved,
    )


def cases(setups: dict[str, tuple[Setup, Layouts]]) -> list[Any]:
    """The parameters of every case of ``setups``."""
    cases = []
    for name, (setup, layouts) in setups.items():
        for m, sources in layouts:
            for n in sources:
                for point in setup.saved_points():
                    cases.append(pytest.param(name, n, m, point, id=f"{name}-{n}to{m}-{point}"))
    return cases


def check(setup: Setup, runs: dict[str, Any], before: int, after: int, point: str) -> None:
    """The oracle on the run of ``setup`` saved at ``point`` on ``before`` processes and resumed on ``after``."""
    first = runs["first"][before]
    ranks = runs["resumed"][after]
    run = [rank["resumed"][f"{before}:{point}"] for rank in ranks]
    fresh = [rank["fresh"] for rank in ranks]
    check_resumed(
        setup,
        point,
        [rows_until(rows, point, setup, before) for rows in first],
        [r["rows"] for r in run],
        [tuple(r["counters"]) for r in run],
        fresh=[f["rows"] for f in fresh],
        factor=fresh_factor(fresh[0]),
        saved_factor=first_factor(first),
    )


def fresh_factor(fresh: dict[str, Any]) -> int:
    """Scheduler steps per optimizer step in an uninterrupted run."""
    steps, scheduled = fresh["counters"]
    assert steps and scheduled % steps == 0, fresh["counters"]
    return scheduled // steps


def first_factor(first: list[list[Any]]) -> int:
    """Scheduler steps per optimizer step in a first run (from its rows: it never ended)."""
    factors = {row[5] // row[4] for rows in first for row in rows if row[4]}
    assert len(factors) == 1 and all(row[5] == row[4] * min(factors) for rows in first for row in rows), factors
    return factors.pop()
