"""``--cluster``'s launch plan, without starting anything: its flags, how it splits the cores,
the argv each child gets (no cluster-level flag leaks into an instance; each has its role and
the index), and the one line when redis-server is missing."""

from __future__ import annotations

import itertools

import pytest

from server.launcher.settings import LaunchError, build_parser
from server.router import cluster
from server.router.cluster import (
    ChildSpec,
    LocalRedis,
    check_args,
    find_redis,
    keep_flags,
    plan_instances,
    plan_routers,
    replica_cores,
    share_cores,
    strip_flags,
)

INDEX = "redis://10.0.0.2:6379/0"


def parse(argv: list[str]):
    return build_parser().parse_args(argv)


def plan(argv: list[str], passthrough: list[str] = (), cores=None, index: str = INDEX):
    args = parse(argv)
    check_args(args, argv)
    ports = itertools.count(9000)
    instances = plan_instances(args, argv, list(passthrough), index, cores, lambda: next(ports))
    return args, instances, plan_routers(args, argv, index, instances)


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_defaults_and_flags_parse():
    args = parse(["--cluster"])
    assert (args.cluster, args.prefills, args.decodes, args.routers) == (True, 1, 1, 2)
    args = parse(["--cluster", "--prefills", "2", "--decodes", "3", "--routers", "4"])
    assert (args.prefills, args.decodes, args.routers) == (2, 3, 4)


@pytest.mark.parametrize("flag", ["--prefills", "--decodes", "--routers"])
def test_counts_must_be_positive(flag, capsys):
    with pytest.raises(SystemExit):
        parse(["--cluster", flag, "0"])
    assert "must be greater than 0" in capsys.readouterr().err


def test_help_lists_the_cluster_flags():
    text = build_parser().format_help()
    assert "one-machine cluster" in text
    for flag in ("--cluster", "--prefills", "--decodes", "--routers"):
        assert flag in text


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--disagg"], "--disagg"),
        (["--role", "prefill"], "drop --role prefill"),
        (["--prefill", "http://x:1"], "drop --prefill/--decode"),
        (["--replica", "http://x:1"], "drop --prefill/--decode/--replica"),
        (["--replicas", "2", "--prefills", "1"], "--replicas .*drop --prefills"),
        (["--replicas=2", "--decodes=2"], "--replicas .*drop --decodes"),
        (["--replicas", "2", "--prefills", "2", "--decodes", "1"], "drop --prefills/--decodes"),
        (["--advertise-url", "http://x:1"], "drop --advertise-url"),
        (["--port", "65535", "--routers", "2"], "65535"),
    ],
)
def test_what_cluster_cannot_honour_is_one_line(extra, says):
    with pytest.raises(LaunchError, match=says.replace("+", r"\+")) as caught:
        check_args(parse(["--cluster", *extra]), ["--cluster", *extra])
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("ncpu", "prefills", "decodes", "expected"),
    [
        (2, 1, 1, ["0", "1"]),
        (2, 2, 2, ["0", "0", "1", "1"]),  # instances of one role share their half
        (4, 1, 1, ["0-1", "2-3"]),
        (8, 2, 2, ["0-1", "2-3", "4-5", "6-7"]),
        (8, 3, 1, ["0-1", "2", "3", "4-7"]),  # the first ones get the remainder
        (3, 1, 2, ["0", "1", "2"]),  # D's get the larger half, like split_cores
        (4, 3, 1, ["0", "1", "0", "2-3"]),
    ],
)
def test_core_split(ncpu, prefills, decodes, expected):
    assert share_cores(ncpu, prefills, decodes) == expected


def test_core_split_needs_two_cores():
    with pytest.raises(LaunchError, match="at least 2 CPU cores"):
        share_cores(1, 1, 1)


USER = [
    "--cluster",
    "--prefills",
    "2",
    "--decodes=2",
    "--routers",
    "3",
    "--port",
    "8600",
    "--index",
    INDEX,
    "--kv-cache-gib",
    "0.25",
    "--max-model-len",
    "2048",
    "--api-key",
    "k1",
    "--cluster-name",
    "blue",
]
LEAKS = {"--cluster", "--prefills", "--decodes", "--routers", "--port", "--disagg"}


def test_each_instance_gets_the_user_flags_its_role_the_index_and_its_own_ports():
    _, instances, _ = plan(USER, ["--seed", "1"], cores=["0", "0", "1", "1"])
    assert [i.name for i in instances] == ["prefill1", "prefill2", "decode1", "decode2"]
    assert [i.role for i in instances] == ["prefill", "prefill", "decode", "decode"]
    nixl, ports = set(), set()
    for inst in instances:
        argv = inst.argv
        ours = argv[: argv.index("--")]
        assert not LEAKS & {a.split("=", 1)[0] for a in ours}, ours
        assert argv.count("--index") == 1 and value(argv, "--index") == INDEX
        assert argv.count("--role") == 1 and value(argv, "--role") == inst.role
        assert value(argv, "--kv-cache-gib") == "0.25"
        assert value(argv, "--max-model-len") == "2048"
        assert value(argv, "--api-key") == "k1"
        assert value(argv, "--cluster-name") == "blue"
        assert value(argv, "--cpu-cores") == inst.cores
        assert argv[argv.index("--") :] == ["--", "--seed", "1"]
        nixl.add(value(argv, "--nixl-port"))
        ports.add(inst.port)
    assert len(nixl) == 4 and len(ports) == 4 and not nixl & {str(p) for p in ports}


