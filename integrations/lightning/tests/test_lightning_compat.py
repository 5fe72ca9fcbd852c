"""Every private name listed in shardplug_lightning.compat still exists in Lightning (real objects).

Fails when a Lightning release drops or renames one; shardplug_lightning/compat.py says what each
is used for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader

from shardplug_lightning import compat

NAMESPACES = ["lightning.pytorch"] + (["pytorch_lightning"] if importlib.util.find_spec("pytorch_lightning") else [])


def _trainer(namespace: str, **kwargs: Any) -> Any:
    pl = importlib.import_module(namespace)
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _module(namespace: str, dotted: str) -> Any:
    return importlib.import_module(f"{namespace}.{dotted}")


def _check_connector(namespace: str) -> None:
    for users in (True, False):  # Trainer(use_distributed_sampler=...): still known after the switch is off
        trainer = _trainer(namespace, use_distributed_sampler=users)
        assert trainer._accelerator_connector.use_distributed_sampler is users
        assert compat.user_distributed_sampler(trainer) is users
        assert compat.turn_off_distributed_sampler(trainer) is users
        assert trainer._accelerator_connector.use_distributed_sampler is False
        assert compat.turn_off_distributed_sampler(trainer) is users  # called again: still the user's
        assert compat.user_distributed_sampler(trainer) is users


def _check_wrapper(namespace: str) -> None:
    cls = compat.index_batch_sampler_wrapper(namespace)
    inner, other = BatchSampler(range(4), 2, False), BatchSampler(range(6), 3, False)
    wrapper = cls(inner)
    assert compat.wrapped_batch_sampler(wrapper) is inner and compat.inner_batch_sampler(wrapper) is inner
    compat.set_wrapped_batch_sampler(wrapper, other)
    assert [list(b) for b in wrapper] == [[0, 1, 2], [3, 4, 5]] == wrapper.seen_batch_indices


class _StatefulLoader(DataLoader):
    loaded: Any = None

    def state_dict(self) -> dict[str, int]:
        return {"n": 0}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.loaded = state


def _check_late_states(namespace: str) -> None:
    fit_loop = _trainer(namespace).fit_loop
    assert fit_loop._combined_loader_states_to_load == [] and compat.combined_loader(fit_loop) is None
    assert compat.apply_late_loader_states(fit_loop) == 0
    loader = _StatefulLoader(range(4))
    combined = _module(namespace, "utilities.combined_loader").CombinedLoader([loader], mode="max_size_cycle")
    fit_loop._combined_loader, fit_loop._combined_loader_states_to_load = combined, [{"n": 2}]
    assert compat.apply_late_loader_states(fit_loop) == 1
    assert loader.loaded == {"n": 2} and fit_loop._combined_loader_states_to_load == []


def _check_progress(namespace: str) -> None:
    progress = compat.batch_progress(_trainer(namespace).fit_loop)
    for tracker in (progress.current, progress.total):
        assert all(isinstance(getattr(tracker, name), int) for name in ("ready", "started", "processed", "completed"))


def _check_epoch_length(namespace: str) -> None:
    trainer = _trainer(namespace)
    fit_loop = trainer.fit_loop
    assert hasattr(fit_loop, "max_batches") and hasattr(fit_loop, "_data_fetcher")
    assert trainer._val_check_time_interval is None and hasattr(trainer, "val_check_batch")
    fetcher = _module(namespace, "loops.fetchers")._PrefetchDataFetcher()
    assert "length" in vars(fetcher)
    fetcher.length = 10
    fit_loop._data_fetcher = fetcher
    compat.set_epoch_length(trainer, fit_loop, 3)
    assert fit_loop.max_batches == 3 and fetcher.length == 3 and trainer.val_check_batch == 3


def _check_iterator(namespace: str) -> None:
    loader = DataLoader(range(4))
    compat.forget_iterator(loader)
    assert loader._iterator is None


def _check_restart_stage(namespace: str) -> None:
    fit_loop = _trainer(namespace).fit_loop
    assert fit_loop.restarted_mid_epoch is False and compat.open_the_next_epoch(fit_loop) is False
    fit_loop._restart_stage = _module(namespace, "loops.fit_loop").RestartStage.RESTARTED_MID_EPOCH
    for name in ("ready", "started", "processed", "completed"):
        setattr(fit_loop.epoch_progress.current, name, 1)
    assert fit_loop.restarted_mid_epoch is True and compat.open_the_next_epoch(fit_loop) is True
    assert fit_loop.restarted_mid_epoch is False


def _check_finish(namespace: str) -> None:
    fit_loop = _trainer(namespace).fit_loop
    assert compat.finish_the_epoch(fit_loop) is False
    stages = _module(namespace, "loops.training_epoch_loop").RestartStage
    fit_loop.epoch_loop._restart_stage = stages.RESTARTED_ON_TRAIN_BATCH_END
    assert compat.finish_the_epoch(fit_loop) is True
    assert fit_loop.epoch_loop.batch_progress.is_last_batch and fit_loop.epoch_progress.current.processed == 1


def _check_checkpoint_layout(namespace: str) -> None:
    fit_loop = _trainer(namespace).fit_loop
    state = fit_loop.state_dict()
    for name in ("ready", "started", "processed", "completed"):
        state["epoch_progress"]["current"][name] = state["epoch_progress"]["total"][name] = 1
    state["epoch_loop.batch_progress"]["current"]["ready"] = 3
    state["state_dict"] = {"combined_loader": [{"epoch": 1, "consumed": 6}]}
    checkpoint = {"loops": {"fit_loop": state}}
    assert compat.repair_epoch_progress(checkpoint, lambda loader: loader["epoch"]) is True
    assert state["epoch_progress"]["current"]["ready"] == state["epoch_progress"]["total"]["started"] == 2
    assert compat.repair_epoch_progress(checkpoint, lambda loader: loader["epoch"]) is False  # already ordinary
    fit_loop.load_state_dict(state)
    assert fit_loop.epoch_progress.current.ready == 2


_LOOPS = "lightning.pytorch.loops"
CHECKS: dict[str, Callable[[str], None]] = {
    "lightning.pytorch.trainer.Trainer._accelerator_connector": _check_connector,
    "lightning.pytorch.trainer.connectors.accelerator_connector._AcceleratorConnector.use_distributed_sampler": (
        _check_connector
    ),
    "lightning.pytorch.overrides.distributed._IndexBatchSamplerWrapper": _check_wrapper,
    "lightning.pytorch.overrides.distributed._IndexBatchSamplerWrapper._batch_sampler": _check_wrapper,
    f"{_LOOPS}.fit_loop._FitLoop._combined_loader": _check_late_states,
    f"{_LOOPS}.fit_loop._FitLoop._combined_loader_states_to_load": _check_late_states,
    "lightning.pytorch.utilities.combined_loader.CombinedLoader._load_state_dicts": _check_late_states,
    f"{_LOOPS}.fit_loop._FitLoop.epoch_loop": _check_progress,
    f"{_LOOPS}.training_epoch_loop._TrainingEpochLoop.batch_progress": _check_progress,
    f"{_LOOPS}.fit_loop._FitLoop.max_batches": _check_epoch_length,
    f"{_LOOPS}.fit_loop._FitLoop._data_fetcher": _check_epoch_length,
    f"{_LOOPS}.fetchers._DataFetcher.length": _check_epoch_length,
    "lightning.pytorch.trainer.Trainer._val_check_time_interval": _check_epoch_length,
    "lightning.pytorch.trainer.Trainer.val_check_batch": _check_epoch_length,
    f"{_LOOPS}.fit_loop._FitLoop.epoch_progress": _check_restart_stage,
    f"{_LOOPS}.fit_loop._FitLoop.restarted_mid_epoch": _check_restart_stage,
    f"{_LOOPS}.fit_loop._FitLoop.reset_restart_stage": _check_restart_stage,
    f"{_LOOPS}.training_epoch_loop._TrainingEpochLoop.restarted_on_train_batch_end": _check_finish,
    f"{_LOOPS}.fit_loop._FitLoop.state_dict": _check_checkpoint_layout,
    "torch.utils.data.DataLoader._iterator": _check_iterator,
}


def test_every_listed_name_has_a_check_and_a_checked_version():
    assert set(CHECKS) == set(compat.PRIVATES)
    assert {name.split(".")[0] for name in compat.PRIVATES} == set(compat.CHECKED_AGAINST)


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("name", sorted(compat.PRIVATES))
def test_the_private_name_still_exists(name, namespace):
    library = name.split(".")[0]
    try:
        CHECKS[name](namespace)
    except (AttributeError, KeyError, AssertionError, ImportError, TypeError, RuntimeError) as exc:
        raise AssertionError(
            f"{namespace} ({library} {version(library)}) no longer has {name} as shardplug_lightning uses it "
            f"(checked against {compat.CHECKED_AGAINST[library]}): see shardplug_lightning/compat.py"
        ) from exc


def test_a_missing_private_name_is_reported_by_name():
    with pytest.raises(RuntimeError, match="_accelerator_connector"):
        compat.turn_off_distributed_sampler(torch.nn.Module())
