"""A capacity run's configurations by name: ``plain``, ``kvbranch`` (vLLM's own scheduling),
``kvbranch-sched`` (``--sched-flags``) or ``kvbranch-sched:<its own flags>``, each optionally
``+KEY=VALUE`` with one environment variable of its own; and the server each one gets."""

from __future__ import annotations

import argparse

from benchmarks import common


def config_flags(name: str, args: argparse.Namespace) -> tuple[bool, list[str]]:
    """``(connector on, launcher flags)`` of a configuration's name."""
    if name == "plain":
        return False, common.SCHEDULER_OFF_FLAGS
    if name == "kvbranch":
        return True, common.SCHEDULER_OFF_FLAGS
    _, _, flags = name.partition(":")  # kvbranch-sched:<its own flags>
    return True, (flags or args.sched_flags).split()


def config_env(name: str) -> tuple[str, dict[str, str]]:
    """A configuration with one environment variable of its own, ``config+KEY=VALUE`` (an A/B
    of one part of the policy in one run, e.g. ``kvbranch-sched+KVBRANCH_PAUSE_COLDS=0``), as
    ``(config, environment)``."""
    spec, plus, assignment = name.partition("+")
    key, equals, value = assignment.partition("=")
    if plus and not (key and equals):
        raise SystemExit(f"--configs: {name!r}: expected config+KEY=VALUE")
    return spec, ({key: value} if plus else {})


def config_spec(name: str, args: argparse.Namespace) -> common.ServerSpec:
    """A configuration's server: launcher arguments, its own environment, the core reservation
    every configuration of the run shares."""
    spec, env = config_env(name)
    connector, flags = config_flags(spec, args)
    sizes = (args.kv_cache_gib, args.host_store_gib, args.max_model_len)
    reserved = (
        None if args.reserved_cpus is not None and args.reserved_cpus < 0 else args.reserved_cpus
    )
    return common.ServerSpec(common.server_args(connector, *sizes, flags), env, reserved)
