"""deploy/: the compose file, its Prometheus config, the Dockerfile and the Kubernetes manifests agree with
each other and with what the services accept, checked without Docker or a cluster.

Each kvmesh container's command and KVMESH_* variables go through `kvmesh serve SERVICE ... --check`
(in this process, with exactly the container's KVMESH_* variables: the same parser and the same
unknown-setting check a container runs, without paying a torch import per container).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from kvmesh import cli
from kvmesh.services import config

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
CONFIG_CLASSES = {"router": config.RouterConfig, "scheduler": config.SchedulerServiceConfig,
                  "kvcache": config.KVCacheServiceConfig, "worker": config.WorkerConfig}
# What the third-party images listen on (their defaults).
IMAGE_PORTS = {"redis": {6379}, "jaegertracing/all-in-one": {4317, 4318, 14269, 16686}, "prom/prometheus": {9090}}
PUBLISHED = {"router": {50051, 8000}, "jaeger": {16686}, "prometheus": {9090}}


# ---- helpers ----------------------------------------------------------------------------------------------

def serve_check(service: str, args: list[str], env: dict[str, str]):
    """`kvmesh serve SERVICE ARGS --check` with `env` as the only KVMESH_* variables; fails the test
    with kvmesh's own message when it exits non-zero. Returns the (common, service) configs."""
    command = ["serve", service, *args]
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("KVMESH_")]:
            mp.delenv(key)
        for key, value in env.items():
            mp.setenv(key, str(value))
        # Model folders are the container's mounts, absent here; everything else is checked as a container would.
        mp.setattr(config, "check_checkpoint_folder", lambda field, folder: None)
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                code = cli.main([*command, "--check"])
            except SystemExit as e:  # argparse: an unknown flag or a bad value
                code = e.code
        assert code == 0, f"kvmesh {shlex.join(command)} --check with {env}: {err.getvalue().strip()}"
        parsed = cli.build_parser().parse_args(command)
        return config.from_args(config.CommonConfig, parsed), config.from_args(CONFIG_CLASSES[service], parsed)


def served_ports(cfg) -> tuple[int, int]:
    """(gRPC port, the HTTP port serving /metrics) of a service config."""
    return cfg.port, cfg.http_port if isinstance(cfg, config.RouterConfig) else cfg.metrics_port


def image_env() -> dict[str, str]:
    """The KVMESH_* variables the Dockerfile's ENV sets: every container has them."""
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    env = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            for word in shlex.split(line[4:]):
                key, _, value = word.partition("=")
                if key.startswith("KVMESH_"):
                    env[key] = value
    return env


def kvmesh_env(env: dict) -> dict[str, str]:
    return {**image_env(), **{k: str(v) for k, v in env.items() if k.startswith("KVMESH_")}}


def host_port(address: str) -> tuple[str, int]:
    parts = urlsplit(address if "://" in address else f"//{address}")
    return parts.hostname, parts.port


def seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration))


# ---- compose ----------------------------------------------------------------------------------------------

