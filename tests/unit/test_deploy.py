"""The deploy artifacts (deploy/): what an operator installs must be valid and say what we mean.

- Kubernetes: the base and the example overlay are rendered with ``kubectl kustomize`` and every
  object is validated offline against the API schemas ``kubernetes-validate`` ships (strict:
  an unknown field fails), then the properties the agent relies on are asserted: an elastic
  Indexed Job, the pod failure policy that matches the agent's exit codes, gRPC probes, GPUs,
  ReadWriteMany checkpoints, non-root pods, pinned images, a 3-member etcd.
- systemd: ``systemd-analyze verify`` must pass on the unit, and must fail on a broken copy (so
  a pass means something); the directives are asserted.
- Docker: the Dockerfile is parsed and checked (non-root, tini as PID 1, swappable base).
- Every ELASTIC_* name anywhere in deploy/ is a real elasticd option: renaming an option breaks
  this test instead of an operator's deployment. And the settings as deployed load with
  :func:`agent.config.load`.

kubectl and systemd-analyze are found on PATH (/usr/bin here); a test that needs one is skipped,
saying so, only where it is absent.
"""

from __future__ import annotations

import copy
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from agent import config as agent_config
from elastic.errors import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_JOB_FAILED, EXIT_STORE
from elastic.records import validate_id
from elastic.rendezvous.config import parse_nnodes

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
UNIT = DEPLOY / "systemd" / "elasticd@.service"
EXAMPLE_ENV = DEPLOY / "systemd" / "example.env"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"

KUBECTL = shutil.which("kubectl")
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl is not installed: cannot render the kustomizations")
needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed: cannot verify the unit")

try:  # the name the liveness probe asks for; the literal until the agent defines it
    from agent.grpc_server import LIVENESS_SERVICE
except ImportError:  # pragma: no cover - older agent
    LIVENESS_SERVICE = "elastic.v1.Liveness"

ELASTIC_NAME = re.compile(r"\bELASTIC_[A-Z0-9_]+\b")


def known_env() -> set[str]:
    """Every ELASTIC_* variable elasticd reads."""
    return ({o.env for o in agent_config.OPTIONS} | set(agent_config.SCRIPT_ENV)
            | {"ELASTIC_CONFIG", "ELASTIC_LOG_LEVEL"})


# --- Kubernetes ---------------------------------------------------------------------------------


def render(path: Path) -> list[dict[str, Any]]:
    out = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {path} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module", params=["base", "overlays/example", "overlays/gpu-rdma"])
def rendered(request) -> tuple[str, list[dict[str, Any]]]:
    if KUBECTL is None:
        pytest.skip("kubectl is not installed: cannot render the kustomizations")
    return request.param, render(K8S / request.param)


@pytest.fixture(scope="module")
def overlay() -> list[dict[str, Any]]:
    if KUBECTL is None:
        pytest.skip("kubectl is not installed: cannot render the kustomizations")
    return render(K8S / "overlays" / "example")


