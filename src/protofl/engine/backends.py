"""``execution.backend`` -> the factory of its executor: ``factory(simulation) -> Executor``.

``local`` is this machine (sequential, worker processes, or the batched executor on one
device); ``ray`` is actors on a Ray cluster (Ray itself is imported only when a
:class:`~protofl.engine.ray_executor.RayExecutor` starts). The names are
:data:`protofl.config.BACKENDS`, which the config checks before any work.
"""
from __future__ import annotations

from typing import Callable, TYPE_CHECKING

from ..config import BACKENDS, Config, require_ray
from ..registry import Registry
from .batched import BatchedExecutor
from .executor import Executor, make_executor
from .ray_executor import check_address, RayExecutor

if TYPE_CHECKING:
    from .simulation import Simulation

EXECUTORS: Registry[Callable[[Simulation], Executor]] = Registry("execution backend")

def use_batched(cfg: Config) -> bool:
    """``execution.executor``: batched when asked, or (auto) on a GPU; never with worker processes."""
    ex = cfg.execution
    if ex.executor == "auto":
        return ex.torch_device != "cpu" and ex.workers in ("auto", 0)
    return ex.executor == "batched"


def batched_executor(sim: Simulation) -> BatchedExecutor:
    """The batched executor of ``sim``'s run, as its ``execution`` section sets it up."""
    ex = sim.cfg.execution
    return BatchedExecutor(sim.runtime, ex.batch_clients, ex.threads, compile=ex.compile, pad=ex.pads,
                           stack_kernels=ex.stack_kernels)


@EXECUTORS.register("local")
def local_executor(sim: Simulation) -> Executor:
    """This machine: sequential (``workers: 0``), a pool of worker processes, or the
    batched executor (``execution.executor``, engine/batched.py) in this process."""
    ex = sim.cfg.execution
    if use_batched(sim.cfg):
        return batched_executor(sim)
    return make_executor(sim.runtime, ex.workers, ex.threads, sim.participation.m)


@EXECUTORS.register("ray")
def ray_executor(sim: Simulation) -> Executor:
    """Actors on a Ray cluster (``execution.address``) or on a private local Ray."""
    require_ray()
    if sim.cfg.execution.address:  # a wrong address fails in seconds, before Ray is even imported
        check_address(sim.cfg.execution.address)
    return RayExecutor(sim)


assert tuple(EXECUTORS.names()) == tuple(sorted(BACKENDS)), "config.BACKENDS lists the execution backends"
