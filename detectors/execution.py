"""Where a stage's units of work run: one after another in this process, or on an actor pool of a Ray cluster.

A stage hands :func:`map_units` its units (a shard of records, a concept, a run file) and ``make_worker``, a
picklable callable that builds a worker: the worker loads what every unit needs (the LLM, spaCy, the retrievers)
once, and ``worker(unit)`` computes one unit, writes what it produced (a shard, an artifact, a run file) and
returns a small summary. The stage then merges the finished units by their index, so the outputs do not depend on
the order units finish in, nor on how many workers computed them.

``execution.backend``:

* ``local``: one worker in the stage's process, the units in order (the default; nothing else is started).
* ``ray``: Ray Data ``map_batches`` over an actor pool of ``execution.workers`` actors, each with
  ``gpus_per_worker`` GPUs and ``cpus_per_worker`` CPUs, one unit per call. ``address`` None starts Ray on this
  machine for the stage (and stops it after); otherwise the stage joins that cluster. Every node must have the
  project installed and see the same paths (the LLM, the inputs, the shard directories: a shared filesystem);
  the actors work in the driver's working directory. An actor that dies is restarted and its unit retried, up to
  :data:`UNIT_RETRIES` times; a unit that raises stops the run (the units already written stay, and the next run
  computes only what is missing).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from detectors.config.common import ExecutionParams
from detectors.errors import InputError
from detectors.llm.loading import LLM, load_llm, prepared_reference, resolve_device, resolve_dtype

log = logging.getLogger(__name__)

UNIT_RETRIES = 2  # a unit whose actor died is retried this many times (a unit that kills every actor stops the run)


def batch_or_each(
    compute: Callable[[list], Sequence[Any]],
    items: list,
    what: str = "a batch",
    propagate: tuple[type[BaseException], ...] = (),
) -> list:
    """The one policy for a batch that fails: ``compute(items)`` (one result per item); when the batch raises, each item
    is computed alone, and an item that raises alone comes back as its exception while the others are computed. So one
    bad record never loses its batch, nor the run (the caller records the exceptions as failures, which the next run
    retries). Exceptions of the ``propagate`` types are the batch's own problem (out of memory: its size), raised."""
    try:
        return list(compute(items))
    except propagate:
        raise
    except Exception as err:  # noqa: BLE001 - computed one by one below, where an item's own failure is kept
        if len(items) == 1:
            return [err]
        log.warning("%s of %d raised (%s: %s); computing them one by one", what, len(items), type(err).__name__, err)
    out: list = []
    for item in items:
        try:
            out.extend(compute([item]))
        except propagate:
            raise
        except Exception as err:  # noqa: BLE001 - the item's failure, returned
            log.warning("%s: an item raised alone (%s: %s)", what, type(err).__name__, err)
            out.append(err)
    return out


def worker_device(device: str, execution: ExecutionParams) -> str:
    """The device the workers load the LLM on: ``llm.device`` as given, but ``auto`` on Ray is decided by
    ``gpus_per_worker`` (the driver may have no GPU, the actors may have one)."""
    if execution.backend != "ray":
        return device
    if device == "auto":
        return "cuda" if execution.gpus_per_worker > 0 else "cpu"
    if device.startswith("cuda") and (device != "cuda" or execution.gpus_per_worker == 0):
        raise InputError(
            f"llm.device = {device!r} with execution.backend = ray and gpus_per_worker = {execution.gpus_per_worker}: "
            f"Ray gives "
            "each actor its own GPUs (its CUDA_VISIBLE_DEVICES), so use llm.device auto (or cuda) with gpus_per_worker "
            "> 0, or cpu"
        )
    if device == "cpu" and execution.gpus_per_worker > 0:
        raise InputError(
            f"llm.device = cpu but execution.gpus_per_worker = {execution.gpus_per_worker}: set gpus_per_worker "
            f"to 0 (CPU workers)"
        )
    return device


