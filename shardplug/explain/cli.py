"""The ``shardplug`` command (also ``python -m shardplug``): ``shardplug explain`` shows what each
process gets with a set of options, computed by the planner ``prepare_data_loader`` uses, without
launching anything.

Example::

    $ python -m shardplug explain --samples 21 --batch-size 3 --processes 2
    $ python -m shardplug explain --samples 21 --batch-size 3 --processes 2 --resume-at 2 --processes-after 3
    $ python -m shardplug explain --samples 21 --batch-size 3 --processes 2 --format svg shares.svg

Bad input is an error naming the option and its value, with exit status 2 (as argparse does).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from .picture import ExplainError, ExplainOptions, explain
from .text import render_text

__all__ = ["main", "parser"]

FORMATS = ("text", "svg", "png")


def _count(minimum: int) -> type[int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is invalid: it must be an integer >= {minimum}")
        return value

    parse.__name__ = "integer"
    return parse  # type: ignore[return-value]


def _source(text: str) -> tuple[str, int, float]:
    """``NAME=LENGTH:WEIGHT`` of ``--mixture``."""
    name, _, rest = text.partition("=")
    length, _, weight = rest.partition(":")
    try:
        parsed = (name, int(length), float(weight))
    except ValueError:
        parsed = ("", 0, -1.0)
    if not name or not name.isalpha() or parsed[1] < 1 or parsed[2] < 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid: write NAME=LENGTH:WEIGHT (letters, an integer >= 1, a number >= 0), e.g. web=10:0.5"
        )
    return parsed


def parser() -> argparse.ArgumentParser:
    """The command's parser (``shardplug explain --help`` documents every option)."""
    return _parsers()[0]


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """(the command's parser, the ``explain`` subcommand's)."""
    top = argparse.ArgumentParser(prog="shardplug", description="shardplug's command line tools.")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub = commands.add_parser(
        "explain",
        help="show what each process gets with a set of options, without launching anything",
        description=(
            "Show what each process of a job gets from prepare_data_loader(DataLoader(range(SAMPLES), "
            "batch_size=BATCH_SIZE, ...)): its batches with the padding marked (*), len(), the steps every "
            "process runs, what is dropped and, with --resume-at, what each process of the resumed run gets "
            "for the rest of the epoch. The answer comes from the planner prepare_data_loader uses, on "
            "simulated processes (num_processes=N, process_index=i): nothing is launched."
        ),
    )
    sub.add_argument("--samples", type=_count(0), required=True, metavar="N", help="the dataset's length (range(N))")
    sub.add_argument("--batch-size", type=_count(1), required=True, metavar="B", help="the DataLoader's batch_size")
    sub.add_argument("--processes", type=_count(1), default=1, metavar="N", help="processes of the job (default: 1)")
    sub.add_argument(
        "--split-batches",
        action="store_true",
        help="split_batches=True: each batch of B is cut in N slices (B must be a multiple of N)",
    )
    sub.add_argument(
        "--no-even-batches",
        dest="even_batches",
        action="store_false",
        help="even_batches=False: no padding, the leftovers go to the first processes",
    )
    sub.add_argument("--drop-last", action="store_true", help="DataLoader(drop_last=True): short steps are dropped")
    sub.add_argument("--shuffle", action="store_true", help="DataLoader(shuffle=True), with data_seed=--seed")
    sub.add_argument(
        "--seed", type=_count(0), metavar="S", help="the shuffle's data_seed= (with --shuffle; default: 0)"
    )
    sub.add_argument(
        "--mixture",
        nargs="+",
        type=_source,
        default=(),
        metavar="NAME=LENGTH:WEIGHT",
        help="read a shardplug.Mixture of sources range(LENGTH) weighted WEIGHT (seeded by --seed, --samples "
        "positions an epoch) instead of range(SAMPLES); each row shows <source><sample>",
    )
    sub.add_argument(
        "--dispatch", action="store_true", help="dispatch_batches=True: process 0 reads, each process receives its rows"
    )
    sub.add_argument("--epochs", type=_count(1), default=1, metavar="E", help="epochs to show (default: 1)")
    sub.add_argument(
        "--resume-at",
        type=_count(0),
        metavar="STEP",
        help="also show a resume from the position saved after STEP steps of epoch 0 (loader.state_dict())",
    )
    sub.add_argument(
        "--processes-after",
        type=_count(1),
        metavar="M",
        help="processes of the resumed run (with --resume-at; default: --processes)",
    )
    sub.add_argument(
        "--format",
        nargs="+",
        default=["text"],
        metavar=("FORMAT", "PATH"),
        help="text (the default) prints; svg PATH or png PATH also draws the figure to PATH "
        "(needs matplotlib: pip install shardplug[plot])",
    )
    return top, sub


def _figure_target(args: argparse.Namespace, sub: argparse.ArgumentParser) -> tuple[str, str] | None:
    form, *rest = args.format
    if form not in FORMATS:
        sub.error(f"argument --format: {form!r} is invalid: choose from {', '.join(FORMATS)}")
    if form == "text":
        if rest:
            sub.error(f"argument --format: text takes no PATH, got {' '.join(rest)!r} (svg PATH or png PATH draw)")
        return None
    if len(rest) != 1:
        sub.error(
            f"argument --format: {form} needs one PATH to write the figure to, e.g. --format {form} shares.{form}"
        )
    return form, rest[0]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    top, sub = _parsers()
    args = top.parse_args(argv)
    target = _figure_target(args, sub)
    try:
        values = {field.name: getattr(args, field.name) for field in dataclasses.fields(ExplainOptions)}
        options = ExplainOptions(**{**values, "mixture": tuple(values["mixture"])})
        picture = explain(options)
    except ExplainError as exc:
        sub.error(str(exc))
    sys.stdout.write(render_text(picture) + "\n")
    if target is not None:
        from .figure import MissingExtra, save_figure

        form, path = target
        try:
            save_figure(picture, path, form)
        except MissingExtra as exc:
            sys.stderr.write(f"shardplug explain: error: {exc}\n")
            return 1
        sys.stdout.write(f"figure: {path}\n")
    return 0
