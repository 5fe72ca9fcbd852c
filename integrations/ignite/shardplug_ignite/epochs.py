"""Keeping a prepared loader's epochs, and its resume position, in step with an Ignite engine.

Example::

    sync = EpochSync()
    sync.attach(trainer)
    trainer.run(prepared_loader, max_epochs=3)   # a new shuffle every epoch, the same on every rank
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, cast

import ignite.distributed as idist
import torch
from ignite.base.mixins import Serializable
from ignite.engine import Engine, Events

from shardplug.core.loader.prepared import PreparedDataLoader

from .compat import requires_state_keys

__all__ = ["EpochSync", "current_loader"]

logger = logging.getLogger(__name__)


def current_loader(engine: Engine) -> PreparedDataLoader:
    """The prepared loader ``engine`` runs on (a ``TypeError`` with the fix otherwise)."""
    loader = engine.state.dataloader
    if not isinstance(loader, PreparedDataLoader):
        raise TypeError(
            f"the trainer runs on a {type(loader).__name__}, not a prepared loader: pass "
            "handler.prepare_data_loader(DataLoader(...)) (or handler.auto_dataloader(...)) to trainer.run"
        )
    return loader


@requires_state_keys("loader")
class EpochSync(Serializable):
    """Sets the loader's epoch at the engine's epoch events, and resumes it from a checkpoint.

    Ignite never calls ``set_epoch``; this does, at the events where the next pass is opened:

    ============================= ==============================================================
    ``STARTED``                   the data is a prepared loader; a loaded position is applied (with
                                  the same or another number of processes) and the engine's
                                  ``epoch_length`` / ``iteration`` / ``epoch`` set to match it; every
                                  rank has the same epoch length (else ``RuntimeError``, not a hang)
    ``EPOCH_STARTED``             ``loader.set_epoch(epoch - 1)`` (not in a resumed epoch), and the
                                  engine's ``epoch_length`` the new epoch's where it was the loader's
                                  (a batch sampler's epochs may differ in length)
    ``DATALOADER_STOP_ITERATION`` ``set_epoch(epoch - 1)`` again: the previous pass ended only now
    ``TERMINATE_SINGLE_EPOCH``    ``set_epoch(epoch)``: Ignite opens the next pass right away
    ``EPOCH_COMPLETED``           ``loader.end_finished_pass()``: Ignite stops a pass at ``epoch_length``
                                  without asking for more; ``len(loader)`` is then the next pass's
                                  (a whole epoch after a resumed one), also in an ``EPOCH_STARTED``
                                  handler that runs before this one's ``set_epoch``
    ============================= ==============================================================

    Its state (:meth:`state_dict`) is the loader's full position (``loader.state_dict()``).
    """

    def __init__(self) -> None:
        self.loader: PreparedDataLoader | None = None
        self._pending: dict[str, Any] | None = None
        self._resumed_epoch = False
        self._ran = False  # iterations ran on this engine in this process: a new run() continues them
        self._followed: int | None = None  # the engine's epoch_length where it is the loader's epoch's

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.STARTED, self._on_started)
        engine.add_event_handler(Events.EPOCH_STARTED, self._on_epoch_started)
        engine.add_event_handler(Events.DATALOADER_STOP_ITERATION, self._on_stop_iteration)
        engine.add_event_handler(Events.TERMINATE_SINGLE_EPOCH, self._on_terminate_single_epoch)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._on_iteration_completed)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self._on_epoch_completed)

    # -- events ------------------------------------------------------------------------------
    def _on_started(self, engine: Engine) -> None:
        loader = current_loader(engine)
        self.loader = loader
        full = loader.epoch_length  # a whole epoch on this layout (a position shortens only the pass)
        pending, self._pending = self._pending, None
        self._resumed_epoch = pending is not None
        if pending is not None:
            loader.load_state_dict(pending)  # validated; another number of processes is the core's business
            self._align_engine(engine, loader, full)
        elif engine.state.epoch_length and engine.state.iteration % engine.state.epoch_length and not self._ran:
            raise RuntimeError(
                f"the trainer resumes at iteration {engine.state.iteration}, inside an epoch of "
                f"{engine.state.epoch_length}, but no shardplug position was loaded: the epoch would start again "
                "from its first batch (samples repeated, others never seen). Put the ShardplugHandler in the "
                "Checkpoint's to_save next to the trainer, or resume from a checkpoint saved at an epoch end"
            )
        self._check_epoch_length(engine, full)
        self._followed = full if engine.state.epoch_length == full else None

    def _align_engine(self, engine: Engine, loader: PreparedDataLoader, full: int | None) -> None:
        """Make the engine's counters describe the loaded position on this layout."""
        if full is None:
            return  # a stream without len(): Ignite finds the epoch's end itself
        position = loader.resume.position()
        done = loader.resume.resumed_batches
        state = engine.state
        iteration = position.epoch * full + done
        if (state.epoch_length, state.iteration) != (full, iteration):
            logger.info(
                "resumed position: epoch %d, %d of %d batches on this layout (the checkpoint's engine had "
                "epoch_length=%s, iteration=%s)",
                position.epoch + 1,
                done,
                full,
                state.epoch_length,
                state.iteration,
            )
        state.epoch_length = full
        state.iteration = iteration
        state.epoch = position.epoch

    def _check_epoch_length(self, engine: Engine, length: int | None) -> None:
        length = -1 if length is None else length
        epoch_length = engine.state.epoch_length if engine.state.epoch_length is not None else -1
        mine = torch.tensor([length, epoch_length], dtype=torch.int64, device=idist.device())
        gathered = cast(torch.Tensor, idist.all_gather(mine)) if idist.get_world_size() > 1 else mine
        per_rank = gathered.view(-1, 2).tolist()
        lengths = [row[0] for row in per_rank]
        epoch_lengths = [row[1] for row in per_rank]
        if len(set(lengths)) > 1 or len(set(epoch_lengths)) > 1:
            raise RuntimeError(
                f"ranks disagree on the epoch length: batches per rank {lengths}, engine epoch_length per rank "
                f"{epoch_lengths}. Every rank must run the same number of iterations, or collectives hang. "
                "Use even_batches=True (the default) or drop_last=True for training loaders, and the same "
                "epoch_length on every rank."
            )
        if length >= 0 and epoch_length >= 0 and length != epoch_length:
            logger.warning(
                "engine epoch_length=%d differs from the loader's %d batches per epoch: epochs then do not "
                "match passes over the data and set_epoch follows the engine's epochs",
                epoch_length,
                length,
            )

    def _on_epoch_started(self, engine: Engine) -> None:
        if self._resumed_epoch:
            self._resumed_epoch = False  # the loaded position already chose this epoch and its start
            return
        loader = current_loader(engine)
        loader.set_epoch(engine.state.epoch - 1)
        length = loader.epoch_length
        if self._followed is not None and engine.state.epoch_length == self._followed and length is not None:
            # epochs may differ in length: Ignite would end a longer one early (its last batches read in the
            # next epoch, or never) and a shorter one by restarting the data (a user's own epoch_length is kept)
            engine.state.epoch_length = self._followed = length

    def _on_stop_iteration(self, engine: Engine) -> None:
        # the previous pass only ended now, inside this epoch: make sure the next pass is this epoch's
        current_loader(engine).set_epoch(engine.state.epoch - 1)

    def _on_terminate_single_epoch(self, engine: Engine, iter_counter: int = 0) -> None:
        # Ignite opens the next pass right away, before the next EPOCH_STARTED
        current_loader(engine).set_epoch(engine.state.epoch)

    def _on_iteration_completed(self, engine: Engine) -> None:
        self._ran = True

    def _on_epoch_completed(self, engine: Engine) -> None:
        current_loader(engine).end_finished_pass()  # the core decides: only a pass whose last batch was handed out

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> OrderedDict[str, Any]:
        """``{"loader": the loader's state_dict()}`` (``None`` before a loader is known)."""
        return OrderedDict(loader=None if self.loader is None else self.loader.state_dict())

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Keep a :meth:`state_dict`; the loader loads (and validates) it when the next run starts."""
        super().load_state_dict(state_dict)
        loader_state = state_dict["loader"]
        if loader_state is not None and not isinstance(loader_state, Mapping):
            raise ValueError(f"loader={loader_state!r} is not a loader state (loader.state_dict())")
        self._pending = None if loader_state is None else dict(loader_state)
