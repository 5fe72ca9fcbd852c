"""Runs many example programs fast: imports the heavy modules once, then forks one child per program
(one per process of a program launched as ``torchrun --nproc_per_node N``).

    python tests/_docs_runner.py JOBS.json RESULTS.json

``JOBS.json`` holds ``{"workers": W, "timeout": S, "preload": [module, ...], "jobs": [{"name", "script",
"cwd", "stdout", "stderr"}, ...]}``. Each child changes into ``cwd``, sends its output to the two files
and runs ``script`` as ``__main__`` (fresh globals, ``sys.argv = [script]``), as ``python script``
would; its exit status is 0, the ``SystemExit`` code, 1 after an uncaught exception (traceback on
stderr), or -SIGALRM after ``timeout`` seconds. ``RESULTS.json`` maps each name to its status. Used by
``tests/docs/test_docs_examples.py``; forking saves each program the seconds of importing torch,
Lightning and Ignite.

A job with ``"ranks": N`` is run as torchrun runs it: N children, each with the variables torchrun
gives its process ``RANK`` (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``
of a port free for the job, ...), the output of process ``RANK`` in ``stdout.RANK`` and ``stderr.RANK``;
when one of them fails the others are stopped, and the job's status is the first failure's.  A job's
``"processes"`` (default: its ranks, else 1) is how many processes it runs at once: at most ``W`` run
together; a job that starts several of its own is given a free ``MASTER_PORT``.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys

from _dist import free_port  # this directory: the shared test helpers


def child(job: dict, timeout: int, suffix: str = "") -> int:
    signal.alarm(timeout)
    os.chdir(job["cwd"])
    for fd, path in ((1, job["stdout"] + suffix), (2, job["stderr"] + suffix)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [job["script"]]
    sys.path[0] = os.path.dirname(job["script"])
    import runpy
    import traceback

    code = 0
    try:
        runpy.run_path(job["script"], run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported like the interpreter does
        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def torchrun_variables(rank: int, ranks: int, port: int) -> dict[str, str]:
    """What ``torchrun --standalone --nproc_per_node RANKS`` sets for its process ``rank``."""
    return {
        **dict.fromkeys(("RANK", "LOCAL_RANK", "ROLE_RANK"), str(rank)),
        **dict.fromkeys(("WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE"), str(ranks)),
        **{"GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default"},
        **{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
    }


def main(jobs_path: str, results_path: str) -> None:
    spec = json.loads(open(jobs_path, encoding="utf-8").read())
    for module in spec["preload"]:
        importlib.import_module(module)
    running: dict[int, str] = {}  # pid: its job's name
    weight: dict[int, int] = {}  # pid: the processes it counts for
    results: dict[str, int] = {}

    def reap() -> None:
        pid, status = os.wait()
        name, code = running.pop(pid), os.waitstatus_to_exitcode(status)
        weight.pop(pid)
        if results.get(name, 0) == 0:
            results[name] = code
        if code != 0:  # as torchrun does: one process failed, the job's others are stopped
            for other in [p for p, job in running.items() if job == name]:
                os.kill(other, signal.SIGKILL)

    for job in spec["jobs"]:
        ranks = job.get("ranks")
        processes = job.get("processes", ranks or 1)
        while running and sum(weight.values()) + processes > spec["workers"]:
            reap()
        # a port for the job's group: torchrun's, or one for a block that starts its own processes (Ignite's Parallel
        # takes MASTER_PORT, else 2222 for every job: two blocks at once, or another test's group, would meet there)
        port = free_port() if processes > 1 else 0
        for rank in range(ranks or 1):
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                if ranks:
                    os.environ.update(torchrun_variables(rank, ranks, port))
                elif port:
                    os.environ["MASTER_PORT"] = str(port)
                child(job, spec["timeout"], f".{rank}" if ranks else "")
            running[pid] = job["name"]
            weight[pid] = 1 if ranks else processes
    while running:
        reap()
    with open(results_path, "w", encoding="utf-8") as out:
        json.dump(results, out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
