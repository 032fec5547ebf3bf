"""deploy/kubernetes renders offline, validates strictly, and agrees with the gateway's own config."""

import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from gateway.server.serving import EXIT_GRACE_S
from gateway.settings import Settings, load_settings, parse_settings
from tests.deploy.manifests import KUBERNETES, ROOT, only, render

KUSTOMIZATIONS = [".", "overlays/keda", "overlays/redis", "kueue"]
GATEWAY_KUSTOMIZATIONS = [".", "overlays/keda", "overlays/redis"]
# The oldest Kubernetes these manifests claim to support, and the newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]
BUILT_IN = {"ConfigMap", "Service", "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget"}
TYPED_CRDS = {"ServiceMonitor", "ScaledObject"}
KUEUE_KINDS = {"ResourceFlavor", "ClusterQueue", "LocalQueue", "WorkloadPriorityClass"}
KUEUE_SCHEMA = json.loads((Path(__file__).parent / "schemas" / "kueue-v1beta1.json").read_text())
CONFIG_MOUNT = "/etc/inference-gateway"


def gateway_settings(kustomization: str) -> Settings:
    config_map = only(render(kustomization), "ConfigMap")
    return parse_settings(yaml.safe_load(config_map["data"]["gateway.yaml"]), f"{kustomization} ConfigMap")


def gateway_container(kustomization: str) -> dict:
    pod = only(render(kustomization), "Deployment", "inference-gateway")["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "gateway")


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_rendered_object_is_of_a_kind_the_tests_validate(kustomization):
    kinds = {o["kind"] for o in render(kustomization)}
    assert kinds, f"{kustomization} rendered nothing"
    assert kinds <= BUILT_IN | TYPED_CRDS | KUEUE_KINDS, kinds


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("kustomization", GATEWAY_KUSTOMIZATIONS)
def test_built_in_objects_validate_strictly(kustomization, version):
    for obj in render(kustomization):
        if obj["kind"] in BUILT_IN:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as error:  # its own message prints the schema
                where = "/".join(str(p) for p in error.absolute_path)
                pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: {where}: {error.message}")


@pytest.mark.parametrize("kustomization", GATEWAY_KUSTOMIZATIONS)
def test_servicemonitor_and_scaledobject_validate_against_their_typed_models(kustomization):
    # Imported here: the typed models take about 5 s to import, which every run of the suite paid
    # when collecting this module, the fast tier included.
    from cloudcoil.models.keda.v1alpha1 import ScaledObject
    from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor

    typed = {"ServiceMonitor": ServiceMonitor, "ScaledObject": ScaledObject}
    assert set(typed) == TYPED_CRDS
    for obj in render(kustomization):
        model = typed.get(obj["kind"])
        if model is not None:
            parsed = model.model_validate(obj)
            # The models ignore unknown fields: a field they dropped is a typo or not in the CRD.
            assert parsed.model_dump(by_alias=True, exclude_unset=True, mode="json") == obj


def test_kueue_objects_match_the_v1beta1_schema():
    objects = render("kueue")
    assert {o["kind"] for o in objects} == KUEUE_KINDS
    for obj in objects:
        jsonschema.validate(obj, KUEUE_SCHEMA, cls=jsonschema.Draft202012Validator)


def test_kueue_schema_refuses_a_misspelt_field():
    queue = dict(only(render("kueue"), "ClusterQueue"))
    queue["spec"] = {**queue["spec"], "queueingStrategyy": "StrictFIFO"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(queue, KUEUE_SCHEMA, cls=jsonschema.Draft202012Validator)


def test_kueue_queues_and_flavors_refer_to_each_other():
    objects = render("kueue")
    cluster_queue = only(objects, "ClusterQueue")
    flavors = {o["metadata"]["name"] for o in objects if o["kind"] == "ResourceFlavor"}
    for group in cluster_queue["spec"]["resourceGroups"]:
        for flavor in group["flavors"]:
            assert flavor["name"] in flavors
            # Kueue requires each flavor to list the covered resources, in the same order.
            assert [r["name"] for r in flavor["resources"]] == group["coveredResources"]
    for local in (o for o in objects if o["kind"] == "LocalQueue"):
        assert local["spec"]["clusterQueue"] == cluster_queue["metadata"]["name"]


def test_the_sample_config_and_the_cluster_configs_are_valid_gateway_configs():
    load_settings(ROOT / "deploy" / "config" / "gateway.yaml")
    load_settings(KUBERNETES / "base" / "gateway.yaml")
    load_settings(KUBERNETES / "overlays" / "redis" / "gateway.yaml")


@pytest.mark.parametrize("kustomization", GATEWAY_KUSTOMIZATIONS)
def test_the_config_map_holds_a_valid_gateway_config_listening_on_the_container_port(kustomization):
    settings = gateway_settings(kustomization)
    ports = {p["name"]: p["containerPort"] for p in gateway_container(kustomization)["ports"]}
    assert settings.listen.host == "0.0.0.0"
    assert settings.listen.port == ports["http"]
    assert settings.admin_listen is not None and settings.admin_listen.port == ports["admin"]


@pytest.mark.parametrize("kustomization", GATEWAY_KUSTOMIZATIONS)
def test_the_gateway_serves_the_config_mounted_from_the_generated_config_map(kustomization):
    objects = render(kustomization)
    container = gateway_container(kustomization)
    assert container["command"] == ["inference-gateway", "serve", "--config", f"{CONFIG_MOUNT}/gateway.yaml"]
    pod = only(objects, "Deployment", "inference-gateway")["spec"]["template"]["spec"]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == CONFIG_MOUNT)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == only(objects, "ConfigMap")["metadata"]["name"]
    assert mount["readOnly"] is True


def test_probes_ask_healthz_for_liveness_and_readyz_for_readiness_on_the_admin_port():
    container = gateway_container(".")
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}


