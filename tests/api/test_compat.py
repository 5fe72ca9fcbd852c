"""Every private name of another library listed in shardplug.core._internal.compat still exists (real objects).

Fails when a library release drops or renames one: the message names it; shardplug/core/_internal/compat.py
says what it is used for.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from datetime import timedelta
from importlib.metadata import version
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler

from shardplug.core._internal import compat
from shardplug.core.stepping.optimizer import PreparedOptimizer
from shardplug.core.stepping.scheduler import PreparedScheduler


def _scaler_record() -> tuple[Any, Any]:
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler.scale(param.sum()).backward()
    scaler.unscale_(opt)
    return scaler, opt


def _check_scaler_records() -> None:
    """The accessors of the record read it, move it and drop it, and make none where there is none."""
    scaler, opt = _scaler_record()
    assert compat.scaler_stage(scaler, opt) is compat.opt_state().UNSCALED and compat.scaler_found_inf(scaler, opt)
    other = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    assert compat.scaler_stage(scaler, other) is None and not compat.scaler_found_inf(scaler, other)
    compat.move_scaler_record(scaler, opt, other)
    assert compat.scaler_stage(scaler, opt) is None
    assert compat.scaler_stage(scaler, other) is compat.opt_state().UNSCALED
    assert compat.forget_scaler_record(scaler, other) and not compat.forget_scaler_record(scaler, other)
    assert compat.scaler_stage(scaler, other) is None
    assert len(getattr(scaler, "_per_optimizer_states")) == 0, "no record made by a lookup"  # noqa: B009


def _check_opt_state() -> None:
    assert {"READY", "UNSCALED", "STEPPED"} <= set(compat.opt_state().__members__)


def _check_found_inf() -> None:
    param = torch.nn.Parameter(torch.ones(2))
    fused = torch.optim.AdamW([param], lr=0.1, fused=True)
    seen = []
    fused.register_step_post_hook(lambda o, a, k: seen.append(compat.step_inf_flag(o)))
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(param.sum()).backward()
    scaler.step(fused)
    assert isinstance(seen[0], torch.Tensor)


def _check_amp_scaling_flag() -> None:
    assert torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))], fused=True)._step_supports_amp_scaling is True
    assert "_step_supports_amp_scaling" in inspect.getsource(torch.amp.GradScaler.step)
    assert PreparedOptimizer._step_supports_amp_scaling is False


def _check_hook_registry(kind: str) -> Callable[[], None]:
    def check() -> None:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        register = getattr(opt, f"register_{kind}_hook")

        def hook(*args: Any) -> None:
            return None

        register(hook)
        assert compat.optimizer_hooks(opt, kind) == [hook]

    return check


def _check_patch_step_function() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    compat.patch_step_function(opt)
    assert "_patch_step_function" in inspect.getsource(torch.optim.Optimizer.__setstate__)


def _check_hooked() -> None:
    assert ".hooked" in inspect.getsource(torch.optim.Optimizer._patch_step_function)
    assert getattr(PreparedOptimizer.step, "hooked", False) is True


def _check_scheduler_flag(name: str) -> Callable[[], None]:
    def check() -> None:
        from torch.optim.lr_scheduler import LRScheduler, StepLR

        assert name in vars(LRScheduler) or any(
            name in inspect.getsource(f) for f in vars(LRScheduler).values() if inspect.isfunction(f)
        )
        assert isinstance(vars(PreparedScheduler)[name], property)
        opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        scheduler = StepLR(opt, step_size=1)
        assert isinstance(getattr(scheduler, name), bool)

    return check


def _check_iterator(loader_cls: Any) -> Callable[[], None]:
    def check() -> None:
        loader = loader_cls(range(4))
        assert loader._iterator is None and "self._iterator" in inspect.getsource(loader_cls.__iter__)
        compat.forget_iterator(loader)
        assert compat.is_dataloader_internal("_iterator") and "_iterator" in compat.without_iterator({})

    return check


def _check_get_iterator(loader_cls: Any) -> Callable[[], None]:
    def check() -> None:
        assert callable(compat.get_iterator_method(loader_cls))
        assert "_get_iterator" in inspect.getsource(loader_cls.__iter__)

    return check


def _check_mangled() -> None:
    names = [name for name in vars(DataLoader(range(4))) if name.startswith("_DataLoader__")]
    assert "_DataLoader__initialized" in names and all(compat.is_dataloader_internal(n) for n in names)


def _check_num_samples() -> None:
    assert compat.random_sampler_num_samples(RandomSampler(range(4))) is None
    assert compat.random_sampler_num_samples(RandomSampler(range(4), num_samples=2)) == 2


def _check_collate(name: str) -> Callable[[], None]:
    def check() -> None:
        assert getattr(compat.torch_collate, name) is getattr(
            importlib.import_module(compat.torch_collate.__name__), name
        )
        if name == "default_collate_fn_map":
            table = compat.torch_collate.default_collate_fn_map
            assert torch.Tensor in table and int in table and float in table

    return check


def _hf_stream(**kwargs: Any) -> Any:
    datasets = pytest.importorskip("datasets")
    return datasets.IterableDataset.from_generator(lambda: iter([{"x": 1}, {"x": 2}]), **kwargs)


def _check_hf_examples() -> None:
    stream = _hf_stream()
    assert compat.hf_example_iterable(stream) is not None
    assert type(compat.hf_example_iterable(stream.shuffle(seed=1, buffer_size=2))).__name__ == (
        "BufferShuffledExamplesIterable"
    )


def _check_hf_distributed() -> None:
    from datasets.distributed import split_dataset_by_node

    stream = _hf_stream()
    assert "_distributed" in vars(stream) and compat.hf_node_split(stream) is None
    assert compat.hf_node_split(split_dataset_by_node(stream, rank=0, world_size=2)).world_size == 2


def _check_hf_shuffling() -> None:
    stream = _hf_stream()
    assert hasattr(stream, "_shuffling") or int(version("datasets").split(".")[0]) >= 3


def _check_streaming_rank_world() -> None:
    import tempfile

    from _stream_libraries import streaming_base, write_mds

    with tempfile.TemporaryDirectory() as directory:
        dataset = streaming_base().StreamingDataset(local=write_mds(f"{directory}/mds", 4), batch_size=2)
        world = compat.streaming_rank_world(dataset)
        assert "_parallel_rank_world" in vars(dataset) and (world.rank, world.num_ranks) == (0, 1)
        del dataset


def _check_ray_wrapped_loader() -> None:
    from ray.train.torch.train_loop_utils import _WrappedDataLoader

    inner = DataLoader(range(4), batch_size=2)
    wrapper = _WrappedDataLoader(inner, device=torch.device("cpu"), auto_transfer=False)
    assert compat.wrapped_dataloader(wrapper) is inner and compat.wrapped_dataloader(inner) is None


def _check_pin_memory_device() -> None:
    from torchdata.nodes import PinMemory, SamplerWrapper

    assert "self._pin_memory_device" in inspect.getsource(PinMemory.__init__)
    if torch.cuda.is_available():  # PinMemory needs a CUDA build to be made
        node = PinMemory(SamplerWrapper(range(2)), pin_memory_device="cuda")
        assert compat.pin_memory_device(node) == "cuda"
        assert compat.pin_memory_device(PinMemory(SamplerWrapper(range(2)))) is None


def _check_group_timeout() -> None:
    import torch.distributed as dist

    if dist.is_initialized():  # another test's group: read that one
        assert compat.group_timeout(dist.group.WORLD, "cpu") is not None
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=7))
    try:
        assert compat.group_timeout(dist.group.WORLD, "cpu") == timedelta(seconds=7)
        assert compat.group_timeout(dist.new_group(timeout=timedelta(seconds=9)), "cpu") == timedelta(seconds=9)
    finally:
        dist.destroy_process_group()


CHECKS: dict[str, Callable[[], None]] = {
    "torch.utils.data.DataLoader._iterator": _check_iterator(DataLoader),
    "torch.utils.data.DataLoader._get_iterator": _check_get_iterator(DataLoader),
    "torch.utils.data.DataLoader._DataLoader__initialized": _check_mangled,
    "torch.utils.data.RandomSampler._num_samples": _check_num_samples,
    **{
        f"torch.utils.data._utils.collate.{name}": _check_collate(name)
        for name in (
            "collate",
            "default_collate_fn_map",
            "collate_tensor_fn",
            "collate_float_fn",
            "collate_int_fn",
            "collate_numpy_scalar_fn",
        )
    },
    "torch.amp.GradScaler._per_optimizer_states": _check_scaler_records,
    "torch.amp.grad_scaler.OptState": _check_opt_state,
    "torch.optim.Optimizer.found_inf": _check_found_inf,
    "torch.optim.Optimizer._step_supports_amp_scaling": _check_amp_scaling_flag,
    **{
        f"torch.optim.Optimizer.{attribute}": _check_hook_registry(kind)
        for kind, attribute in compat.OPTIMIZER_HOOK_REGISTRIES.items()
    },
    "torch.optim.Optimizer._patch_step_function": _check_patch_step_function,
    "torch.distributed.ProcessGroup._get_backend": _check_group_timeout,
    "torch.distributed.ProcessGroupGloo.Options._timeout": _check_group_timeout,
    "torch.optim.Optimizer.step.hooked": _check_hooked,
    **{
        f"torch.optim.lr_scheduler.LRScheduler.{name}": _check_scheduler_flag(name)
        for name in compat.LR_SCHEDULER_FLAGS
    },
    "torchdata.nodes.PinMemory._pin_memory_device": _check_pin_memory_device,
    "datasets.IterableDataset._ex_iterable": _check_hf_examples,
    "datasets.IterableDataset._distributed": _check_hf_distributed,
    "datasets.IterableDataset._shuffling": _check_hf_shuffling,
    "streaming.StreamingDataset._parallel_rank_world": _check_streaming_rank_world,
    "ray.train.torch.train_loop_utils._WrappedDataLoader._dataloader": _check_ray_wrapped_loader,
}


def _stateful_loader() -> Any:
    return pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader


CHECKS["torchdata.stateful_dataloader.StatefulDataLoader._iterator"] = lambda: _check_iterator(_stateful_loader())()
CHECKS["torchdata.stateful_dataloader.StatefulDataLoader._get_iterator"] = lambda: _check_get_iterator(
    _stateful_loader()
)()


def test_every_listed_name_has_a_check_and_a_checked_version():
    assert set(CHECKS) == set(compat.PRIVATES)
    assert {compat.library_of(name) for name in compat.PRIVATES} == set(compat.CHECKED_AGAINST)
    assert all(compat.PRIVATES[name] for name in compat.PRIVATES), "every name says what it is used for"


@pytest.mark.parametrize("name", sorted(compat.PRIVATES))
def test_the_private_name_still_exists(name):
    try:
        CHECKS[name]()
    except (AttributeError, KeyError, AssertionError, ImportError, TypeError, OSError) as exc:
        library = compat.library_of(name)
        raise AssertionError(
            f"{library} {version(library)} no longer has {name} as shardplug uses it (checked against "
            f"{compat.CHECKED_AGAINST[library]}): see shardplug/core/_internal/compat.py"
        ) from exc


def test_the_scheduler_flags_reach_the_wrapped_scheduler():
    from torch.optim.lr_scheduler import StepLR

    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    prepared = PreparedScheduler(StepLR(opt, step_size=1), opt, num_processes=1)
    object.__setattr__(prepared, "_is_initial", True)
    assert prepared.scheduler._is_initial is True and prepared._is_initial is True


def test_an_unpickled_prepared_optimizer_has_its_hook_registries():
    import pickle

    opt = PreparedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
    opt.register_step_post_hook(lambda *args: None)
    copy = pickle.loads(pickle.dumps(opt))
    assert all(compat.optimizer_hooks(copy, kind) == [] for kind in compat.OPTIMIZER_HOOK_REGISTRIES)
