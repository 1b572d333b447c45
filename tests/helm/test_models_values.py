"""The chart's `models` value (issue 37): model files from a PersistentVolumeClaim, a hostPath or an image an
init container copies from, mounted read-only where the endpoint and every target read them. The ci/ files
also run the whole matrix of tests/helm/test_rendered.py (lint, Kubernetes schemas, Pod Security)."""

from __future__ import annotations

import pytest
import yaml

from tests.helm.test_rendered import (
    CHART,
    KUBE_VERSIONS,
    helm,  # noqa: F401 (the fixture)
    merge,
    pod_specs,
    pss_restricted_violations,
    template,
)

EXAMPLES = {"ci/models-pvc-values.yaml": "persistentVolumeClaim", "ci/models-image-values.yaml": "emptyDir",
            "ci/qwen-coder-pair-values.yaml": "persistentVolumeClaim",
            "examples/models-hostpath-values.yaml": "hostPath"}


def _render(helm_path, *args: str) -> list[dict]:
    result = template(helm_path, *args)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.mark.parametrize("values, volume_kind", EXAMPLES.items())
def test_each_models_source_mounts_the_files_where_servers_read_them(helm, values, volume_kind):  # noqa: F811
    import jsonschema

    over = yaml.safe_load((CHART / values).read_text())
    schema = yaml.safe_load((CHART / "values.schema.json").read_text())
    merged = merge(yaml.safe_load((CHART / "values.yaml").read_text()), over)
    assert not [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(merged)]
    docs = _render(helm, "-f", str(CHART / values))
    pods = {name: spec for name, _, spec in pod_specs(docs)}
    servers = {n: s for n, s in pods.items() if "-target-" in n or n.endswith("-spec")}
    assert len(servers) == len(over["targets"]) + 1
    for name, spec in servers.items():
        [volume] = [v for v in spec["volumes"] if v["name"] == "models"]
        assert volume_kind in volume, name
        [mount] = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "models"]
        assert mount == {"name": "models", "mountPath": "/models", "readOnly": True}, name
        args = " ".join(spec["containers"][0]["args"])
        assert "=/models/" in args, (name, args)  # --model=/models/... or --drafter=...=/models/...
        if volume_kind == "emptyDir":  # the init container fills the same volume before the server starts
            [init] = spec["initContainers"]
            assert init["image"] == "registry.example.com/specpool-models:qwen2.5-7b-q4km"
            assert init["command"] == ["cp", "-R", "/models/.", "/models-copy/"]
            assert init["volumeMounts"] == [{"name": "models", "mountPath": "/models-copy"}]
    assert all("models" not in {v["name"] for v in s.get("volumes", [])} for n, s in pods.items() if n not in servers)


def test_the_hostpath_example_validates_and_is_outside_restricted_only_by_its_volume(helm):  # noqa: F811
    import kubernetes_validate

    docs = _render(helm, "-f", str(CHART / "examples/models-hostpath-values.yaml"))
    for o in docs:
        try:
            kubernetes_validate.validate(o, KUBE_VERSIONS[-1], strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            pass
    for name, metadata, spec in pod_specs(docs):
        violations = pss_restricted_violations(metadata, spec)
        assert violations in ([], ["volume models: ['hostPath'] (hostPath and the like)"]), (name, violations)


@pytest.mark.parametrize("settings, says", [
    (["models.source=pvc"], "models.source pvc needs models.pvc.claimName"),
    (["models.source=hostPath"], "models.source hostPath needs models.hostPath.path"),
    (["models.source=image"], "models.source image needs models.image.repository"),
    (["models.source=nfs"], "/models/source"),  # the schema's enum
])
def test_a_models_source_without_its_settings_fails_naming_the_value(helm, settings, says):  # noqa: F811
    result = template(helm, *[arg for s in settings for arg in ("--set", s)])
    assert result.returncode != 0 and says in result.stderr, result.stderr
