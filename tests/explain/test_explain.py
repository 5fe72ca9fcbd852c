"""``shardplug explain`` shows what real prepared loaders yield: for a grid of options on 1-4
simulated processes (``num_processes=N, process_index=i``), every process's batches, their
padding, ``len()``, what is dropped, and the rest of an epoch resumed on another number of
processes; bad input is exit status 2 with the option named; the figures in docs/figures/ are what
the commands next to them in the docs make. (Dispatch is compared with real dispatchers on gloo
in tests/dispatch/test_dispatch_batches.py.)"""

from __future__ import annotations

import importlib.util
import itertools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

import shardplug
from shardplug.explain import ExplainOptions, explain, render_text
from shardplug.explain.cli import main

ROOT = Path(__file__).resolve().parents[2]
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _loader(o: ExplainOptions, processes: int, rank: int) -> shardplug.PreparedDataLoader:
    loader = shardplug.prepare_data_loader(
        DataLoader(range(o.samples), batch_size=o.batch_size, shuffle=o.shuffle, drop_last=o.drop_last),
        num_processes=processes,
        process_index=rank,
        split_batches=o.split_batches,
        even_batches=o.even_batches,
        data_seed=o.seed if o.shuffle else None,
        put_on_device=False,
    )
    loader.track_padding()
    return loader


def _yielded(loader: shardplug.PreparedDataLoader) -> tuple[int, list[tuple[tuple[int, ...], int]]]:
    """(len() before the pass, every batch's indices and real count) of one pass of a real loader."""
    length = len(loader)
    batches = []
    for batch in loader:
        assert batch.tolist() == loader.batch_indices
        batches.append((tuple(batch.tolist()), loader.batch_real_count))
    return length, batches


def _shown(share) -> tuple[int, list[tuple[tuple[int, ...], int]]]:
    return share.length, [(batch.indices, batch.real) for batch in share.batches]


def _check_dropped(view, samples: int, real: set[int]) -> None:
    assert set(view.dropped) == set(range(samples)) - real
    assert not set(view.dropped) & real


def _id(o: ExplainOptions) -> str:
    flags = "".join(c for c, on in (("s", o.split_batches), ("u", not o.even_batches), ("d", o.drop_last)) if on)
    return f"{o.samples}-{o.batch_size}-{o.processes}{flags}{'-shuffle' if o.shuffle else ''}"


GRID = [
    ExplainOptions(n, b, p, split, even, drop, shuffle, 5 if shuffle else None, epochs=2 if shuffle else 1)
    for n, b, p, split, even, drop, shuffle in itertools.product(
        (7, 21, 22), (3, 4), (1, 2, 3, 4), (False, True), (True, False), (False, True), (False, True)
    )
    if not (split and b % p)
]


@pytest.mark.parametrize("o", GRID, ids=_id)
def test_explain_shows_what_real_loaders_yield(o):
    picture = explain(o)
    for view in picture.epochs:
        real: set[int] = set()
        for rank, share in enumerate(view.shares):
            loader = _loader(o, o.processes, rank)
            loader.set_epoch(view.epoch)
            yielded = _yielded(loader)
            assert _shown(share) == yielded, (view.epoch, rank)
            real |= {i for batch, count in yielded[1] for i in batch[:count]}
        assert view.steps == max(len(_loader(o, o.processes, r)) for r in range(o.processes))
        _check_dropped(view, o.samples, real)
    text = render_text(picture)
    assert f"process {o.processes - 1}" in text and f"len()={picture.epochs[0].shares[0].length}" in text


RESUMES = [
    ExplainOptions(21, 3, 2, resume_at=2, processes_after=3),
    ExplainOptions(24, 2, 2, resume_at=2, processes_after=3),  # docs/resume.md's example
    ExplainOptions(22, 3, 3, even_batches=False, resume_at=1, processes_after=2),
    ExplainOptions(22, 4, 2, split_batches=True, drop_last=True, resume_at=3, processes_after=4),
    ExplainOptions(21, 3, 4, shuffle=True, seed=7, resume_at=1, processes_after=1),
    ExplainOptions(21, 3, 2, resume_at=4, processes_after=3),  # the epoch's end: nothing is left
    ExplainOptions(21, 3, 2, resume_at=0),
]


