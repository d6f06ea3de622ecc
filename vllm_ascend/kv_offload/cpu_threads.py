"""vLLM's CPU backend: a core reservation that a KV connector leaves usable.

vLLM's CPU executor (``vllm.utils.ompmultiprocessing.OMPProcessManager``)
binds the worker's OpenMP threads to the cores of its NUMA node and keeps
``VLLM_CPU_NUM_OF_RESERVED_CPU`` of them free for the engine-core (scheduler)
process: by default one per local rank, and one more per rank whenever a
``kv_transfer_config`` is set (meant for NIXL's transfer thread). On a node
with two cores and one rank that asks for both; vLLM then warns "Selected CPU
core number (2) should be greater than reserved CPU core number (2)",
reserves nothing and runs two spinning OpenMP threads on both cores, so the
scheduler, the API server and our copy thread compete with the forward pass
for every slice of CPU (issue 18: throughput 0.34-0.56x of offloading off on
a busy 2-core host, 1.44-1.71x with one core reserved).

Our copies do not need a core of their own (they run between forward passes,
on a thread of the worker), so in exactly that case (the reservation with a
connector would leave no core, the one without would leave one) ``apply``
sets ``VLLM_CPU_NUM_OF_RESERVED_CPU`` to vLLM's no-connector value through
vLLM's documented setting. It runs from the ``vllm.general_plugins`` entry
point, which vLLM calls while it parses its arguments, before it starts the
engine-core process that reads the variable (``EngineArgs.__post_init__``,
``AsyncEngineArgs.add_cli_args``); the child inherits it. An explicit
setting of the user's is never changed, nor are manual bindings
(``VLLM_CPU_OMP_THREADS_BIND`` other than ``auto``) or simulated NUMA nodes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass

from vllm_ascend.kv_offload.logger import init_logger

logger = init_logger(__name__)

RESERVED_CPU_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
SIM_MULTI_NUMA_ENV = "VLLM_CPU_SIM_MULTI_NUMA"
# What vLLM reserves for one local rank without / with a KV connector.
RESERVED_WITHOUT_CONNECTOR = 1
RESERVED_WITH_CONNECTOR = 2


@dataclass(frozen=True)
class CpuTopology:
    """What vLLM's automatic binding would select: physical cores (one logical
    CPU each) of each visible NUMA node, as ``OMPProcessManager`` counts them."""

    cores_per_node: dict[int, int]


def detect_topology() -> CpuTopology:
    """The topology of this process's allowed CPUs, from vLLM's own helpers."""
    from vllm.utils import cpu_resource_utils

    nodes = cpu_resource_utils.get_visible_memory_node()
    cores: dict[int, set[int]] = {node: set() for node in nodes}
    for cpu in cpu_resource_utils.get_allowed_cpu_list():
        if cpu.numa_node in cores:
            cores[cpu.numa_node].add(cpu.physical_core)
    return CpuTopology({node: len(ids) for node, ids in cores.items()})


def reserved_cpu_setting(
    environ: MutableMapping[str, str], topology: CpuTopology
) -> str | None:
    """The ``VLLM_CPU_NUM_OF_RESERVED_CPU`` value to set, or None to leave
    vLLM's choice. Pure (given the topology), for tests."""
    if RESERVED_CPU_ENV in environ:
        return None  # the user's explicit choice
    if environ.get(BIND_ENV, "auto") != "auto":
        return None  # manual core lists: the reservation picks no cores
    if environ.get(SIM_MULTI_NUMA_ENV, "0") != "0":
        return None
    if len(topology.cores_per_node) != 1:
        return None  # ranks per NUMA node: the world size is not known here
    (cores,) = topology.cores_per_node.values()
    # One node means one local rank (vLLM asserts as many nodes as ranks).
    if RESERVED_WITHOUT_CONNECTOR < cores <= RESERVED_WITH_CONNECTOR:
        return str(RESERVED_WITHOUT_CONNECTOR)
    return None


