"""The files under deploy/: each is what its tool accepts (the PyTorchJob and its volume field by
field against the Kubeflow training operator's and Kubernetes' API models, strictly, as
`kubectl apply` checks fields; the SkyPilot task against SkyPilot's own schemas), and
scripts/torchrun.sh, given exactly the environment that each pod or node gets, starts torchrun
with the nodes, ranks, processes and run folder that the file asks for."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from .helpers import PACKAGE, PROJECT_ROOT

DEPLOY = PROJECT_ROOT / "deploy"
JOB = DEPLOY / "kubernetes" / "pytorchjob.yaml"
VOLUME = DEPLOY / "kubernetes" / "runs-volume.yaml"
SKYPILOT_TASK = DEPLOY / "skypilot" / "train.yaml"
SKYPILOT_SCHEMAS = Path(__file__).with_name("skypilot_schemas.yaml")

# The training operator v1's rules and defaults (kubeflow/training-operator release-1.9:
# pkg/apis/kubeflow.org/v1/pytorch_types.go, pkg/webhooks/pytorch/pytorchjob_webhook.go).
CONTAINER = "pytorch"
PORT_NAME, DEFAULT_PORT = "pytorchjob-port", 23456
RESTART_POLICIES = ("Always", "OnFailure", "Never", "ExitCode")
DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
TORCHRUN_DEFAULT_PORT = 29500  # scripts/torchrun.sh's, where the launcher sets none
GPU = "nvidia.com/gpu"

SCALARS: dict[str, type | tuple[type, ...]] = {
    "str": str, "int": int, "bool": bool, "float": (int, float), "datetime": str, "date": str,
}  # fmt: skip


def api_model(name: str) -> Any:
    import kubernetes.client
    from kubeflow.training import models

    return getattr(models, name, None) or getattr(kubernetes.client, name)


def build(data: Any, kind: str, where: str) -> Any:
    """`data` read as the API type `kind` (the OpenAPI types of the Kubeflow training SDK's and
    the Kubernetes client's models), refusing what the API server refuses: a field the type does
    not have, a value of another type, a required field left out."""
    if kind.startswith("list["):
        assert isinstance(data, list), f"{where}: {data!r} is not a list"
        return [build(item, kind[5:-1], f"{where}[{i}]") for i, item in enumerate(data)]
    if kind.startswith("dict("):
        assert isinstance(data, dict), f"{where}: {data!r} is not a mapping"
        values = kind[5:-1].split(", ", 1)[1]
        return {key: build(value, values, f"{where}.{key}") for key, value in data.items()}
    if kind == "object":
        return data
    if kind in SCALARS:
        wrong = isinstance(data, bool) and kind != "bool"
        assert isinstance(data, SCALARS[kind]) and not wrong, f"{where}: {data!r} is not {kind}"
        return data
    model = api_model(kind)
    assert isinstance(data, dict), f"{where}: {data!r} is not a {kind}"
    attributes = {field: attribute for attribute, field in model.attribute_map.items()}
    unknown = sorted(set(data) - set(attributes))
    assert not unknown, f"{where}: {kind} has no field {', '.join(unknown)}"
    try:
        return model(**{
            attributes[field]: build(value, model.openapi_types[attributes[field]], f"{where}.{field}")
            for field, value in data.items()
        })  # fmt: skip
    except ValueError as error:  # a required field left out
        raise AssertionError(f"{where}: {error}") from None


def load(path: Path) -> dict[str, Any]:
    (document,) = yaml.safe_load_all(path.read_text())
    return dict(document)


def replicas(job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    specs: dict[str, dict[str, Any]] = job["spec"]["pytorchReplicaSpecs"]
    return specs


def container(replica: dict[str, Any]) -> dict[str, Any]:
    found: list[dict[str, Any]] = [
        c for c in replica["template"]["spec"]["containers"] if c.get("name") == CONTAINER
    ]
    assert len(found) == 1, f"one container named {CONTAINER}"
    return found[0]


def check_pytorchjob(job: dict[str, Any]) -> None:
    """Its types, then the operator's own admission rules."""
    build(job, "KubeflowOrgV1PyTorchJob", "PyTorchJob")
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    name = job["metadata"]["name"]
    assert DNS_1035_LABEL.fullmatch(name) and len(name) <= 63, f"{name!r}: not a DNS-1035 label"
    specs = replicas(job)
    assert set(specs) <= {"Master", "Worker"}, f"{sorted(specs)}: the operator takes Master, Worker"
    assert specs["Master"]["replicas"] == 1, "one Master"
    for kind, spec in specs.items():
        assert spec.get("replicas", 1) >= 1 and spec["restartPolicy"] in RESTART_POLICIES, kind
        assert container(spec)["image"], f"{kind}: no image"


def test_the_pytorchjob_and_its_volume_are_what_kubernetes_accepts() -> None:
    job, claim = load(JOB), load(VOLUME)
    check_pytorchjob(job)
    assert (claim["apiVersion"], claim["kind"]) == ("v1", "PersistentVolumeClaim")
    build(claim, "V1PersistentVolumeClaim", "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"], "every node mounts it read-write"
    gpus_per_node = job["spec"]["nprocPerNode"]
    for kind, spec in replicas(job).items():
        pod, training = spec["template"]["spec"], container(spec)
        assert training["resources"]["limits"][GPU] == gpus_per_node, f"{kind}: a GPU a process"
        (runs,) = (m for m in training["volumeMounts"] if m["name"] == "runs")
        assert runs["mountPath"] == f"{training['workingDir']}/logs", "the run folders' root"
        (volume,) = (v for v in pod["volumes"] if v["name"] == "runs")
        assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        assert training["command"] == ["bash", "scripts/torchrun.sh"]
{%- if cookiecutter.dockerfile == "yes" %}
    dockerfile = (PROJECT_ROOT / "Dockerfile").read_text()
    assert f"WORKDIR {training['workingDir']}\n" in dockerfile and "COPY scripts " in dockerfile
{%- endif %}


def first_container(job: dict[str, Any], kind: str) -> dict[str, Any]:
    first: dict[str, Any] = replicas(job)[kind]["template"]["spec"]["containers"][0]
    return first


BREAKAGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "a misspelled field": lambda job: first_container(job, "Worker").update(volumeMount=[]),
    "a number as text": lambda job: replicas(job)["Worker"].update(replicas="2"),
    "a required field left out": lambda job: first_container(job, "Master").pop("name"),
    "two masters": lambda job: replicas(job)["Master"].update(replicas=2),
    "a replica type of another job": lambda job: replicas(job).update(
        Chief=replicas(job)["Worker"]
    ),
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_a_pytorchjob_that_kubernetes_refuses_is_refused(breakage: str) -> None:
    job = load(JOB)
    BREAKAGES[breakage](job)
    with pytest.raises(AssertionError):
        check_pytorchjob(job)


def skypilot_errors(task: dict[str, Any]) -> list[str]:
    """What `sky launch` would refuse in a task YAML: the task's schema, then its resources' and
    each bucket's (SkyPilot's schemas, vendored in tests/skypilot_schemas.yaml)."""
    schemas = yaml.safe_load(SKYPILOT_SCHEMAS.read_text())

    def one_of(validator: Any, allowed: list[str], instance: Any, schema: Any) -> Any:
        if str(instance).lower() not in [value.lower() for value in allowed]:
            yield jsonschema.ValidationError(f"{instance!r} is not one of {allowed!r}")

    def exactly_one_of(validator: Any, allowed: list[str], instance: Any, schema: Any) -> Any:
        if instance not in allowed:
            yield jsonschema.ValidationError(f"{instance!r} is not one of {allowed!r}")

    validator = jsonschema.validators.extend(
        jsonschema.Draft7Validator,
        {"case_insensitive_enum": one_of, "case_sensitive_enum": exactly_one_of},
    )
    task = {key: value for key, value in task.items() if value is not None}
    checks = [("task", task), ("resources", task.get("resources", {}))]
    checks += [
        ("storage", m) for m in (task.get("file_mounts") or {}).values() if isinstance(m, dict)
    ]
    return [
        f"{schema}: {error.message}"
        for schema, instance in checks
        for error in validator(schemas[schema]).iter_errors(instance)
    ]


def test_the_skypilot_task_is_what_skypilot_accepts() -> None:
    task = load(SKYPILOT_TASK)
    assert skypilot_errors(task) == []
    ((mount, bucket),) = task["file_mounts"].items()
    assert bucket["mode"] in ("MOUNT", "MOUNT_CACHED"), "a bucket the nodes write to"
    assert f"paths.log_dir={mount}" in task["run"], "the run folders' root is in the bucket"
    misspelled_bucket_mode = dict(bucket, mode="MOUNTED")
    changes: list[dict[str, Any]] = [
        dict(num_node=2),
        dict(resources=dict(accelerator="H100:8")),
        dict(file_mounts={mount: misspelled_bucket_mode}),
    ]
    for change in changes:
        assert skypilot_errors({**task, **change}), f"{change} is refused"


def fake_torchrun(folder: Path) -> Path:
    """A `torchrun` that records its arguments, and whether it is the process that the script
    named as torchrun's agent (it `exec`s torchrun: the same process)."""
    folder.mkdir(parents=True)
    record = folder / "argv.json"
    script = folder / "torchrun"
    script.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"agent = os.environ.get('TORCHRUN_AGENT_PID') == str(os.getpid())\n"
        f"open({str(record)!r}, 'w').write(json.dumps(dict(argv=sys.argv[1:], agent=agent)))\n"
    )
    script.chmod(0o755)
    return record


