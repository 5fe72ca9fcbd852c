"""Runs many example programs fast: imports the heavy modules once, then forks one child per program.

    python tests/_docs_runner.py JOBS.json RESULTS.json

``JOBS.json`` holds ``{"workers": W, "timeout": S, "preload": [module, ...], "jobs": [{"name", "script",
"cwd", "stdout", "stderr"}, ...]}``. Each child changes into ``cwd``, sends its output to the two files
and runs ``script`` as ``__main__`` (fresh globals, ``sys.argv = [script]``), as ``python script``
would; its exit status is 0, the ``SystemExit`` code, 1 after an uncaught exception (traceback on
stderr), or -SIGALRM after ``timeout`` seconds. ``RESULTS.json`` maps each name to its status. Used by
``tests/docs/test_docs_examples.py``; forking saves each program the seconds of importing torch,
Lightning and Ignite.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys


def child(job: dict, timeout: int) -> int:
    signal.alarm(timeout)
    os.chdir(job["cwd"])
    for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
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


def main(jobs_path: str, results_path: str) -> None:
    spec = json.loads(open(jobs_path, encoding="utf-8").read())
    for module in spec["preload"]:
        importlib.import_module(module)
    running: dict[int, str] = {}
    results: dict[str, int] = {}

    def reap() -> None:
        pid, status = os.wait()
        results[running.pop(pid)] = os.waitstatus_to_exitcode(status)

    for job in spec["jobs"]:
        while len(running) >= spec["workers"]:
            reap()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            child(job, spec["timeout"])
        running[pid] = job["name"]
    while running:
        reap()
    with open(results_path, "w", encoding="utf-8") as out:
        json.dump(results, out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
