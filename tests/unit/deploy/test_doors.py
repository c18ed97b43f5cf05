"""The doors users walk in through, as shipped: deploy/ (the image, Compose, systemd) and the
flags the docs name must work against the code, not only read well (issue 40 item 5 found each
of these broken on main 42b8442: Compose instances loading a model from an empty volume, a
systemd user nothing created, a cluster secret git would commit, docs naming flags the parser
lacks or lacking flags it has).

Everything is read from the files themselves and checked against the real parser
(``server.launcher.settings.build_parser``, which is ``python -m server --help`` for every role:
single, ``--disagg``, ``--cluster``, prefill, decode and router) and the real model-folder rule
(``server.launcher.model_cache.default_model_dir``). Docker and systemd are not run here (no
daemon on the test machines): what a container or unit would load is derived from the files.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from server.launcher import model_cache
from server.launcher.settings import build_parser

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERIGNORE = DEPLOY / "Dockerfile.dockerignore"
COMPOSE = DEPLOY / "compose" / "cluster.yaml"
UNIT = DEPLOY / "systemd" / "kvbranch@.service"
SYSUSERS = DEPLOY / "systemd" / "kvbranch.sysusers"
SYSTEMD_README = DEPLOY / "systemd" / "README.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"
#: Every Markdown file a user reads commands from.
MARKDOWN = sorted(
    [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *DEPLOY.rglob("*.md")],
    key=str,
)


# --- readers -----------------------------------------------------------------------------


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def dockerfile_env(instructions: list[tuple[str, str]]) -> dict[str, str]:
    """The image's environment: every ``ENV KEY=VALUE ...`` (later ones win)."""
    env: dict[str, str] = {}
    for word, rest in instructions:
        if word == "ENV":
            for pair in shlex.split(rest):
                key, sep, value = pair.partition("=")
                assert sep, f"ENV {rest!r}: use the KEY=VALUE form"
                env[key] = value
    return env


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def kvbranch_services(doc: dict) -> dict[str, dict]:
    """The services that run ``python -m server`` (the image's entrypoint, or Compose's)."""
    return {
        name: svc
        for name, svc in doc["services"].items()
        if "-m server" in " ".join(svc.get("entrypoint") or [])
    }


def flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def unit_directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def systemd_args() -> list[tuple[str, list[str]]]:
    """Every ``KVBRANCH_ARGS="..."`` the systemd README gives (the unit's comment only sketches
    one), split as systemd splits ``$KVBRANCH_ARGS``."""
    found = []
    for path in (SYSTEMD_README,):
        for match in re.finditer(r'KVBRANCH_ARGS="([^"]*)"', path.read_text()):
            found.append(
                (f"{path.relative_to(ROOT)}: {match.group(1)[:60]}", match.group(1).split())
            )
    return found


SERVER_CMD = re.compile(r"python -m server(?![\w.])")
STOP_TOKENS = {"--", "|", "||", "&&", ";", "&", ")", "\\"}


def server_commands(text: str) -> list[list[str]]:
    """The arguments of every ``python -m server`` command in a Markdown text: whole lines in
    code blocks (continuations joined, comments cut), the inline code span in prose. Stops at a
    bare ``--`` (what follows goes to vLLM) and at shell operators."""
    commands: list[list[str]] = []
    in_block = False
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if line.lstrip().startswith("```"):
            in_block = not in_block
            continue
        if in_block:
            while line.rstrip().endswith("\\") and i < len(lines):
                line = line.rstrip()[:-1] + " " + lines[i]
                i += 1
            segments = [line.split(" #", 1)[0]]
        else:
            segments = [span for span in re.findall(r"`([^`]*)`", line)]
        for segment in segments:
            for match in SERVER_CMD.finditer(segment):
                args: list[str] = []
                for token in segment[match.end() :].split():
                    if token in STOP_TOKENS or token.startswith("#"):
                        break
                    args.append(token)
                commands.append(args)
    return commands


