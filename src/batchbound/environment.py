"""The process environment a command starts in, checked before any work.

torchrun describes a rank by environment variables (WORLD_SIZE, RANK, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT). Left over from another job, or mistyped, they would make torch fail
mid-start with a traceback, or, worse, make a lone process believe it is rank 1 and keep its
result to itself. ``check_torchrun_environment`` reads them once and refuses, in one line,
any set that torchrun could not have made. No torch import: the study and advise commands
check it too, before their first run.
"""

from __future__ import annotations

import os

from batchbound.errors import BatchboundError


def check_torchrun_environment() -> tuple[int, int]:
    """(world size, rank) from the environment, refused in one line when it cannot be a
    torchrun launch: WORLD_SIZE or RANK not an integer, WORLD_SIZE > 1 without RANK or the
    rendezvous address (a WORLD_SIZE left over from another job), a rank out of range, or a
    RANK other than 0 without a world. Checked before any work, not by torch mid-start."""
    env = os.environ

    def integer(name: str, low: int) -> int | None:
        text = env.get(name)
        if text is None:
            return None
        try:
            value = int(text.strip())
        except ValueError:
            value = None
        if value is None or value < low:
            raise BatchboundError(f"environment variable {name}={text!r} is not an integer "
                                  f">= {low}; {_ENV_HINT}")
        return value

    world = integer("WORLD_SIZE", 1)
    rank = integer("RANK", 0)
    integer("LOCAL_RANK", 0)
    port = integer("MASTER_PORT", 1)
    integer("TORCHELASTIC_RESTART_COUNT", 0)
    if world is None or world == 1:
        if rank:  # a leftover RANK would silence this process's output as a non-main rank
            raise BatchboundError(f"environment variable RANK={env['RANK']!r} without a world "
                                  f"of several ranks (WORLD_SIZE={env.get('WORLD_SIZE')!r}); "
                                  f"{_ENV_HINT}")
        return 1, 0
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in env]
    if missing:
        raise BatchboundError(f"WORLD_SIZE={world} is set but {', '.join(missing)} "
                              f"{'is' if len(missing) == 1 else 'are'} not, as torchrun sets "
                              f"them for every rank; {_ENV_HINT}")
    assert rank is not None
    if rank >= world:
        raise BatchboundError(f"environment variable RANK={rank} is not below "
                              f"WORLD_SIZE={world}; {_ENV_HINT}")
    if port is not None and port > 65535:
        raise BatchboundError(f"environment variable MASTER_PORT={port} is not a port "
                              f"(1..65535); {_ENV_HINT}")
    return world, rank


_ENV_HINT = ("left over from another job? unset WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR and "
             "MASTER_PORT, or launch with torchrun, which sets them all")


def restart_count() -> int:
    """TORCHELASTIC_RESTART_COUNT (0 when torchrun has not restarted this group), checked;
    0 outside torchrun (no TORCHELASTIC_RUN_ID, which its agent sets for every worker): a
    count left in a shell would have a plain rerun resume by itself, past the refusal to
    start afresh over a checkpoint."""
    check_torchrun_environment()
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return 0
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0").strip())


def usable_cores() -> int:
    """The CPUs this process may run on: its affinity (``taskset``, a Slurm job's cpuset), not
    ``os.cpu_count()``, which counts every core of a shared node."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