def launch(command: list[str], environment: dict[str, str], tmp_path: Path) -> dict[str, Any]:
    """`command` run in the project's folder (the image's working directory, SkyPilot's workdir)
    with `environment` and nothing else, but a PATH that finds the fake torchrun first."""
    record = fake_torchrun(tmp_path / "bin")
    path = f"{record.parent}{os.pathsep}{os.environ['PATH']}"
    result = subprocess.run(
        command, cwd=PROJECT_ROOT, env={**environment, "PATH": path}, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return dict(json.loads(record.read_text()))


def expected_argv(
    nodes: int, rank: int, gpus: int, address: str, port: int, run_name: str, args: list[str]
) -> list[str]:
    return [
        f"--nnodes={nodes}", f"--node-rank={rank}", f"--nproc-per-node={gpus}",
        f"--master-addr={address}", f"--master-port={port}", "-m", PACKAGE, "strategy=ddp",
        "trainer=gpu", f"trainer.devices={gpus}", f"trainer.num_nodes={nodes}",
        f"run_name='{run_name}'", *args,
    ]  # fmt: skip


def pod_environment(job: dict[str, Any], kind: str, index: int) -> dict[str, str]:
    """What the training operator v1.9 (pkg/controller.v1/pytorch/envvar.go, master.go) adds to
    the training container of pod `index` of replica type `kind`, after the container's own."""
    specs = replicas(job)
    master = container(specs["Master"])
    ports = [p["containerPort"] for p in master.get("ports", []) if p["name"] == PORT_NAME]
    port, address = str((ports or [DEFAULT_PORT])[0]), f"{job['metadata']['name']}-master-0"
    nodes = sum(spec.get("replicas", 1) for spec in specs.values())
    rank = index + (1 if kind == "Worker" else 0)
    gpus = job["spec"]["nprocPerNode"]
    own = {variable["name"]: variable["value"] for variable in container(specs[kind])["env"]}
    return {
        **own, "PYTHONUNBUFFERED": "1", "MASTER_PORT": port, "PET_MASTER_PORT": port,
        "MASTER_ADDR": address, "PET_MASTER_ADDR": address,
        "WORLD_SIZE": str(nodes * int(gpus)), "RANK": str(rank), "PET_NODE_RANK": str(rank),
        "PET_NPROC_PER_NODE": gpus, "PET_NNODES": str(nodes),
    }  # fmt: skip


def test_each_pod_of_the_pytorchjob_starts_torchrun_as_one_node_of_the_job(
    tmp_path: Path,
) -> None:
    job = load(JOB)
    specs = replicas(job)
    nodes = sum(spec.get("replicas", 1) for spec in specs.values())
    gpus = int(job["spec"]["nprocPerNode"])
    ranks = []
    for kind, spec in specs.items():
        training = container(spec)
        for index in range(spec.get("replicas", 1)):
            environment = pod_environment(job, kind, index)
            seen = launch(
                [*training["command"], *training.get("args", [])], environment,
                tmp_path / f"{kind}-{index}",
            )  # fmt: skip
            rank = int(environment["RANK"])
            assert seen["argv"] == expected_argv(
                nodes, rank, gpus, environment["MASTER_ADDR"], int(environment["MASTER_PORT"]),
                environment["RUN_NAME"], training.get("args", []),
            )  # fmt: skip
            assert seen["agent"], "the script names torchrun's agent to its workers"
            ranks.append(rank)
    assert sorted(ranks) == list(range(nodes)) and nodes >= 2


def test_each_node_of_the_skypilot_task_starts_torchrun_as_one_node_of_the_job(
    tmp_path: Path,
) -> None:
    task = load(SKYPILOT_TASK)
    nodes = task["num_nodes"]
    accelerator, _, count = str(task["resources"]["accelerators"]).partition(":")
    gpus = int(count or 1)
    addresses = [f"10.0.0.{node + 1}" for node in range(nodes)]  # the head node's first
    ((mount, _),) = task["file_mounts"].items()
    for rank in range(nodes):
        environment = {
            **{name: str(value) for name, value in task["envs"].items()},
            "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NODE_IPS": "\n".join(addresses),
            "SKYPILOT_NUM_NODES": str(nodes), "SKYPILOT_NUM_GPUS_PER_NODE": str(gpus),
        }  # fmt: skip
        seen = launch(["bash", "-c", task["run"]], environment, tmp_path / str(rank))
        assert seen["argv"] == expected_argv(
            nodes, rank, gpus, addresses[0], TORCHRUN_DEFAULT_PORT, task["envs"]["RUN_NAME"],
            [f"paths.log_dir={mount}"],
        )  # fmt: skip
        assert seen["agent"]
    assert nodes >= 2 and accelerator