def apply(
    environ: MutableMapping[str, str] | None = None,
    topology: Callable[[], CpuTopology] = detect_topology,
) -> str | None:
    """Sets ``VLLM_CPU_NUM_OF_RESERVED_CPU`` where a connector's reservation
    would leave no core (see the module docstring); returns the value set."""
    environ = os.environ if environ is None else environ
    if RESERVED_CPU_ENV in environ:
        return None
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    found = topology()
    value = reserved_cpu_setting(environ, found)
    if value is not None:
        environ[RESERVED_CPU_ENV] = value
        # A warning: vLLM has not configured its logging yet when the plugin
        # runs (info is dropped), and its engine core then warns that the
        # value is "less than the minimum requirement"; this says why.
        logger.warning(
            "KV offload: %d CPU cores; vLLM's CPU backend would reserve %d of "
            "them when a KV connector is set, leaving none for its OpenMP "
            "threads. Set %s=%s (one core for the scheduler, as without a "
            "connector; vLLM's warning that this is less than the minimum "
            "is expected); set %s yourself to choose otherwise.",
            sum(found.cores_per_node.values()),
            RESERVED_WITH_CONNECTOR,
            RESERVED_CPU_ENV,
            value,
            RESERVED_CPU_ENV,
        )
    return value


# --------------------------------------------------------------------------
# Where our copy threads run
# --------------------------------------------------------------------------
#
# vLLM binds its worker's OpenMP threads through the environment it spawns the
# worker with (``OMPProcessManager.configure_omp_envs``): GOMP_CPU_AFFINITY
# (libgomp preloaded, as vLLM's CPU wheel does), OMP_PLACES, or KMP_AFFINITY's
# proclist. The OpenMP runtime pins the worker's main thread to the first of
# those cores when it loads, before any of our code runs, and a thread
# inherits its creator's affinity: our copy threads, started by the main
# thread, would all share that one core with the OpenMP master thread, which
# spins on it between and during forward passes. ``copy_thread_cpus`` moves
# them to the cores vLLM left out of the binding (the reserved core, with
# VLLM_CPU_NUM_OF_RESERVED_CPU=1 on two cores), or, where it left none, to all
# the process's cores so the kernel can run a copy wherever compute is not.


def omp_cores_from_env(environ: MutableMapping[str, str]) -> set[int] | None:
    """The cores of vLLM's OpenMP binding, from the variables vLLM sets for
    its worker; None where there is none (or it is not in vLLM's format)."""
    from vllm.utils.cpu_resource_utils import parse_id_list

    raw = None
    if gomp := environ.get("GOMP_CPU_AFFINITY"):
        raw = ",".join(gomp.split())  # vLLM writes "0 1 2"
    elif places := environ.get("OMP_PLACES"):
        raw = places.strip().removeprefix("{").removesuffix("}")  # "{0,1,2}"
    elif (kmp := environ.get("KMP_AFFINITY")) and "proclist=[" in kmp:
        raw = kmp.split("proclist=[", 1)[1].split("]", 1)[0]  # "...proclist=[0,1]"
    if not raw:
        return None
    try:
        return set(parse_id_list(raw))
    except ValueError:
        return None


def copy_thread_cpus(allowed: set[int], omp_cores: set[int] | None) -> set[int] | None:
    """The CPUs for a copy thread: the process's CPUs outside vLLM's OpenMP
    binding, or all of them if the binding takes every one; None (keep what
    the thread inherited) where there is no binding. Pure, for tests."""
    if not omp_cores or not allowed:
        return None
    return (allowed - omp_cores) or set(allowed)


def process_cpus() -> set[int]:
    """The CPUs this process may use before the OpenMP runtime pinned its main
    thread: those of the process that spawned it (vLLM's engine core starts
    its workers; the binding is applied to the child only), or
    this thread's own where the parent's cannot be read."""
    try:
        return os.sched_getaffinity(os.getppid())
    except OSError:
        return os.sched_getaffinity(0)


def free_cpus(environ: MutableMapping[str, str] | None = None) -> set[int] | None:
    """The CPUs for a thread of ours (a copy thread, a thread faulting the
    pool in): ``copy_thread_cpus`` of this process and vLLM's binding."""
    environ = os.environ if environ is None else environ
    return copy_thread_cpus(process_cpus(), omp_cores_from_env(environ))


def pin_copy_thread(environ: MutableMapping[str, str] | None = None) -> set[int] | None:
    """Moves the calling thread (a copy thread) off vLLM's OpenMP cores (see
    above); returns the CPUs set, or None if it left the thread as it was."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:
        cpus = free_cpus(environ)
        if cpus is None or cpus == os.sched_getaffinity(0):
            return None
        os.sched_setaffinity(0, cpus)  # 0: the calling thread on Linux
    except (OSError, ValueError) as e:
        # Only where copies run, never whether they are right: go on as is.
        logger.warning("KV offload: copy thread keeps its CPUs (%s)", e)
        return None
    logger.debug("KV offload: copy thread on CPUs %s", sorted(cpus))
    return cpus