def interpolate(value):
    """Compose's ${VAR:-default} becomes the default; ${VAR} and ${VAR:?error} a placeholder."""
    if isinstance(value, str):
        return re.sub(r"\$\{(\w+)(?::-([^}]*)|:\?[^}]*)?\}", lambda m: m.group(2) or f"/{m.group(1).lower()}", value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


def load_compose(*overrides: str) -> dict:
    """docker-compose.yml with override files merged as compose does for environment and volumes."""
    compose = interpolate(yaml.safe_load((DEPLOY / "docker-compose.yml").read_text()))
    for name in overrides:
        for service, extra in interpolate(yaml.safe_load((DEPLOY / name).read_text()))["services"].items():
            svc = compose["services"][service]
            svc["environment"] = {**svc.get("environment", {}), **extra.get("environment", {})}
            targets = {v.split(":")[1]: v for v in [*svc.get("volumes", []), *extra.get("volumes", [])]}
            svc["volumes"] = list(targets.values())
    return compose


COMPOSE = load_compose()
SERVICES = COMPOSE["services"]
KVMESH_SERVICES = sorted(name for name, svc in SERVICES.items() if svc.get("image", "").startswith("kvmesh:"))


def compose_check(svc: dict):
    kind, *args = svc["command"][1:]
    return serve_check(kind, args, kvmesh_env(svc.get("environment", {})))


@pytest.fixture(scope="module")
def compose_configs():
    return {name: compose_check(SERVICES[name]) for name in KVMESH_SERVICES}


def listening_ports(name: str, compose_configs) -> set[int]:
    if name in compose_configs:
        return set(served_ports(compose_configs[name][1]))
    return IMAGE_PORTS[SERVICES[name]["image"].rsplit(":", 1)[0]]


def networks(name: str) -> set[str]:
    return set(SERVICES[name].get("networks", ["default"]))


def published_ports(svc: dict) -> set[tuple[int, int]]:
    """(host port, container port) pairs, short or long syntax."""
    pairs = set()
    for spec in svc.get("ports", []):
        if isinstance(spec, dict):
            pairs.add((int(spec["published"]), int(spec["target"])))
        else:
            *host, container = str(spec).split(":")
            pairs.add((int(host[-1]), int(container.split("/")[0])))
    return pairs


def test_the_checker_rejects_an_unknown_setting():
    with pytest.raises(AssertionError, match="unknown setting KVMESH_KV_MEMORY"):
        serve_check("worker", [], {"KVMESH_KV_MEMORY": "1GiB"})
    with pytest.raises(AssertionError, match="--check with"):
        serve_check("worker", ["--no-such-flag"], {})


def test_every_compose_service_command_and_environment_pass_kvmesh_serve_check(compose_configs):
    assert set(KVMESH_SERVICES) == {"router", "scheduler", "kvcache", "worker"}
    for name in KVMESH_SERVICES:
        assert SERVICES[name]["command"][:2] == ["serve", name]
        assert name in compose_configs


def test_only_router_jaeger_and_prometheus_publish_ports_each_on_its_own_number(compose_configs):
    published = {name: published_ports(svc) for name, svc in SERVICES.items() if svc.get("ports")}
    assert {name: {c for _, c in pairs} for name, pairs in published.items()} == PUBLISHED
    for name, pairs in published.items():
        assert all(h == c for h, c in pairs), f"{name} publishes {pairs}"
        assert {c for _, c in pairs} <= listening_ports(name, compose_configs)


def test_services_without_published_ports_sit_only_on_the_internal_network():
    internal = {n for n, net in COMPOSE["networks"].items() if (net or {}).get("internal")}
    assert internal
    for name, svc in SERVICES.items():
        if svc.get("ports"):
            assert networks(name) - internal, f"{name} publishes ports but has no outside network"
        else:
            assert networks(name) <= internal, f"{name} is on {networks(name) - internal}"


def test_every_address_a_service_dials_is_a_service_listening_on_that_port(compose_configs):
    for name in KVMESH_SERVICES:
        env = SERVICES[name]["environment"]
        common = compose_configs[name][0]
        for address in [common.redis_url, env.get("OTEL_EXPORTER_OTLP_ENDPOINT")]:
            assert address, f"{name} has no Redis URL or OTLP endpoint"
            host, port = host_port(address)
            assert host in SERVICES, f"{name} dials {address}: no service {host}"
            assert port in listening_ports(host, compose_configs), f"{name} dials {address}: {host} is not on {port}"
            assert networks(name) & networks(host), f"{name} and {host} share no network"


def test_kvmesh_services_listen_on_all_interfaces_and_advertise_their_container_hostname(compose_configs):
    for name in KVMESH_SERVICES:
        common, _ = compose_configs[name]
        assert common.host == "0.0.0.0" and common.advertise_host == "", name
        assert "hostname" not in SERVICES[name] and "container_name" not in SERVICES[name], name


def test_workers_scale_freely_two_by_default():
    worker = SERVICES["worker"]
    assert worker["deploy"]["replicas"] >= 2
    assert not worker.get("ports") and "container_name" not in worker and "hostname" not in worker


def test_health_checks_call_kvmesh_health_on_the_service_grpc_port(compose_configs):
    for name in KVMESH_SERVICES:
        port = compose_configs[name][1].port
        assert SERVICES[name]["healthcheck"]["test"] == ["CMD", "kvmesh", "health", f"127.0.0.1:{port}"], name
    assert "redis-cli ping" in " ".join(SERVICES["redis"]["healthcheck"]["test"])


def test_workers_and_router_get_time_to_load_the_model_before_health_counts():
    assert seconds(SERVICES["worker"]["healthcheck"]["start_period"]) >= 120
    assert seconds(SERVICES["router"]["healthcheck"]["start_period"]) >= 60


def test_services_wait_for_their_dependencies_to_be_healthy():
    for name, svc in SERVICES.items():
        for dep, spec in (svc.get("depends_on") or {}).items():
            assert dep in SERVICES, f"{name} depends on a missing {dep}"
            if spec["condition"] == "service_completed_successfully":
                assert SERVICES[dep].get("restart", "no") == "no", f"{dep} is not a one-shot service"
            else:
                assert spec["condition"] == "service_healthy", f"{name} -> {dep}: {spec}"
                assert "healthcheck" in SERVICES[dep], f"{name} waits for {dep}, which has no health check"


def test_the_router_starts_after_redis_kvcache_scheduler_and_workers():
    def upstream(name: str) -> set[str]:
        deps = set(SERVICES[name].get("depends_on") or {})
        return deps.union(*(upstream(d) for d in deps))

    assert {"redis", "kvcache", "scheduler", "worker"} <= upstream("router")
    assert "redis" in upstream("worker") and "kvcache" in upstream("scheduler")


def test_redis_never_evicts_and_keeps_an_append_only_file_on_a_named_volume():
    redis = SERVICES["redis"]
    command = " ".join(redis["command"])
    assert "--maxmemory-policy noeviction" in command and "--appendonly yes" in command
    volume = next(v.split(":")[0] for v in redis["volumes"] if v.split(":")[1] == "/data")
    assert volume in COMPOSE["volumes"]


def test_prometheus_scrapes_every_kvmesh_service_on_its_metrics_port(compose_configs):
    prometheus = SERVICES["prometheus"]
    mount = next(v for v in prometheus["volumes"] if v.startswith("./prometheus.yml:"))
    assert mount.split(":")[1] in " ".join(prometheus["command"])
    scraped = {}
    for job in yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"]:
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = host_port(target)
                scraped[host] = port
        for dns in job.get("dns_sd_configs", []):
            assert dns["type"] == "A"  # compose DNS answers a service name with every replica's address
            scraped.update({name: dns["port"] for name in dns["names"]})
    assert set(scraped) == set(KVMESH_SERVICES)
    for name, port in scraped.items():
        assert port == served_ports(compose_configs[name][1])[1], f"{name} serves /metrics elsewhere"


def test_router_and_workers_share_the_model_cache_volume_where_the_image_keeps_it():
    cache = image_env()["KVMESH_CACHE"]
    mounts = {name: {v.split(":")[1]: v.split(":")[0] for v in SERVICES[name].get("volumes", [])}
              for name in ("router", "worker")}
    assert mounts["router"][cache] == mounts["worker"][cache] and mounts["router"][cache] in COMPOSE["volumes"]


def test_a_host_model_folder_override_serves_it_on_router_and_workers():
    services = load_compose("docker-compose.model.yml")["services"]
    for name in ("router", "worker"):
        _, cfg = compose_check(services[name])
        mounted = {v.split(":")[1]: v for v in services[name]["volumes"]}
        assert cfg.model in mounted and mounted[cfg.model].endswith(":ro"), name
    assert services["router"]["volumes"] != SERVICES["router"]["volumes"]

    # The pool clients ask for is the one the workers serve and the scheduler batches.
    router, worker, scheduler = (compose_check(services[n])[1] for n in ("router", "worker", "scheduler"))
    assert router.model_name == worker.pool == scheduler.pool


def test_compose_paths_resolve_from_the_compose_folder():
    for name in KVMESH_SERVICES:
        build = SERVICES[name]["build"]
        context = (DEPLOY / build["context"]).resolve()
        assert context == ROOT and (context / build["dockerfile"]) == DEPLOY / "Dockerfile"
    for svc in SERVICES.values():
        for volume in svc.get("volumes", []):
            if volume.startswith("."):
                assert (DEPLOY / volume.split(":")[0]).exists(), volume


# ---- Dockerfile -------------------------------------------------------------------------------------------

def test_the_image_runs_kvmesh_as_a_numeric_non_root_user():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["kvmesh"\]$', text, re.M)
    user = re.findall(r"^USER (\S+)$", text, re.M)[-1]
    assert user.isdigit() and int(user) > 0


def test_the_image_pins_the_torch_the_makefile_installs_and_selects_cuda_by_build_argument():
    text = (DEPLOY / "Dockerfile").read_text()
    makefile_pin = re.search(r"^TORCH_CPU \?= torch==(\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert re.search(rf"^ARG TORCH_VERSION={re.escape(makefile_pin)}$", text, re.M)
    assert re.search(r"^ARG BASE=python:3\.11-slim$", text, re.M) and re.search(r"^FROM \$\{BASE\}$", text, re.M)
    assert re.search(r"^ARG EXTRAS=structured$", text, re.M) and "${EXTRAS:+[${EXTRAS}]}" in text  # structured output by default


def test_the_build_context_admits_exactly_what_the_image_copies():
    copied = {src for line in (DEPLOY / "Dockerfile").read_text().splitlines() if line.startswith("COPY ")
              for src in line.split()[1:-1] if not src.startswith("--")}
    ignore = [line for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
              if line and not line.startswith("#")]
    assert ignore[0] == "*"
    assert {line[1:] for line in ignore if line.startswith("!")} == copied
    assert all((ROOT / src).exists() for src in copied)


# ---- Kubernetes -------------------------------------------------------------------------------------------

def merge(base, patch):
    """Strategic merge as far as these manifests need: maps deep, lists of named maps by name."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**base, **{k: merge(base[k], v) if k in base else v for k, v in patch.items()}}
    named_maps = isinstance(base, list) and isinstance(patch, list)
    if named_maps and all(isinstance(x, dict) and "name" in x for x in base + patch):
        patched = {x["name"]: x for x in patch}
        return [merge(x, patched.pop(x["name"])) if x["name"] in patched else x for x in base] + list(patched.values())
    return patch


def load_kustomization(folder: Path) -> list[dict]:
    """Without kubectl: the documents a kustomization's resources list, with its patches applied."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    docs = []
    for resource in kustomization.get("resources", []):
        path = folder / resource
        docs += load_kustomization(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in kustomization.get("patches", []):
        p = yaml.safe_load((folder / patch["path"]).read_text())
        docs = [merge(d, p) if (d["kind"], d["metadata"]["name"]) == (p["kind"], p["metadata"]["name"]) else d
                for d in docs]
    return docs


def render(folder: Path) -> list[dict]:
    if shutil.which("kubectl"):
        out = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return [d for d in yaml.safe_load_all(out.stdout) if d]
    return load_kustomization(folder)


@pytest.fixture(scope="module", params=["base", "gpu"])
def manifests(request):
    return render(K8S if request.param == "base" else K8S / "overlays" / "gpu")


@pytest.fixture(scope="module")
def gpu_manifests():
    return render(K8S / "overlays" / "gpu")


def of_kind(docs, *kinds):
    return [d for d in docs if d["kind"] in kinds]


def named(docs, kind, name):
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def pod_specs(docs):
    """(workload name, pod template) of every Deployment and StatefulSet."""
    return [(d["metadata"]["name"], d["spec"]["template"]) for d in of_kind(docs, "Deployment", "StatefulSet")]


def container_ports(template) -> dict:
    """Port name and number -> number, over the pod's containers."""
    ports = {}
    for container in template["spec"]["containers"]:
        for p in container.get("ports", []):
            ports[p["containerPort"]] = p["containerPort"]
            if "name" in p:
                ports[p["name"]] = p["containerPort"]
    return ports


def kvmesh_containers(docs):
    """(pod template, container, service kind) for every container running the kvmesh image."""
    return [(t, c, c["args"][1]) for _, t in pod_specs(docs) for c in t["spec"]["containers"]
            if c["image"].split(":")[0] == "kvmesh"]


def container_env(docs, container) -> dict[str, str]:
    """What the container sees: ConfigMaps it loads, then literal env; downward-API values get placeholders."""
    env = {}
    for source in container.get("envFrom", []):
        env.update(named(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var["valueFrom"]:
            env[var["name"]] = "10.0.0.7"  # a pod IP
        elif "resourceFieldRef" in var["valueFrom"]:
            env[var["name"]] = "2"  # a CPU count
    return env


def k8s_check(docs, container, kind):
    assert container["args"][0] == "serve"
    return serve_check(kind, container["args"][2:], kvmesh_env(container_env(docs, container)))


def test_every_kvmesh_container_passes_kvmesh_serve_check_with_its_environment(manifests):
    kinds = []
    for _, container, kind in kvmesh_containers(manifests):
        k8s_check(manifests, container, kind)
        kinds.append(kind)
    assert sorted(kinds) == ["kvcache", "router", "scheduler", "worker"]


def test_kvmesh_pods_listen_on_all_interfaces_and_advertise_their_pod_ip(manifests):
    for template, container, kind in kvmesh_containers(manifests):
        common, _ = k8s_check(manifests, container, kind)
        assert common.host == "0.0.0.0"
        advertise = next(v for v in container["env"] if v["name"] == "KVMESH_ADVERTISE_HOST")
        assert advertise["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", kind
        # Kubernetes' Service variables (KVMESH_..._PORT for a Service named kvmesh-...) would be unknown settings.
        assert template["spec"]["enableServiceLinks"] is False, kind


def test_kvmesh_containers_expose_their_grpc_and_metrics_ports_and_probe_grpc_health(manifests):
    for template, container, kind in kvmesh_containers(manifests):
        _, cfg = k8s_check(manifests, container, kind)
        grpc_port, metrics_port = served_ports(cfg)
        assert {grpc_port, metrics_port} <= set(container_ports(template).values()), kind
        assert container["readinessProbe"]["grpc"]["port"] == grpc_port, kind
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == str(metrics_port)
        if kind != "router":
            assert container["livenessProbe"]["grpc"]["port"] == grpc_port, kind
        assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]


def test_router_liveness_does_not_depend_on_workers_being_ready(manifests):
    router = next(c for _, c, kind in kvmesh_containers(manifests) if kind == "router")
    assert router["livenessProbe"]["httpGet"]["path"] == "/health"


def test_workers_have_minutes_to_load_weights_before_liveness_counts(manifests):
    worker = next(c for _, c, kind in kvmesh_containers(manifests) if kind == "worker")
    startup = worker["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


def test_every_probe_targets_a_port_its_container_declares(manifests):
    for name, template in pod_specs(manifests):
        ports = container_ports(template)
        for container in template["spec"]["containers"]:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                spec = container.get(probe, {})
                for handler in ("grpc", "httpGet", "tcpSocket"):
                    if handler in spec:
                        assert spec[handler]["port"] in ports, f"{name} {probe} port {spec[handler]['port']}"


def test_every_service_selects_pods_that_declare_its_target_ports(manifests):
    for service in of_kind(manifests, "Service"):
        selector = service["spec"]["selector"]
        pods = [t for _, t in pod_specs(manifests) if selector.items() <= t["metadata"]["labels"].items()]
        assert len(pods) == 1, f"Service {service['metadata']['name']} selects {len(pods)} workloads"
        for port in service["spec"]["ports"]:
            assert port.get("targetPort", port["port"]) in container_ports(pods[0]), (service["metadata"]["name"], port)


def test_the_router_service_offers_grpc_50051_and_http_8000(manifests):
    assert {p["port"] for p in named(manifests, "Service", "router")["spec"]["ports"]} == {50051, 8000}


def test_shared_settings_point_at_services_on_their_ports(manifests):
    data = named(manifests, "ConfigMap", "kvmesh-config")["data"]
    for address in (data["KVMESH_REDIS_URL"], data["OTEL_EXPORTER_OTLP_ENDPOINT"]):
        host, port = host_port(address)
        assert port in {p["port"] for p in named(manifests, "Service", host)["spec"]["ports"]}, address


def test_redis_never_evicts_and_keeps_its_data_on_a_volume(manifests):
    redis = named(manifests, "StatefulSet", "redis")
    container = redis["spec"]["template"]["spec"]["containers"][0]
    assert "--maxmemory-policy noeviction" in " ".join(container["args"])
    claims = {v["metadata"]["name"] for v in redis["spec"]["volumeClaimTemplates"]}
    assert next(m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/data") in claims


def test_workers_autoscale_on_the_estimated_token_queue(manifests):
    hpa = named(manifests, "HorizontalPodAutoscaler", "worker")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "worker")
    named(manifests, "Deployment", "worker")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External" and metric["external"]["metric"]["name"] == "kvmesh_estimated_token_queue"
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def gpu_limits(docs) -> dict[str, object]:
    return {name: c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
            for name, t in pod_specs(docs) for c in t["spec"]["containers"]}


def test_the_gpu_overlay_gives_each_worker_a_gpu_and_the_cuda_image(gpu_manifests):
    limits = gpu_limits(gpu_manifests)
    assert limits.pop("worker") == 1 and not any(limits.values())
    worker = named(gpu_manifests, "Deployment", "worker")["spec"]["template"]["spec"]["containers"][0]
    assert worker["image"] == "kvmesh:cuda"
    env = {e["name"]: e for e in worker["env"]}
    assert env["KVMESH_DEVICE"]["value"] == "cuda" and "KVMESH_ADVERTISE_HOST" in env  # merged, not replaced
    assert not any(gpu_limits(render(K8S)).values())