@pytest.mark.parametrize("o", RESUMES, ids=_id)
def test_a_resume_shows_what_loaders_that_load_the_position_yield(o):
    picture = explain(o)
    resume = picture.resume
    saving = _loader(o, o.processes, 0)
    batches = iter(saving)
    for _ in range(o.resume_at):
        next(batches)
    position = saving.state_dict()
    real = {i for share in picture.epochs[0].shares for i in share.real_samples(o.resume_at)}
    assert resume.consumed == position["consumed"] and resume.processes == o.after
    for rank, share in enumerate(resume.rest.shares):
        loader = _loader(o, o.after, rank)
        loader.load_state_dict(position)
        yielded = _yielded(loader)
        assert _shown(share) == yielded, rank
        real |= {i for batch, count in yielded[1] for i in batch[:count]}
        assert len(loader) == resume.next_epoch_length  # the next pass: a whole epoch on M processes
    _check_dropped(resume.rest, o.samples, real)


def test_the_text_marks_padding_and_names_what_is_dropped():
    text = render_text(explain(ExplainOptions(21, 3, 2)))
    assert "process 1  len()=4  [3 4 5] [9 10 11] [15 16 17] [0* 1* 2*]" in text
    assert "padding: 3 samples  dropped: none" in text
    assert "dropped: 18 19 20" in render_text(explain(ExplainOptions(21, 3, 2, drop_last=True)))


def test_the_command_prints_the_picture(capsys):
    assert main(["explain", "--samples", "21", "--batch-size", "3", "--processes", "2"]) == 0
    assert capsys.readouterr().out == render_text(explain(ExplainOptions(21, 3, 2))) + "\n"


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--batch-size", "0"], "--batch-size: 0 is invalid"),
        (["--processes", "0"], "--processes: 0 is invalid"),
        (["--batch-size", "x"], "--batch-size: 'x' is not an integer"),
        (["--split-batches"], "split_batches=True needs a batch size that is a multiple of num_processes"),
        (["--resume-at", "5"], "--resume-at 5 is past the end of the epoch"),
        (["--processes-after", "3"], "--processes-after 3 needs --resume-at"),
        (["--seed", "3"], "--seed 3 needs --shuffle"),
        (["--mixture", "web=10"], "'web=10' is invalid: write NAME=LENGTH:WEIGHT"),
        (["--mixture", "web=10:-1"], "'web=10:-1' is invalid"),
        (["--mixture", "web=10:0"], "weights={'web': 0.0} are all zero"),
        (["--mixture", "web=10:1", "--shuffle"], "--shuffle with --mixture"),
        (["--format", "svg"], "svg needs one PATH"),
        (["--format", "pdf", "x.pdf"], "'pdf' is invalid"),
        (["--split-batches", "--batch-size", "4", "--resume-at", "1", "--processes-after", "3"], "num_processes=3"),
    ],
)
def test_bad_input_is_exit_status_2_naming_the_option(argv, names, capsys):
    with pytest.raises(SystemExit) as exit_:  # an option given twice: the last one counts
        main(["explain", "--samples", "21", "--batch-size", "3", "--processes", "2", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert names in err and "usage: shardplug explain" in err


def test_help_documents_every_option():
    result = subprocess.run(
        [sys.executable, "-m", "shardplug", "explain", "--help"], capture_output=True, text=True, check=True
    )
    for option in (
        "--samples", "--batch-size", "--processes", "--split-batches", "--no-even-batches", "--drop-last",
        "--shuffle", "--seed", "--dispatch", "--epochs", "--resume-at", "--processes-after", "--format", "--mixture",
    ):  # fmt: skip
        assert option in result.stdout


def test_a_figure_without_matplotlib_names_the_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    argv = ["explain", "--samples", "5", "--batch-size", "2", "--format", "svg", str(tmp_path / "f.svg")]
    assert main(argv) == 1
    assert "pip install 'shardplug[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "f.svg").exists()


FIGURE_COMMAND = re.compile(r"`python -m shardplug explain ([^`\n]*--format svg (docs/figures/[\w.-]+\.svg))`")
PAGES = ("docs/sharding.md", "docs/resume.md")


def _documented_figures() -> list[tuple[str, str]]:
    return [found for page in PAGES for found in FIGURE_COMMAND.findall((ROOT / page).read_text())]


@pytest.mark.parametrize("page", PAGES)
def test_the_docs_show_figures_made_by_the_command(page):
    text = (ROOT / page).read_text()
    figures = FIGURE_COMMAND.findall(text)
    assert figures, f"{page} shows no figure made by shardplug explain"
    for _, path in figures:
        assert (ROOT / path).is_file(), path
        assert f"]({Path(path).relative_to('docs').as_posix()})" in text, f"{page} does not embed {path}"


def test_the_output_shown_in_the_docs_is_the_commands(capsys):
    shown = re.findall(
        r"```bash\npython -m shardplug explain ([^\n]*)\n```\n\n```text\n(.*?)```", (ROOT / PAGES[0]).read_text(), re.S
    )
    assert shown
    for command, output in shown:
        assert main(["explain", *shlex.split(command)]) == 0
        assert capsys.readouterr().out == output


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="figures need matplotlib (pip install 'shardplug[plot]')")
@pytest.mark.parametrize("command, path", _documented_figures(), ids=lambda v: Path(v).name if "/" in v else "")
def test_regenerating_a_figure_gives_the_same_file(command, path, tmp_path, capsys):
    argv = shlex.split(command)
    argv[-1] = str(tmp_path / "figure.svg")
    assert main(["explain", *argv]) == 0
    assert (tmp_path / "figure.svg").read_bytes() == (ROOT / path).read_bytes(), (
        f"{path} is not what `python -m shardplug explain {command}` makes: run it (from the repository root) to "
        "remake the figure"
    )


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="figures need matplotlib (pip install 'shardplug[plot]')")
def test_png_figures_are_written_too(tmp_path, capsys):
    path = tmp_path / "shares.png"
    assert (
        main(["explain", "--samples", "7", "--batch-size", "3", "--processes", "2", "--format", "png", str(path)]) == 0
    )
    assert path.read_bytes().startswith(b"\x89PNG") and f"figure: {path}" in capsys.readouterr().out