def one(objs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objs if o["kind"] == kind
             and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def job_of(objs: list[dict]) -> dict:
    """The training job (the other Job is etcd-auth's)."""
    return one(objs, "Job", "train")


def agent_container(job: dict) -> dict:
    containers = job["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "elasticd")


def pod_env(objs: list[dict], job: dict, *, pod_ip: str = "10.0.0.7",
            index: str = "3") -> dict[str, str]:
    """The agent container's environment as the kubelet builds it: envFrom ConfigMaps,
    then env in order (fieldRefs filled in, $(VAR) expanded against what came before)."""
    c = agent_container(job)
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        env.update(one(objs, "ConfigMap", source["configMapRef"]["name"])["data"])
    fields = {"status.podIP": pod_ip,
              "metadata.annotations['batch.kubernetes.io/job-completion-index']": index}
    for var in c.get("env", []):
        if "valueFrom" in var:
            env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[var["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                                      lambda m: env.get(m.group(1), m.group(0)), var["value"])
    return env


def pod_templates(objs: list[dict]) -> Iterator[tuple[str, dict]]:
    for o in objs:
        if o["kind"] in ("Job", "StatefulSet", "Deployment", "DaemonSet"):
            yield f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]


@needs_kubectl
def test_every_rendered_object_is_valid_against_the_kubernetes_schemas(rendered):
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    name, objs = rendered
    version = latest_version()
    assert tuple(int(x) for x in version.split(".")[:2]) >= (1, 31), version
    assert {o["kind"] for o in objs} >= {"Job", "StatefulSet", "Service", "ConfigMap",
                                         "PodDisruptionBudget", "PersistentVolumeClaim",
                                         "ServiceAccount"}
    for obj in objs:
        try:  # strict: unknown fields (a misspelled key) are errors too
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']} is not valid "
                        f"Kubernetes {version}: {path}: {exc.message}")


@needs_kubectl
def test_the_schema_validation_catches_a_misspelled_field(overlay):
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    broken = copy.deepcopy(job_of(overlay))
    broken["spec"]["paralelism"] = broken["spec"].pop("parallelism")
    with pytest.raises(kubernetes_validate.ValidationError, match="paralelism"):
        kubernetes_validate.validate(broken, latest_version(), strict=True)


@needs_kubectl
def test_the_job_is_an_elastic_indexed_job_within_nnodes(rendered):
    _, objs = rendered
    spec = job_of(objs)["spec"]
    assert spec["completionMode"] == "Indexed"
    # Only an Indexed Job with completions == parallelism may have both patched while it runs.
    assert spec["completions"] == spec["parallelism"] >= 1
    lo, hi = parse_nnodes(pod_env(objs, job_of(objs))["ELASTIC_NNODES"])
    assert lo <= spec["parallelism"] <= hi, "the Job's size must lie within ELASTIC_NNODES"


@needs_kubectl
def test_the_pod_failure_policy_matches_the_agents_exit_codes(rendered):
    _, objs = rendered
    job = job_of(objs)
    spec = job["spec"]
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    assert spec["backoffLimit"] >= 1  # 3, 4, 70 and crashes are retried
    assert spec.get("podReplacementPolicy", "Failed") == "Failed"
    rules = spec["podFailurePolicy"]["rules"]

    def exit_rule(action: str) -> set[int]:
        codes: set[int] = set()
        for r in rules:
            if r["action"] == action and "onExitCodes" in r:
                assert r["onExitCodes"]["operator"] == "In"
                assert r["onExitCodes"].get("containerName") == "elasticd"
                codes |= set(r["onExitCodes"]["values"])
        return codes

    assert exit_rule("FailJob") == {EXIT_JOB_FAILED, EXIT_BAD_INPUT}
    # A job failure wins over a disruption seen at the same time: its rule comes first.
    assert rules[0]["action"] == "FailJob"
    assert any(r["action"] == "Ignore"
               and any(c["type"] == "DisruptionTarget" for c in r.get("onPodConditions", []))
               for r in rules)
    # A pod Kubernetes terminated drains with the drain exit code: replaced, not counted,
    # and never mistaken for a completed index (0) or a failure to retry.
    drain = int(pod_env(objs, job)["ELASTIC_DRAIN_EXIT_CODE"])
    assert drain == 143
    assert exit_rule("Ignore") == {drain}
    # What must be retried is not caught by any rule.
    caught = exit_rule("FailJob") | exit_rule("Ignore") | exit_rule("FailIndex")
    assert not caught & {EXIT_STORE, EXIT_INTERNAL, 137}


@needs_kubectl
def test_the_probes_are_the_agents_grpc_health_services(rendered):
    _, objs = rendered
    job = job_of(objs)
    c = agent_container(job)
    port = int(pod_env(objs, job)["ELASTIC_LISTEN"].rpartition(":")[2])
    assert c["readinessProbe"]["grpc"]["port"] == port
    assert c["readinessProbe"]["grpc"].get("service", "") == ""
    for probe in ("livenessProbe", "startupProbe"):
        assert c[probe]["grpc"] == {"port": port, "service": LIVENESS_SERVICE}
    assert {p["containerPort"] for p in c["ports"]} >= {port}
    # Prometheus scrapes the port the agent serves metrics on.
    annotations = job["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == pod_env(objs, job)["ELASTIC_METRICS_PORT"]
    # The startup probe waits at least as long as the agent waits for etcd at start.
    startup = c["startupProbe"]
    connect_timeout = float(pod_env(objs, job).get("ELASTIC_CONNECT_TIMEOUT", 5))
    assert startup["periodSeconds"] * startup["failureThreshold"] > connect_timeout


@needs_kubectl
def test_the_pod_leaves_time_for_a_final_checkpoint(rendered):
    _, objs = rendered
    job = job_of(objs)
    grace = job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= 60
    stop_grace = float(pod_env(objs, job).get("ELASTIC_STOP_GRACE", 5))
    assert stop_grace + 10 <= grace, "the workers' stop grace must fit in the pod's"


@needs_kubectl
def test_the_node_id_is_unique_per_index_and_valid(rendered):
    _, objs = rendered
    job = job_of(objs)
    env = pod_env(objs, job, index="12")
    validate_id("node id", env["ELASTIC_NODE_ID"])
    assert env["ELASTIC_NODE_ID"] == f"{env['ELASTIC_JOB_ID']}-12"
    assert pod_env(objs, job, index="13")["ELASTIC_NODE_ID"] != env["ELASTIC_NODE_ID"]
    assert env["ELASTIC_ADVERTISE_ADDR"] == "10.0.0.7"  # status.podIP


@needs_kubectl
def test_the_deployed_settings_load(rendered, tmp_path):
    """The pod's environment, as the agent would read it, is a valid configuration."""
    _, objs = rendered
    env = pod_env(objs, job_of(objs))
    script = env["ELASTIC_SCRIPT"]
    if script.startswith("/opt/elasticd/examples/"):  # the Dockerfile copies examples/ there
        assert (ROOT / "examples" / Path(script).name).is_file()
    env["ELASTIC_SCRIPT"] = str(tmp_path / "train.py")  # the image's script is not here
    (tmp_path / "train.py").write_text("")
    # The Secrets' files are not here either: stand-ins (the CA a real PEM).
    from tests.tls_certs import make_certs

    env["ELASTIC_ETCD_CACERT"] = make_certs(str(tmp_path)).ca
    (tmp_path / "job-password").write_text("secret\n")
    env["ELASTIC_ETCD_PASSWORD_FILE"] = str(tmp_path / "job-password")
    cfg = agent_config.load([], env)
    job_id = env["ELASTIC_JOB_ID"]
    assert cfg.etcd_security.user == f"elasticd-{job_id}"
    assert cfg.etcd_security.password == "secret"
    assert cfg.drain_exit_code == 143
    assert cfg.log_format == "json"
    assert cfg.metrics_port == 29402
    assert cfg.checkpoint_dir.startswith("/checkpoints/")
    assert cfg.state_dir.startswith("/var/lib/elasticd/")
    # The gRPC port on the pod IP only, never every interface.
    assert cfg.listen == "10.0.0.7:29401"


@needs_kubectl
def test_a_network_policy_admits_only_the_jobs_pods_to_the_agents_and_workers(rendered):
    _, objs = rendered
    agent_labels = job_of(objs)["spec"]["template"]["metadata"]["labels"]
    policy = one(objs, "NetworkPolicy", "elasticd")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= agent_labels.items()
    assert "Ingress" in policy["spec"]["policyTypes"]
    every_port_from = []
    for rule in policy["spec"]["ingress"]:
        peers = rule.get("from")
        if not peers:  # open to all: the metrics port only
            assert [p["port"] for p in rule["ports"]] == [29402], rule
            continue
        for peer in peers:  # the job's agent pods, nothing wider
            assert set(peer) == {"podSelector"}, peer
            assert peer["podSelector"]["matchLabels"].items() <= agent_labels.items()
            assert {"app.kubernetes.io/name", "app.kubernetes.io/component"} <= \
                set(peer["podSelector"]["matchLabels"]), peer
        if "ports" not in rule:
            every_port_from.append(rule)
    # Workers' ports (MASTER_PORT, gloo, NCCL) change every round: every port, from the job.
    assert every_port_from


@needs_kubectl
def test_the_volumes_the_agent_writes_to_are_mounted(rendered):
    _, objs = rendered
    job = job_of(objs)
    env = pod_env(objs, job)
    pod = job["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in agent_container(job)["volumeMounts"]}

    def volume_at(path: str) -> dict:
        best = max((m for m in mounts if path == m or path.startswith(m.rstrip("/") + "/")),
                   key=len, default=None)
        assert best is not None, f"{path} is on the read-only root file system"
        return mounts[best]

    # Checkpoints: one shared volume that every node can read and write at once.
    claim = volume_at(env["ELASTIC_CHECKPOINT_DIR"])["persistentVolumeClaim"]["claimName"]
    pvc = one(objs, "PersistentVolumeClaim", claim)
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert "emptyDir" in volume_at(env["ELASTIC_STATE_DIR"])
    assert "emptyDir" in volume_at("/tmp")  # the worker socket
    assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"


# The one capability a manifest may add, and where: RDMA's locked memory (the overlay's
# kustomization.yaml says when it takes effect).
ADDED_CAPABILITIES = {"overlays/gpu-rdma": {"Job/train": ["IPC_LOCK"]}}


@needs_kubectl
def test_every_pod_runs_non_root_without_privileges(rendered):
    which, objs = rendered
    for name, template in pod_templates(objs):
        pod = template["spec"]
        sc = pod["securityContext"]
        assert sc["runAsNonRoot"] is True, name
        assert sc["runAsUser"] > 0, name
        assert sc["seccompProfile"]["type"] == "RuntimeDefault", name
        assert pod["automountServiceAccountToken"] is False, name
        for c in pod["containers"] + pod.get("initContainers", []):
            csc = c["securityContext"]
            assert csc["allowPrivilegeEscalation"] is False, name
            assert csc["capabilities"]["drop"] == ["ALL"], name
            assert csc["capabilities"].get("add", []) == \
                ADDED_CAPABILITIES.get(which, {}).get(name, []), name
            assert csc["readOnlyRootFilesystem"] is True, name
        assert not pod.get("hostNetwork") and not pod.get("hostPID"), name
    for sa in (o for o in objs if o["kind"] == "ServiceAccount"):
        assert sa["automountServiceAccountToken"] is False


@needs_kubectl
def test_every_image_is_pinned(rendered):
    _, objs = rendered
    for name, template in pod_templates(objs):
        for c in template["spec"]["containers"]:
            image = c["image"]
            assert "@sha256:" in image or re.search(r":[\w][\w.-]*$", image.split("/")[-1]), \
                f"{name}: image {image} has no tag"
            assert not image.endswith(":latest"), f"{name}: image {image} is not pinned"


@needs_kubectl
def test_the_uid_is_the_images_user(rendered):
    from dockerfile_parse import DockerfileParser

    _, objs = rendered
    user = [i["value"] for i in DockerfileParser(str(DOCKERFILE)).structure
            if i["instruction"] == "USER"][-1]
    assert job_of(objs)["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(user)


@needs_kubectl
def test_etcd_is_three_members_with_a_headless_service_and_a_pdb(rendered):
    _, objs = rendered
    sts = one(objs, "StatefulSet", "etcd")
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    headless = one(objs, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert headless["spec"]["selector"].items() <= labels.items()

    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert re.search(r":v3\.\d+\.\d+$", c["image"]), c["image"]
    args = dict(a.removeprefix("--").split("=", 1) for a in c["args"])
    members = dict(m.split("=", 1) for m in args["initial-cluster"].split(","))
    name, svc = sts["metadata"]["name"], headless["metadata"]["name"]
    assert members == {f"{name}-{i}": f"https://{name}-{i}.{svc}.$(POD_NAMESPACE).svc:2380"
                       for i in range(3)}
    assert args["initial-advertise-peer-urls"] == \
        f"https://$(POD_NAME).{svc}.$(POD_NAMESPACE).svc:2380"
    assert args["auto-compaction-mode"] and args["auto-compaction-retention"]
    assert "enable-v2" not in args
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["path"].startswith("/health"), probe
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] in \
        {m["name"] for m in c["volumeMounts"]}

    pdb = one(objs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


@needs_kubectl
def test_the_agents_reach_etcd_through_its_client_service(rendered):
    _, objs = rendered
    endpoints = pod_env(objs, job_of(objs))["ELASTIC_ETCD"].split(",")
    etcd_labels = one(objs, "StatefulSet", "etcd")["spec"]["template"]["metadata"]["labels"]
    for url in endpoints:
        m = re.fullmatch(r"https://([a-z0-9-]+):(\d+)", url)
        assert m, url
        svc = one(objs, "Service", m.group(1))
        assert int(m.group(2)) in {p["port"] for p in svc["spec"]["ports"]}
        assert svc["spec"]["selector"].items() <= etcd_labels.items()
    # The NetworkPolicy in front of etcd admits the agents.
    policy = one(objs, "NetworkPolicy", "etcd")
    agent_labels = job_of(objs)["spec"]["template"]["metadata"]["labels"]
    admitted = [peer["podSelector"]["matchLabels"] for rule in policy["spec"]["ingress"]
                for peer in rule.get("from", [])]
    assert any(sel.items() <= agent_labels.items() for sel in admitted)


@needs_kubectl
def test_etcd_speaks_tls_and_the_agents_log_in_as_the_jobs_own_user(rendered):
    # An etcd open to all is a way around mutual TLS: control travels through it.
    _, objs = rendered
    sts = one(objs, "StatefulSet", "etcd")
    c = sts["spec"]["template"]["spec"]["containers"][0]
    args = dict(a.removeprefix("--").split("=", 1) for a in c["args"])
    for key in ("listen-client-urls", "listen-peer-urls", "advertise-client-urls"):
        assert args[key].startswith("https://"), key
    assert args["peer-client-cert-auth"] == "true"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    tls_dir = mounts["tls"]
    assert volumes["tls"]["secret"]["secretName"] == "etcd-tls"
    for key in ("cert-file", "key-file", "peer-cert-file", "peer-key-file",
                "peer-trusted-ca-file"):
        assert args[key].startswith(tls_dir + "/"), key

    job = job_of(objs)
    env = pod_env(objs, job)
    auth = one(objs, "Job", "etcd-auth")
    provision = auth["spec"]["template"]["spec"]["containers"][0]
    assert provision["command"][-1] == "elastic.store.provision"
    pargs = dict(a.removeprefix("--").split("=", 1) for a in provision["args"])
    expand = (lambda text: re.sub(r"\$\(([A-Z_]+)\)", lambda m: env[m.group(1)], text))
    assert expand(pargs["user"]) == env["ELASTIC_ETCD_USER"]
    assert expand(pargs["job-id"]) == env["ELASTIC_JOB_ID"]
    assert pargs["etcd"] == env["ELASTIC_ETCD"]
    # The agent mounts the CA and its own password, never the root password.
    pod = job["spec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    agent_mounts = {m["mountPath"]: m["name"] for m in agent_container(job)["volumeMounts"]}
    for var, secret, key in (("ELASTIC_ETCD_CACERT", "etcd-tls", "ca.crt"),
                             ("ELASTIC_ETCD_PASSWORD_FILE", "etcd-auth", "job-password")):
        directory, name = env[var].rsplit("/", 1)
        volume = secrets[agent_mounts[directory]]
        assert volume["secretName"] == secret and name == key
        assert [i["key"] for i in volume["items"]] == [key], volume
        assert volume["defaultMode"] & 0o007 == 0  # not for others
    assert all(i["key"] != "root-password" for v in secrets.values() for i in v.get("items", []))


@needs_kubectl
def test_the_overlay_requests_one_gpu_per_worker_and_sets_storage(overlay):
    job = job_of(overlay)
    env = pod_env(overlay, job)
    resources = agent_container(job)["resources"]
    nproc = int(env["ELASTIC_NPROC_PER_NODE"])
    assert int(resources["requests"]["nvidia.com/gpu"]) == nproc
    assert int(resources["limits"]["nvidia.com/gpu"]) == nproc
    assert one(overlay, "PersistentVolumeClaim", "checkpoints")["spec"]["storageClassName"]
    etcd = one(overlay, "StatefulSet", "etcd")
    assert etcd["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"]
    namespaces = {o["metadata"].get("namespace") for o in overlay if o["kind"] != "Namespace"}
    assert namespaces == {one(overlay, "Namespace")["metadata"]["name"]}
    assert env["ELASTIC_JOB_ID"] != "example"
    assert not agent_container(job)["image"].startswith("registry.example.com/elasticd-train:")


@needs_kubectl
def test_the_rdma_overlay_gives_the_hcas_locked_memory_and_the_example_s_gpus():
    objs = render(K8S / "overlays" / "gpu-rdma")
    job = job_of(objs)
    c = agent_container(job)
    # The example's GPUs and /dev/shm in memory, plus the HCAs (extended resources:
    # requests equal limits).
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert c["resources"]["requests"]["rdma/rdma_shared_device_a"] == \
        c["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    assert {"name": "NCCL_IB_HCA", "value": "mlx5"} in c["env"]
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    # IPC_LOCK is outside the restricted and baseline Pod Security Standards.
    labels = one(objs, "Namespace")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"


@needs_kubectl
def test_the_rdma_overlay_raises_locked_memory_then_runs_the_image_s_entrypoint(tmp_path):
    c = agent_container(job_of(render(K8S / "overlays" / "gpu-rdma")))
    assert c["command"] == ["/bin/sh", "-c"] and len(c["args"]) == 1
    # What the shell gets: the kubelet turns $$ into $ and expands $(VAR) (none here).
    script = c["args"][0].replace("$$", "$")
    assert not re.search(r"(?<!\$)\$\(", c["args"][0]), "a $( ) the kubelet would expand"
    assert script.rstrip().splitlines()[-1] == "exec /usr/bin/tini -- elasticd"
    shell = shutil.which("sh")
    checked = subprocess.run([shell, "-n", "-c", script], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    # Run it with the entrypoint replaced: a limited soft limit is raised to the hard
    # one, and a limited hard one is said in the log.
    dry = script.replace("exec /usr/bin/tini -- elasticd", "ulimit -S -l")
    out = subprocess.run([shell, "-c", f"ulimit -S -l 64 2>/dev/null; {dry}"],
                         capture_output=True, text=True, timeout=10)
    hard = subprocess.run([shell, "-c", "ulimit -H -l"], capture_output=True,
                          text=True).stdout.strip()
    assert out.stdout.strip() == hard
    assert ("locked memory is limited" in out.stderr) == (hard != "unlimited")


@needs_kubectl
def test_every_elastic_variable_in_the_manifests_is_an_option(rendered):
    _, objs = rendered
    names: set[str] = set()
    for o in objs:
        if o["kind"] == "ConfigMap":
            names |= {k for k in o["data"] if k.startswith("ELASTIC_")}
    for _, template in pod_templates(objs):
        for c in template["spec"]["containers"]:
            names |= {e["name"] for e in c.get("env", []) if e["name"].startswith("ELASTIC_")}
    names |= set(ELASTIC_NAME.findall(yaml.safe_dump_all(objs)))
    assert names, "no ELASTIC_* variable found"
    assert names <= known_env(), f"not elasticd options: {sorted(names - known_env())}"


def test_every_kubernetes_file_is_used_by_a_kustomization():
    used: set[Path] = set()
    for k in K8S.rglob("kustomization.yaml"):
        spec = yaml.safe_load(k.read_text())
        entries = list(spec.get("resources", []))
        entries += [p["path"] for p in spec.get("patches", []) if "path" in p]
        entries += [f for g in spec.get("configMapGenerator", []) for f in g.get("envs", [])]
        used |= {(k.parent / e).resolve() for e in entries}
    for f in list(K8S.rglob("*.yaml")) + list(K8S.rglob("*.env")):
        if f.name != "kustomization.yaml":
            assert f.resolve() in used, f"{f.relative_to(ROOT)} is in no kustomization"


# --- systemd ------------------------------------------------------------------------------------


def parse_unit(text: str) -> dict[str, list[tuple[str, str]]]:
    """A unit file's sections as lists of (key, value), repeated keys kept in order."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
            continue
        key, _, value = line.partition("=")
        current.append((key.strip(), value.strip()))
    return sections


def values(unit: dict, section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def value(unit: dict, section: str, key: str) -> str:
    found = values(unit, section, key)
    assert len(found) == 1, f"[{section}] {key}: {found}"
    return found[0]


def verify_unit(text: str, tmp_path: Path) -> list[str]:
    """The problems ``systemd-analyze verify`` reports for ``text`` installed as
    elasticd@test.service. It does not exit non-zero for an unknown directive or a value it
    cannot parse (it says so and ignores the line), so every line that names the unit counts,
    as does a non-zero exit. ExecStart's program must exist: it is swapped for ``true``."""
    true = shutil.which("true")
    text = re.sub(r"^ExecStart=\S+", f"ExecStart={true}", text, flags=re.M)
    path = tmp_path / "elasticd@test.service"
    path.write_text(text)
    out = subprocess.run([SYSTEMD_ANALYZE, "verify", "--man=no", str(path)],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    lines = (out.stdout + out.stderr).splitlines()
    problems = [ln for ln in lines if "elasticd@test.service" in ln]
    if out.returncode != 0:
        problems.append(f"exit status {out.returncode}: {lines}")
    return problems


@needs_systemd_analyze
def test_systemd_analyze_verifies_the_unit(tmp_path):
    assert verify_unit(UNIT.read_text(), tmp_path) == []


@needs_systemd_analyze
@pytest.mark.parametrize("old, new", [
    ("WatchdogSec=", "WatchdogSecs="),                    # a misspelled directive
    ("LimitNOFILE=1048576", "LimitNOFILE=lots"),          # a value it cannot parse
    ("[Service]", "[Servce]"),                            # a misspelled section
])
def test_systemd_analyze_rejects_a_broken_unit(tmp_path, old, new):
    text = UNIT.read_text()
    assert old in text
    assert verify_unit(text.replace(old, new, 1), tmp_path) != []


def test_the_unit_runs_a_notifying_hardened_agent():
    unit = parse_unit(UNIT.read_text())
    s = "Service"
    assert value(unit, s, "Type") == "notify"
    assert value(unit, s, "NotifyAccess") == "main"
    assert 0 < int(value(unit, s, "WatchdogSec")) <= 60
    assert value(unit, s, "User") == "elasticd"
    assert value(unit, s, "StateDirectory") == "elasticd"
    assert value(unit, s, "LimitNOFILE") == "1048576"
    assert value(unit, s, "LimitMEMLOCK") == "infinity"
    assert value(unit, s, "KillMode") == "mixed"
    assert int(value(unit, s, "TimeoutStopSec")) >= 60
    assert value(unit, s, "OOMPolicy") == "continue"
    for key in ("NoNewPrivileges", "PrivateTmp", "ProtectKernelTunables",
                "ProtectControlGroups", "RestrictSUIDSGID", "LockPersonality"):
        assert value(unit, s, key) == "yes", key
    # These would take the GPUs (a device allow-list) or the JIT compilers away.
    for key in ("PrivateDevices", "ProtectClock", "MemoryDenyWriteExecute", "DeviceAllow"):
        assert not values(unit, s, key), key


def test_the_unit_restarts_only_what_a_restart_can_fix():
    unit = parse_unit(UNIT.read_text())
    assert value(unit, "Service", "Restart") == "on-failure"
    prevented = {int(c) for c in value(unit, "Service", "RestartPreventExitStatus").split()}
    assert {EXIT_JOB_FAILED, EXIT_BAD_INPUT} <= prevented
    assert not prevented & {EXIT_STORE, EXIT_INTERNAL}
    assert int(value(unit, "Service", "RestartSec")) > 0
    assert int(value(unit, "Unit", "StartLimitBurst")) > 0
    assert int(value(unit, "Unit", "StartLimitIntervalSec")) > 0


def test_the_unit_reads_its_settings_from_env_files():
    unit = parse_unit(UNIT.read_text())
    files = values(unit, "Service", "EnvironmentFile")
    assert "/etc/elasticd/%i.env" in files                # required: no '-'
    assert "-/etc/elasticd/defaults.env" in files          # optional
    assert files.index("-/etc/elasticd/defaults.env") < files.index("/etc/elasticd/%i.env")
    assert "ELASTIC_JOB_ID=%i" in values(unit, "Service", "Environment")
    argv = shlex.split(value(unit, "Service", "ExecStart"))
    assert argv == ["/opt/elasticd/venv/bin/elasticd"], "no --config, no script: env files"
    names = set(ELASTIC_NAME.findall(" ".join(values(unit, "Service", "Environment"))))
    assert names <= known_env()


def test_the_checkpoint_dir_of_the_example_is_writable_for_the_unit():
    unit = parse_unit(UNIT.read_text())
    if value(unit, "Service", "ProtectSystem") != "strict":
        return
    writable = [p.lstrip("-") for v in values(unit, "Service", "ReadWritePaths")
                for p in v.split()]
    ckpt = read_env_file(EXAMPLE_ENV)["ELASTIC_CHECKPOINT_DIR"]
    assert any(ckpt == w or ckpt.startswith(w.rstrip("/") + "/") for w in writable), ckpt


# --- example.env --------------------------------------------------------------------------------


def read_env_file(path: Path) -> dict[str, str]:
    """A systemd EnvironmentFile's assignments (comments and blank lines skipped)."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, val = line.partition("=")
            assert sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key), line
            env[key] = val
    return env


def test_example_env_names_every_option_and_only_options():
    text = EXAMPLE_ENV.read_text()
    mentioned = set(re.findall(r"^#?\s*(ELASTIC_[A-Z0-9_]+)=", text, flags=re.M))
    assert set(ELASTIC_NAME.findall(text)) <= known_env(), \
        sorted(set(ELASTIC_NAME.findall(text)) - known_env())
    missing = {o.env for o in agent_config.OPTIONS} - mentioned
    assert not missing, f"options example.env does not show: {sorted(missing)}"
    env = read_env_file(EXAMPLE_ENV)
    assert "ELASTIC_JOB_ID" not in env  # the unit's instance name
    assert len(env["ELASTIC_ETCD"].split(",")) == 3


def test_example_env_loads(tmp_path):
    env = read_env_file(EXAMPLE_ENV)
    script = tmp_path / "train.py"
    script.write_text("")
    env.update(ELASTIC_JOB_ID="myjob", ELASTIC_SCRIPT=str(script),
               ELASTIC_ADVERTISE_ADDR="10.0.0.11")
    # etcd over TLS as the job's own user: the files are not here, stand-ins.
    from tests.tls_certs import make_certs

    assert env["ELASTIC_ETCD_CACERT"] and env["ELASTIC_ETCD_PASSWORD_FILE"]
    env["ELASTIC_ETCD_CACERT"] = make_certs(str(tmp_path)).ca
    (tmp_path / "password").write_text("secret\n")
    env["ELASTIC_ETCD_PASSWORD_FILE"] = str(tmp_path / "password")
    cfg = agent_config.load([], env)
    assert all(url.startswith("https://") for url in cfg.etcd.split(","))
    assert cfg.etcd_security.user == "elasticd-myjob"
    assert cfg.drain_exit_code == 0  # systemctl stop leaves the unit inactive, not failed
    assert cfg.listen == "10.0.0.11:29401"  # the advertised address, not every interface
    assert cfg.log_format == "json"
    assert cfg.metrics_port == 29402
    assert cfg.script_args == ("--epochs", "10", "--data", "/data/corpus")


def test_the_docs_name_only_options():
    docs = [*(DEPLOY / "systemd").rglob("*.md"), *K8S.rglob("*.md"), UNIT, DOCKERFILE]
    for doc in docs:
        names = set(ELASTIC_NAME.findall(doc.read_text()))
        assert names <= known_env(), f"{doc.relative_to(ROOT)}: {sorted(names - known_env())}"


# --- Docker -------------------------------------------------------------------------------------


def test_the_dockerfile_runs_elasticd_non_root_under_tini():
    import json

    from dockerfile_parse import DockerfileParser

    steps = [(i["instruction"], i["value"]) for i in DockerfileParser(str(DOCKERFILE)).structure
             if i["instruction"] != "COMMENT"]
    # The base is an ARG declared before the first FROM, with a pinned default, used by FROM.
    first_from = next(n for n, (ins, _) in enumerate(steps) if ins == "FROM")
    args = dict(v.split("=", 1) for ins, v in steps[:first_from] if ins == "ARG")
    assert "BASE_IMAGE" in args
    assert re.search(r":[\w][\w.-]*$", args["BASE_IMAGE"]) and \
        not args["BASE_IMAGE"].endswith(":latest")
    froms = [v.split()[0] for ins, v in steps if ins == "FROM"]
    assert froms and all(f in ("${BASE_IMAGE}", "$BASE_IMAGE") for f in froms)
    assert any(ins == "RUN" and "pip install" in v for ins, v in steps)

    final = steps[max(n for n, (ins, _) in enumerate(steps) if ins == "FROM"):]
    user = [v for ins, v in final if ins == "USER"][-1]
    assert user.isdigit() and int(user) != 0, "a numeric, non-root USER (runAsNonRoot)"
    entrypoint = json.loads([v for ins, v in final if ins == "ENTRYPOINT"][-1])
    assert Path(entrypoint[0]).name == "tini", "tini as PID 1"
    assert entrypoint[entrypoint.index("--") + 1:] == ["elasticd"]
    assert "-g" not in entrypoint, "SIGTERM must reach the agent alone"
    exposed = {p for ins, v in final if ins == "EXPOSE" for p in v.split()}
    assert {"29401", "29402"} <= exposed


def test_the_dockerfile_copies_what_exists_and_is_not_ignored():
    from dockerfile_parse import DockerfileParser

    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv"} <= ignored
    for i in DockerfileParser(str(DOCKERFILE)).structure:
        if i["instruction"] == "COPY" and "--from" not in i["value"]:
            for src in i["value"].split()[:-1]:
                assert (ROOT / src).exists(), src
                assert src not in ignored, f"{src} is copied but .dockerignore'd"