def flag_names(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--") and len(a) > 2]


def help_flags() -> set[str]:
    """The flags ``python -m server --help`` lists, read from its text."""
    return set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", build_parser().format_help()))


def configuration_table_flags() -> set[str]:
    """Flags in the first column of docs/configuration.md's flag table."""
    flags: set[str] = set()
    for line in CONFIGURATION.read_text().splitlines():
        if line.startswith("| `--"):
            first = line.split("|")[1]
            flags |= {code.split()[0] for code in re.findall(r"`(--[^`]+)`", first)}
    return flags


def parser_flags() -> set[str]:
    return {
        flag
        for action in build_parser()._actions
        for flag in action.option_strings
        if flag.startswith("--") and flag != "--help"
    }


# --- the image and Compose -------------------------------------------------------------------


def test_compose_instances_load_the_model_the_image_builds():
    steps = dockerfile_instructions(DOCKERFILE.read_text())
    env = dockerfile_env(steps)
    model_dir = env.get(model_cache.ENV_MODEL_DIR)
    assert model_dir, f"deploy/Dockerfile sets no {model_cache.ENV_MODEL_DIR}"
    # The build prepares that folder: scripts/setup.sh (which ends with the model's prepare)
    # runs after the ENV that names it.
    env_at = max(
        i for i, (w, r) in enumerate(steps) if w == "ENV" and model_cache.ENV_MODEL_DIR in r
    )
    prepares = [i for i, (w, r) in enumerate(steps) if w == "RUN" and "scripts/setup.sh" in r]
    assert prepares and min(prepares) > env_at, "the image never prepares the model folder"
    assert "-m server.model_cache prepare" in (ROOT / "scripts" / "setup.sh").read_text()
    workdir = [r for w, r in steps if w == "WORKDIR"][-1]

    doc = compose()
    services = kvbranch_services(doc)
    instances = {
        n: s for n, s in services.items() if flag_value(s["command"], "--role") != "router"
    }
    assert len(instances) >= 2 and len(services) > len(instances)
    for name, svc in services.items():
        assert svc.get("working_dir", workdir) == workdir, name
        overridden = set(svc.get("environment") or {}) & {
            model_cache.ENV_MODEL_DIR,
            model_cache.ENV_CACHE_HOME,
        }
        assert not overridden, f"{name} moves the image's model folder: {overridden}"
        for volume in svc.get("volumes") or []:
            target = volume["target"] if isinstance(volume, dict) else volume.split(":")[1]
            hidden = model_dir == target or model_dir.startswith(target.rstrip("/") + "/")
            assert not hidden, f"{name}: volume {volume} hides the image's model {model_dir}"
    for name, svc in instances.items():
        model = flag_value(svc["command"], "--model")
        # No --model: the launcher builds KVBRANCH_MODEL_DIR's folder, the image's too.
        assert model in (None, model_dir), f"{name}: --model {model} is not in the image"
    assert "volumes" not in doc or not doc["volumes"], "a named volume no service needs"


def test_compose_default_image_is_the_one_its_header_builds():
    text = COMPOSE.read_text()
    built = re.search(r"docker build -f deploy/Dockerfile -t (\S+) \.", text)
    assert built, "cluster.yaml does not say how to build its image"
    for name, svc in kvbranch_services(compose()).items():
        default = re.fullmatch(r"\$\{KVBRANCH_IMAGE:-([^}]+)\}", svc["image"])
        assert default and default.group(1) == built.group(1), name


def test_compose_and_dockerfile_flags_parse():
    parser = build_parser()
    cmd = [r for w, r in dockerfile_instructions(DOCKERFILE.read_text()) if w == "CMD"][-1]
    given = {name: svc["command"] for name, svc in kvbranch_services(compose()).items()}
    given["deploy/Dockerfile CMD"] = json.loads(cmd)
    for name, argv in given.items():
        try:
            parser.parse_args(argv)  # argparse exits on an unknown flag or a bad value
        except SystemExit:
            pytest.fail(f"{name}: python -m server refuses {argv}")


def test_secrets_are_ignored_by_git_and_kept_out_of_the_image():
    secrets = {s["file"] for s in compose()["secrets"].values()}
    paths = [(COMPOSE.parent / f).resolve().relative_to(ROOT).as_posix() for f in secrets]
    paths += ["deploy/systemd/cluster.env", "cluster.env"]  # /etc/kvbranch's, copied beside
    ignored = ROOT / ".gitignore"
    for path in paths:
        check = subprocess.run(
            ["git", "-c", f"core.excludesFile={ignored}", "check-ignore", "--no-index", "-q", path],
            cwd=ROOT,
        )
        assert check.returncode == 0, f"git would commit {path}"
    tracked = subprocess.run(
        ["git", "ls-files", "--", *paths], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert tracked.stdout == "", f"a secret is tracked: {tracked.stdout}"
    kept_out = {line.strip() for line in DOCKERIGNORE.read_text().splitlines()}
    for path in paths[: len(secrets)]:
        assert path in kept_out, f"the image build would copy {path}"
    assert {".venv/", ".git/"} <= kept_out


# --- systemd -----------------------------------------------------------------------------


def test_the_unit_runs_as_a_user_the_sysusers_file_creates():
    service = unit_directives(UNIT.read_text())
    user, group = service["User"][-1], service["Group"][-1]
    users, groups = set(), set()
    for line in SYSUSERS.read_text().splitlines():
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if fields[0] == "u":  # a user and its group of the same name
            users.add(fields[1])
            groups.add(fields[1])
        elif fields[0] == "g":
            groups.add(fields[1])
    assert user in users and group in groups
    readme = SYSTEMD_README.read_text()
    assert f"deploy/systemd/{SYSUSERS.name}" in readme and "systemd-sysusers" in readme


def test_systemd_sysusers_creates_that_user_in_an_empty_root(tmp_path):
    # The real tool, on a scratch root (it writes only under --root): the file's syntax is
    # systemd's, not just what the parser above reads.
    tool = shutil.which("systemd-sysusers")
    if tool is None:
        pytest.skip("systemd-sysusers is not installed")
    etc = tmp_path / "etc"
    etc.mkdir()
    for name in ("passwd", "group", "shadow", "gshadow"):
        (etc / name).touch()
    subprocess.run([tool, f"--root={tmp_path}", str(SYSUSERS)], check=True, capture_output=True)
    user = unit_directives(UNIT.read_text())["User"][-1]
    passwd = {
        line.split(":")[0]: line.split(":") for line in (etc / "passwd").read_text().splitlines()
    }
    groups = {line.split(":")[0] for line in (etc / "group").read_text().splitlines()}
    assert user in passwd and user in groups
    assert passwd[user][5] == "/var/lib/kvbranch" and passwd[user][6].endswith("nologin")


def test_the_units_model_is_where_the_prepare_step_puts_it(monkeypatch):
    service = unit_directives(UNIT.read_text())
    env = dict(pair.split("=", 1) for value in service["Environment"] for pair in value.split())
    state = [f"/var/lib/{d}" for d in service.get("StateDirectory", [])]
    cache = env.get(model_cache.ENV_CACHE_HOME)
    assert cache and cache in state, "the unit's model cache is not a directory it may write"
    monkeypatch.delenv(model_cache.ENV_MODEL_DIR, raising=False)
    monkeypatch.setenv(model_cache.ENV_CACHE_HOME, cache)
    expected = str(model_cache.default_model_dir())
    roles = {}
    for where, argv in systemd_args():
        roles[flag_value(argv, "--role")] = where
        if flag_value(argv, "--role") in ("prefill", "decode", "single", None):
            assert flag_value(argv, "--model") == expected, where
    assert {"prefill", "decode", "router"} <= set(roles)
    prepare = re.search(
        rf"{model_cache.ENV_CACHE_HOME}=(\S+)[^\n]*\n?[^\n]*model_cache prepare",
        SYSTEMD_README.read_text(),
    )
    assert prepare and prepare.group(1) == cache, "the README prepares the model elsewhere"


def test_secret_file_modes_agree_and_are_private():
    for path in (SYSTEMD_README, UNIT):
        text = path.read_text()
        modes = set(re.findall(r"mode (0\d{3})", text))
        modes |= {
            m.group(1) for m in re.finditer(r"install -m (0\d{3})[^\n]*?(/etc/kvbranch/\S+)", text)
        }
        assert modes == {"0600"}, f"{path.name}: modes {sorted(modes)} for the env files"


def test_the_log_lines_the_systemd_docs_quote_are_printed_by_the_code():
    code = "".join(p.read_text() for p in (ROOT / "server").rglob("*.py"))
    quoted = re.findall(
        r'"\[kvbranch\] ([a-z][^".]*?)(?: http://|\.\.\.|")',
        SYSTEMD_README.read_text() + UNIT.read_text(),
    )
    assert {"ready:", "router on"} <= {q.strip() for q in quoted}
    for line in quoted:
        assert line.strip() in code, f"no code prints '[kvbranch] {line}'"
    # A router prints no "ready:" line; the docs must not tell anyone to wait for one.
    router_launch = (ROOT / "server" / "router" / "launch.py").read_text()
    assert "ready:" not in router_launch
    assert re.search(r"router[^\n]*no \"ready:\"", SYSTEMD_README.read_text())


# --- flags in deploy/ and docs/ --------------------------------------------------------------


def test_every_flag_given_in_deploy_parses():
    parser = build_parser()
    found = systemd_args()
    assert len(found) >= 3
    for where, argv in found:
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{where}: python -m server refuses these flags")


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flag_a_doc_gives_python_m_server_is_in_its_help(path):
    known = help_flags()
    unknown = {
        flag
        for args in server_commands(path.read_text())
        for flag in flag_names(args)
        if flag not in known
    }
    assert not unknown, f"{path.relative_to(ROOT)} gives python -m server {sorted(unknown)}"


def test_the_docs_show_the_commands_this_test_reads():
    # The reader above must find the commands, or it checks nothing.
    readme = server_commands((ROOT / "README.md").read_text())
    assert [
        "--cluster",
        "--prefills",
        "1",
        "--decodes",
        "1",
        "--routers",
        "2",
        "--port",
        "8000",
    ] in readme
    assert any("--role" in args for args in server_commands(SYSTEMD_README.read_text()) + readme)


def test_configuration_md_lists_every_flag_and_only_real_ones():
    table, real = configuration_table_flags(), parser_flags()
    assert not table - real, (
        f"docs/configuration.md lists flags the parser lacks: {sorted(table - real)}"
    )
    assert not real - table, f"docs/configuration.md lacks: {sorted(real - table)}"


# --- the environment variables -----------------------------------------------------------------

#: Where a ``KVBRANCH_*`` variable is read: the code (a quoted name), the set-up script and the
#: deploy files (a shell, Compose, systemd or Kubernetes expansion, a Dockerfile ARG/ENV).
VARIABLE_IN_CODE = re.compile(r"""["'](KVBRANCH_[A-Z0-9_]+)["']""")
VARIABLE_IN_SHELL = re.compile(
    r"\$[{(]?(KVBRANCH_[A-Z0-9_]+)|^(?:ARG|ENV) (KVBRANCH_[A-Z0-9_]+)", re.M
)
CODE_FOLDERS = ("server", "sdk", "integrations", "benchmarks", "examples", "tests")


def variables_read() -> dict[str, str]:
    """Each ``KVBRANCH_*`` name the project reads, with one file that reads it."""
    found: dict[str, str] = {}
    for folder in CODE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for name in VARIABLE_IN_CODE.findall(path.read_text()):
                found.setdefault(name, str(path.relative_to(ROOT)))
    shell = [*(ROOT / "scripts").glob("*.sh"), DOCKERFILE, COMPOSE, UNIT]
    for path in [*shell, *(DEPLOY / "kubernetes").rglob("*.yaml")]:
        for match in VARIABLE_IN_SHELL.finditer(path.read_text()):
            found.setdefault(match.group(1) or match.group(2), str(path.relative_to(ROOT)))
    return found


def variables_documented() -> set[str]:
    """The names in the first column of docs/configuration.md's variable tables."""
    return {
        name
        for line in CONFIGURATION.read_text().splitlines()
        if line.startswith("| `KVBRANCH_")
        for name in re.findall(r"`(KVBRANCH_[A-Z0-9_]+)`", line.split("|")[1])
    }


def test_configuration_md_documents_every_variable_the_code_reads_and_only_those():
    read, documented = variables_read(), variables_documented()
    missing = {name: where for name, where in read.items() if name not in documented}
    assert not missing, f"docs/configuration.md lacks (name: a file that reads it): {missing}"
    unread = sorted(documented - read.keys())
    assert not unread, f"docs/configuration.md documents variables nothing reads: {unread}"