MIXTURE = (("web", 10, 0.5), ("code", 6, 0.3), ("math", 2, 0.2))


@pytest.mark.parametrize("processes, split", [(2, False), (3, True), (4, False)])
def test_a_mixtures_split_is_what_real_loaders_over_it_yield(processes: int, split: bool) -> None:
    o = ExplainOptions(20, 6, processes, split_batches=split, epochs=2, seed=1, mixture=MIXTURE)
    picture = explain(o)
    mixture = shardplug.Mixture(
        {name: range(n) for name, n, _ in MIXTURE}, {name: w for name, _, w in MIXTURE}, seed=1, samples_per_epoch=20
    )
    for view in picture.epochs:
        for rank, share in enumerate(view.shares):
            loader = shardplug.prepare_data_loader(
                DataLoader(mixture, batch_size=6), num_processes=processes, process_index=rank, split_batches=split
            )
            loader.track_padding()
            loader.set_epoch(view.epoch)
            shown = [(batch.indices, batch.real, batch.labels) for batch in share.batches]
            real = []
            for batch in loader:
                labels = tuple(f"{s}{i}" for s, i in zip(loader.batch_sources, batch.tolist()))
                real.append((tuple(loader.batch_indices), loader.batch_real_count, labels))
            assert shown == real
    text = render_text(picture)
    assert "a Mixture of web (10 samples, weight 0.5)" in text
    assert "  sources: code 6 (30%), math 4 (20%), web 10 (50%)" in text


def test_the_command_shows_a_mixture_resumed_on_another_number_of_processes(capsys):
    argv = ["--samples", "20", "--batch-size", "4", "--processes", "2", "--seed", "1", "--resume-at", "1"]
    argv += ["--processes-after", "3", "--mixture", "web=10:0.5", "code=6:0.3", "math=2:0.2"]
    assert main(["explain", *argv]) == 0
    out = capsys.readouterr().out
    first = re.search(r"process 0  len\(\)=3  \[[^]]*\] (\[[^]]*\])", out).group(1)
    resumed = re.search(r"on 3 processes: .*\n  process 0  len\(\)=1  (\[[^]]*\])", out).group(1)
    assert first == resumed, "the next global batch, whatever the number of processes"