@dataclasses.dataclass(frozen=True)
class LLMSpec:
    """The stage's LLM as its workers load it: ``paths.llm`` in ``llm.dtype`` on the workers' device (see
    :func:`~detectors.execution.worker_device`). Picklable, so a Ray actor loads it itself; its key is read from
    the prepared manifest, so the driver never loads the weights."""

    location: str
    dtype: str
    device: str

    @classmethod
    def of(cls, p) -> LLMSpec:
        """From a stage's params (:class:`~detectors.config.StageParams` reading ``llm``, ``paths.llm`` and
        ``execution``)."""
        return cls(p["paths.llm"], p["llm"].dtype, worker_device(p["llm"].device, p["execution"]))

    def load(self) -> LLM:
        return load_llm(self.location, self.dtype, self.device)

    def key(self) -> dict[str, Any]:
        """What identifies the loaded LLM: its fingerprint, the dtype and the device type it runs in."""
        fingerprint, _ = prepared_reference(self.location)
        device = resolve_device(self.device) if self.device == "auto" else torch.device(self.device)
        return {
            **fingerprint.to_dict(),
            "dtype": str(resolve_dtype(self.dtype, device)).removeprefix("torch."),
            "device": device.type,
        }


def map_units(
    units: Sequence[Any], make_worker: Callable[[], Callable[[Any], Any]], execution: ExecutionParams
) -> Iterator[tuple[int, Any]]:
    """``(index, worker(unit))`` for every unit, as units finish (in order with the local backend, in any order
    with Ray). No worker is built when there are no units; a local worker with a ``close`` method is closed when the
    units are done (a Ray actor's ends with its process)."""
    if not units:
        return
    if execution.backend == "local":
        worker = make_worker()
        try:
            for index, unit in enumerate(units):
                yield index, worker(unit)
        finally:
            getattr(worker, "close", lambda: None)()
        return
    yield from _ray_units(units, make_worker, execution)


class _Actor:
    """One Ray actor: the stage's worker, built once in the driver's working directory, computing one unit per call."""

    def __init__(self, make_worker: Callable[[], Callable[[Any], Any]], cwd: str):
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
        if os.path.isdir(cwd):
            os.chdir(cwd)  # the params' relative paths are relative to the project root, where the stage runs
        self.worker = make_worker()

    def __call__(self, batch: dict) -> dict:
        results = [pickle.dumps(self.worker(pickle.loads(unit))) for unit in batch["unit"]]
        return {"index": batch["index"], "result": results}


def _ray_units(units: Sequence[Any], make_worker, execution: ExecutionParams) -> Iterator[tuple[int, Any]]:
    try:
        import ray
    except ImportError:
        raise InputError(
            "execution.backend = ray but Ray is not installed: pip install 'dynrag-detectors[scale]' (ray[data])"
        ) from None
    from detectors.imports import ROOT

    started = not ray.is_initialized()
    if started:
        runtime_env = {
            "env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        }
        if execution.address is None:  # a Ray of our own on this machine, sized for the pool (and the driver)
            ray.init(
                address="local",
                num_cpus=execution.workers * execution.cpus_per_worker + 1,
                runtime_env=runtime_env,
                include_dashboard=False,
                logging_level=logging.WARNING,
            )
        else:
            ray.init(address=execution.address, runtime_env=runtime_env, logging_level=logging.WARNING)
    try:
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False  # the stage shows its own progress over records
        context.execution_options.preserve_order = False
        n = len(units)
        rows = [{"index": i, "unit": pickle.dumps(unit)} for i, unit in enumerate(units)]
        dataset = ray.data.from_items(rows, override_num_blocks=n).map_batches(
            _Actor,
            fn_constructor_kwargs={"make_worker": make_worker, "cwd": os.getcwd()},
            batch_size=1,
            compute=ray.data.ActorPoolStrategy(size=min(execution.workers, n)),
            num_cpus=execution.cpus_per_worker,
            num_gpus=execution.gpus_per_worker,
            max_task_retries=UNIT_RETRIES,
        )
        log.info(
            "ray: %d units on %d actors (%s GPU, %s CPU each)",
            n,
            min(execution.workers, n),
            execution.gpus_per_worker,
            execution.cpus_per_worker,
        )
        for row in dataset.iter_rows():
            yield int(row["index"]), pickle.loads(row["result"])
    finally:
        if started:
            ray.shutdown()