def test_instances_without_cores_on_cuda_and_without_passthrough():
    _, instances, _ = plan(["--cluster", "--kv-cache-gib", "0.5"])
    for inst in instances:
        assert "--cpu-cores" not in inst.argv and "--" not in inst.argv
        assert inst.cores is None


def test_routers_on_consecutive_ports_with_the_index_and_every_instance_as_seed():
    _, instances, routers = plan(USER)
    assert [r.port for r in routers] == [8600, 8601, 8602]
    assert [r.name for r in routers] == ["router1", "router2", "router3"]
    for router in routers:
        argv = router.argv
        assert value(argv, "--role") == "router" and value(argv, "--index") == INDEX
        assert value(argv, "--api-key") == "k1"  # the router checks the keys too
        assert value(argv, "--cluster-name") == "blue"  # the same namespace in the index
        prefills = [argv[i + 1] for i, a in enumerate(argv) if a == "--prefill"]
        decodes = [argv[i + 1] for i, a in enumerate(argv) if a == "--decode"]
        assert prefills == [i.url for i in instances if i.role == "prefill"]
        assert decodes == [i.url for i in instances if i.role == "decode"]
        # Instance flags stay with the instances.
        assert "--kv-cache-gib" not in argv and "--max-model-len" not in argv
        assert not LEAKS & set(argv)


def test_routers_get_the_router_policy_the_user_gave():
    # --cluster --router-policy round-robin ran cache-aware routers (issue 40 item 5).
    args, _, routers = plan(["--cluster", "--routers", "2", "--router-policy", "round-robin"])
    for router in routers:
        child = parse([*router.argv, "--port", str(router.port)])
        assert child.router_policy == args.router_policy == "round-robin"


def test_every_router_flag_reaches_the_routers():
    # A flag documented as "router: ..." that the router children never see is silently
    # ignored under --cluster; --prefill/--decode are the launcher's own seeds.
    router_flags = {
        flag
        for action in build_parser()._actions
        if (action.help or "").startswith("router:")
        for flag in action.option_strings
    }
    assert {"--router-policy", "--router-tenant-inflight"} <= router_flags
    assert router_flags - {"--prefill", "--decode", "--replica"} <= set(cluster._ROUTER_FLAGS)


def test_user_flags_with_equals_are_kept_or_dropped_whole():
    argv = [
        "--index=unix:///x",
        "--advertise-url=http://a:1",
        "--kv-cache-gib=0.5",
        "--log-level=debug",
    ]
    assert strip_flags(argv, cluster._LAUNCHER_FLAGS) == ["--kv-cache-gib=0.5", "--log-level=debug"]
    assert keep_flags(argv, cluster._ROUTER_FLAGS) == ["--log-level=debug"]


def test_child_spec_url_is_loopback():
    assert ChildSpec("p", "prefill", 9000, []).url == "http://127.0.0.1:9000"