def test_the_pod_runs_as_non_root_on_a_read_only_root_filesystem_with_resources():
    pod = only(render("."), "Deployment", "inference-gateway")["spec"]["template"]["spec"]
    container = gateway_container(".")
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert "memory" in container["resources"]["limits"]


@pytest.mark.parametrize("kustomization", GATEWAY_KUSTOMIZATIONS)
def test_the_grace_period_outlasts_the_pre_stop_pause_and_the_drain(kustomization):
    pod = only(render(kustomization), "Deployment", "inference-gateway")["spec"]["template"]["spec"]
    pause_s = int(gateway_container(kustomization)["lifecycle"]["preStop"]["exec"]["command"][1])
    drain_s = gateway_settings(kustomization).shutdown.drain_timeout_ms / 1000
    assert pod["terminationGracePeriodSeconds"] > pause_s + drain_s + EXIT_GRACE_S


def test_service_servicemonitor_and_pdb_select_the_gateway_pods():
    objects = render(".")
    pod_labels = only(objects, "Deployment", "inference-gateway")["spec"]["template"]["metadata"]["labels"]
    service = only(objects, "Service", "inference-gateway")
    admin = only(objects, "Service", "inference-gateway-admin")
    monitor = only(objects, "ServiceMonitor")
    pdb = only(objects, "PodDisruptionBudget")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert admin["spec"]["selector"].items() <= pod_labels.items()
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    selected = [
        s["metadata"]["name"]
        for s in objects
        if s["kind"] == "Service"
        and monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
    ]
    assert selected == ["inference-gateway-admin"]
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in admin["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"


def test_the_client_service_does_not_expose_the_admin_port():
    service = only(render("."), "Service", "inference-gateway")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]


def test_the_hpa_scales_the_model_server_on_the_gateways_desired_replicas():
    hpa = only(render("."), "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "model-server",
    }
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["name"] == "gateway_desired_replicas"
    # An average of 1 per replica makes the HPA want exactly the gateway's count.
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    models = {m.name for m in gateway_settings(".").models}
    assert metric["external"]["metric"]["selector"]["matchLabels"]["model"] in models


def test_prometheus_adapter_serves_the_metric_the_hpa_reads():
    rules = yaml.safe_load((KUBERNETES / "prometheus-adapter" / "rules.yaml").read_text())
    hpa = only(render("."), "HorizontalPodAutoscaler")
    wanted = hpa["spec"]["metrics"][0]["external"]["metric"]["name"]
    [rule] = [r for r in rules["externalRules"] if r["name"]["as"] == wanted]
    assert wanted in rule["seriesQuery"]
    assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]
    assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}


def test_the_keda_overlay_replaces_the_hpa_with_a_scaled_object_on_the_same_metric():
    base, keda = render("."), render("overlays/keda")
    assert not [o for o in base if o["kind"] == "ScaledObject"]
    assert not [o for o in keda if o["kind"] == "HorizontalPodAutoscaler"]
    scaled = only(keda, "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "model-server"
    [trigger] = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["threshold"] == "1"
    assert 'gateway_desired_replicas{model="resnet50"}' in trigger["metadata"]["query"]


def test_the_redis_overlay_changes_only_the_store_and_runs_as_many_gateways_as_it_says():
    base, shared = gateway_settings("."), gateway_settings("overlays/redis")
    assert base.store.kind == "memory"
    assert shared.store.kind == "redis" and shared.store.url == "redis://redis:6379/0"
    assert shared.model_copy(update={"store": base.store}) == base
    gateways = only(render("overlays/redis"), "Deployment", "inference-gateway")
    assert gateways["spec"]["replicas"] == shared.store.replicas == 3
    redis_service = only(render("overlays/redis"), "Service", "redis")
    assert redis_service["spec"]["ports"][0]["port"] == 6379