def test_child_env_carries_the_secret_and_leaves_the_hash_seed_inherited(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert cluster.child_env("s" * 64) == {"KVBRANCH_CLUSTER_SECRET": "s" * 64}


def test_redis_missing_is_one_line_saying_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setattr(cluster.shutil, "which", lambda name: None)
    with pytest.raises(LaunchError) as caught:
        find_redis()
    message = str(caught.value)
    assert "\n" not in message
    assert "redis-server" in message and "scripts/setup.sh" in message and "--index" in message
    with pytest.raises(LaunchError, match="scripts/setup.sh"):
        LocalRedis(tmp_path)


def test_redis_missing_stops_run_cluster_before_anything_starts(monkeypatch):
    monkeypatch.setattr(cluster.shutil, "which", lambda name: None)
    started = []
    monkeypatch.setattr(cluster, "bind_listener", lambda *a: started.append(a))
    with pytest.raises(LaunchError, match="scripts/setup.sh"):
        cluster.run_cluster(parse(["--cluster"]), ["--cluster"], [])
    assert started == []


def test_local_redis_argv_is_private_unpersisted_and_capped(monkeypatch, tmp_path):
    monkeypatch.setattr(cluster.shutil, "which", lambda name: "/usr/bin/redis-server")
    redis = LocalRedis(tmp_path)
    argv = redis.argv()
    assert redis.url == f"unix://{tmp_path}/redis.sock"
    assert value(argv, "--port") == "0"  # no TCP listener
    assert value(argv, "--unixsocketperm") == "700"
    assert value(argv, "--save") == "" and value(argv, "--appendonly") == "no"
    assert value(argv, "--maxmemory-policy") == "volatile-lru"
    assert value(argv, "--maxmemory") == cluster.REDIS_MAXMEMORY


def test_main_dispatches_cluster(monkeypatch):
    from server.launcher import cli

    seen = {}
    monkeypatch.setattr(cli, "check_port_free", lambda *a: None)
    monkeypatch.setattr(
        cluster, "run_cluster", lambda args, ours, rest: seen.update(ours=ours, rest=rest)
    )
    assert cli.main(["--cluster", "--routers", "3", "--", "--seed", "1"]) == 0
    assert seen == {"ours": ["--cluster", "--routers", "3"], "rest": ["--seed", "1"]}


@pytest.mark.parametrize(
    ("ncpu", "replicas", "expected"),
    [
        (2, 2, ["0", "1"]),  # one core each
        (2, 3, ["0", "1", "0"]),  # more replicas than cores: shared round the cores
        (4, 2, ["0-1", "2-3"]),
        (5, 2, ["0-2", "3-4"]),
        (2, 1, ["0-1"]),
    ],
)
def test_replicas_divide_all_the_cores(ncpu, replicas, expected):
    assert replica_cores(ncpu, replicas) == expected


def test_replicas_are_single_instances_on_the_index_each_with_its_ports():
    argv = ["--cluster", "--replicas", "3", "--index", INDEX, "--kv-cache-gib", "0.25"]
    argv += ["--no-peer-pull", "--routers", "2", "--port", "8700"]
    _, instances, routers = plan(argv, ["--seed", "1"], cores=["0", "1", "0"])
    assert [i.name for i in instances] == ["replica1", "replica2", "replica3"]
    nixl, ports = set(), set()
    for inst in instances:
        ours = inst.argv[: inst.argv.index("--")]
        assert not (LEAKS | {"--replicas", "--replica"}) & {a.split("=", 1)[0] for a in ours}
        assert value(ours, "--role") == "single" and ours.count("--role") == 1
        assert value(ours, "--index") == INDEX and value(ours, "--cpu-cores") == inst.cores
        assert value(ours, "--kv-cache-gib") == "0.25" and "--no-peer-pull" in ours
        nixl.add(value(ours, "--nixl-port"))
        ports.add(inst.port)
    assert len(nixl) == 3 and len(ports) == 3 and not nixl & {str(p) for p in ports}
    for router in routers:
        seeds = [router.argv[i + 1] for i, a in enumerate(router.argv) if a == "--replica"]
        assert seeds == [i.url for i in instances]
        assert "--prefill" not in router.argv and "--decode" not in router.argv
        child = parse([*router.argv, "--port", str(router.port)])
        assert child.role == "router" and child.replica == seeds and child.index == INDEX
    assert [r.port for r in routers] == [8700, 8701]


def test_a_data_parallel_replica_gets_a_run_of_nixl_ports_one_per_engine():
    argv = ["--cluster", "--replicas", "2", "--index", INDEX]
    args = parse(argv)
    check_args(args, argv)
    asked: list[tuple[int, ...]] = []

    def port_of(*span: int) -> int:
        asked.append(span)
        return 9000 + 10 * len(asked)

    instances = plan_instances(args, argv, ["-dp", "2"], INDEX, None, port_of)
    assert asked == [(), (2,), (), (2,)]  # each replica: its HTTP port, then two NIXL ports
    assert [value(i.argv, "--nixl-port") for i in instances] == ["9020", "9040"]


def test_free_port_hands_out_a_run_of_free_ports():
    from server.launcher.process import free_port

    first = free_port(3)
    assert free_port(3) not in range(first - 2, first + 3)


def test_the_default_cluster_is_still_prefill_and_decode():
    _, instances, routers = plan(["--cluster"])
    assert [i.role for i in instances] == ["prefill", "decode"]
    assert "--replica" not in routers[0].argv


@pytest.mark.parametrize(
    ("prefills", "decodes", "replicas", "shared", "says"),
    [
        (["http://p:1"], [], ["http://r:1"], True, "not both"),
        ([], ["http://d:1"], ["http://r:1"], False, "not both"),
        (["http://p:1"], [], [], False, "--replica URLs"),
    ],
)
def test_router_seeds_name_one_topology(prefills, decodes, replicas, shared, says):
    from server.router.launch import check_router_urls

    with pytest.raises(LaunchError, match=says) as caught:
        check_router_urls(prefills, decodes, replicas, shared)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("prefills", "decodes", "replicas", "shared"),
    [
        ([], [], ["http://r:1"], False),  # replicas alone, even without a shared index
        (["http://p:1"], ["http://d:1"], [], False),
        ([], [], [], True),  # everything from the index
    ],
)
def test_router_seeds_that_serve(prefills, decodes, replicas, shared):
    from server.router.launch import check_router_urls

    check_router_urls(prefills, decodes, replicas, shared)
