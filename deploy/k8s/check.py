"""Checks a rendered overlay (kubectl kustomize) for what the schemas cannot say.

    python check.py OVERLAY RENDERED.yaml [PLAIN.yaml]

OVERLAY is the overlay's directory name: `cpu`, `gpu`, or one ending in `-keda` (the keda
component applied), for which PLAIN.yaml is the overlay it builds on, rendered (its HPA's
target must equal the ScaledObject's threshold). Prints a summary (one line), or every problem found and exits 1. Run by
validate.sh with the venv's Python (PyYAML comes with kubernetes-validate).
"""

import pathlib
import sys

import yaml

QUEUE_METRIC = "lipsync_queue_seconds_interactive_live"
# The shortest start-up (warm-up, and on CUDA the cuDNN search) the startupProbe must allow.
MIN_STARTUP_S = {"cpu": 120, "gpu": 600}

problems = []


def check(ok, what):
    if not ok:
        problems.append(what)
    return ok


def of_kind(objs, kind):
    return [o for o in objs if o.get("kind") == kind]


def by_name(items):
    return {i.get("name"): i for i in items or []}


def number(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def check_deployment(dep, device):
    spec = dep["spec"]["template"]["spec"]
    pod_labels = dep["spec"]["template"]["metadata"].get("labels", {})
    selector = dep["spec"]["selector"].get("matchLabels", {})
    check(
        selector and selector.items() <= pod_labels.items(),
        "Deployment: selector does not match the pod labels",
    )
    check("replicas" not in dep["spec"], "Deployment: spec.replicas set (the autoscaler owns it)")
    containers = by_name(spec.get("containers"))
    if not check("lipsync" in containers, "Deployment: no container named lipsync"):
        return None
    c = containers["lipsync"]
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    check(
        len(env) == len(c.get("env", [])), "Deployment: an environment variable is set twice"
    )

    # Probes.
    def probe_path(name):
        return ((c.get(name) or {}).get("httpGet") or {}).get("path")

    check(probe_path("startupProbe") == "/ready", "startupProbe is not GET /ready")
    check(probe_path("readinessProbe") == "/ready", "readinessProbe is not GET /ready")
    check(probe_path("livenessProbe") == "/health", "livenessProbe is not GET /health")
    sp = c.get("startupProbe") or {}
    startup_s = sp.get("periodSeconds", 10) * sp.get("failureThreshold", 3)
    check(
        startup_s >= MIN_STARTUP_S[device],
        f"startupProbe allows {startup_s} s, less than the {MIN_STARTUP_S[device]} s "
        f"start-up on {device}",
    )

    # Termination: preStop delay + shutdown timeout < grace period.
    pre = ((c.get("lifecycle") or {}).get("preStop")) or {}
    if "sleep" in pre:
        delay = pre["sleep"].get("seconds")
    elif "exec" in pre:
        cmd = pre["exec"].get("command", [])
        delay = number(cmd[-1]) if cmd and "sleep" in " ".join(cmd) else None
    else:
        delay = None
    check(delay is not None and delay > 0, "no preStop delay (sleep)")
    shutdown = number(env.get("LIPSYNC_SHUTDOWN_TIMEOUT"))
    check(shutdown is not None, "LIPSYNC_SHUTDOWN_TIMEOUT not set")
    grace = spec.get("terminationGracePeriodSeconds", 30)
    if delay is not None and shutdown is not None:
        check(
            grace > delay + shutdown,
            f"terminationGracePeriodSeconds {grace} <= preStop {delay} + shutdown {shutdown}",
        )

    # Non-root, no privileges, read-only root with writable /tmp.
    psc = spec.get("securityContext") or {}
    csc = c.get("securityContext") or {}
    check(psc.get("runAsNonRoot") is True, "pod securityContext: runAsNonRoot is not true")
    check(psc.get("runAsUser") == 10001, "pod securityContext: runAsUser is not 10001")
    check(psc.get("fsGroup") == 10001, "pod securityContext: fsGroup is not 10001")
    check(csc.get("allowPrivilegeEscalation") is False, "allowPrivilegeEscalation is not false")
    check(
        "ALL" in ((csc.get("capabilities") or {}).get("drop") or []),
        "capabilities: ALL not dropped",
    )
    check(csc.get("readOnlyRootFilesystem") is True, "readOnlyRootFilesystem is not true")
    mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
    volumes = by_name(spec.get("volumes"))

    def volume_at(path):
        m = mounts.get(path)
        return volumes.get(m["name"]) if m else None

    check("emptyDir" in (volume_at("/tmp") or {}), "/tmp is not an emptyDir")

    # Volumes: checkpoint read-only, avatars on the shared claim.
    ckpt = env.get("LIPSYNC_CHECKPOINT") or ""
    w = [p for p in mounts if ckpt.startswith(p.rstrip("/") + "/")]
    check(
        w and mounts[w[0]].get("readOnly") is True,
        "LIPSYNC_CHECKPOINT is not on a read-only mount",
    )
    avatars = volume_at(env.get("LIPSYNC_AVATAR_DIR"))
    avatar_claim = ((avatars or {}).get("persistentVolumeClaim") or {}).get("claimName")
    check(avatar_claim, "LIPSYNC_AVATAR_DIR is not mounted from a PersistentVolumeClaim")

    # Batch jobs: one queue in PostgreSQL, its URL (a password) from a Secret, never written
    # in the manifests; the files on a shared claim. Other secrets only from Secrets too.
    raw_env = {e["name"]: e for e in c.get("env", [])}
    db_ref = ((raw_env.get("LIPSYNC_JOBS_DB") or {}).get("valueFrom") or {}).get(
        "secretKeyRef"
    ) or {}
    check(
        db_ref.get("name") and db_ref.get("key") and not db_ref.get("optional", False),
        "LIPSYNC_JOBS_DB is not read from a required Secret (secretKeyRef): without it the "
        "pods would share an SQLite file on the network claim",
    )
    for name in ("LIPSYNC_JOBS_DB", "LIPSYNC_WEBHOOK_SECRET", "LIPSYNC_API_KEY"):
        check(
            "value" not in (raw_env.get(name) or {}),
            f"{name} is written in the manifest (read it from a Secret)",
        )
    data = volume_at(env.get("LIPSYNC_DATA_DIR"))
    data_claim = ((data or {}).get("persistentVolumeClaim") or {}).get("claimName")
    check(data_claim, "LIPSYNC_DATA_DIR is not mounted from a PersistentVolumeClaim")

    # Resources and the device.
    res = c.get("resources") or {}
    req, lim = res.get("requests") or {}, res.get("limits") or {}
    check("cpu" in req and "memory" in req, "no cpu and memory requests")
    check(env.get("LIPSYNC_DEVICE") == ("cuda" if device == "gpu" else "cpu"), "LIPSYNC_DEVICE")
    if device == "gpu":
        check(
            str(req.get("nvidia.com/gpu")) == "1" and str(lim.get("nvidia.com/gpu")) == "1",
            "gpu: requests and limits are not nvidia.com/gpu: 1",
        )
        check(env.get("LIPSYNC_CUDA_DEVICE") == "0", "gpu: LIPSYNC_CUDA_DEVICE is not 0")
        cache = env.get("LIPSYNC_AUTOTUNE_CACHE") or ""
        cache_vol = volume_at(str(pathlib.PurePosixPath(cache).parent)) if cache else None
        check("emptyDir" in (cache_vol or {}), "gpu: LIPSYNC_AUTOTUNE_CACHE is not on an emptyDir")
    else:
        check(
            "nvidia.com/gpu" not in req and "nvidia.com/gpu" not in lim,
            "cpu: asks for a GPU",
        )
    return {
        "pod_labels": pod_labels,
        "avatar_claim": avatar_claim,
        "data_claim": data_claim,
        "jobs_db_secret": db_ref.get("name"),
        "weights_claim": (
            (volumes.get(mounts[w[0]]["name"], {}).get("persistentVolumeClaim") or {}).get(
                "claimName"
            )
            if w
            else None
        ),
        "grace": grace,
        "delay": delay,
        "shutdown": shutdown,
        "startup_s": startup_s,
    }


def check_hpa(hpa, dep_name):
    check(hpa.get("apiVersion") == "autoscaling/v2", "HPA is not autoscaling/v2")
    spec = hpa["spec"]
    ref = spec.get("scaleTargetRef", {})
    check(
        ref.get("kind") == "Deployment" and ref.get("name") == dep_name,
        "HPA does not target the Deployment",
    )
    check(1 <= spec.get("minReplicas", 1) <= spec.get("maxReplicas", 0), "HPA replica bounds")
    pods = [m for m in spec.get("metrics", []) if m.get("type") == "Pods"]
    check(len(pods) == 1, "HPA has no single Pods metric")
    if pods:
        p = pods[0]["pods"]
        check(p["metric"]["name"] == QUEUE_METRIC, f"HPA metric is not {QUEUE_METRIC}")
        check(p["target"].get("type") == "AverageValue", "HPA target is not an AverageValue")
        return p["target"].get("averageValue")
    return None


def check_scaledobject(so, dep_name):
    spec = so.get("spec", {})
    check(so.get("apiVersion") == "keda.sh/v1alpha1", "ScaledObject is not keda.sh/v1alpha1")
    check(
        spec.get("scaleTargetRef", {}).get("name") == dep_name,
        "ScaledObject does not target the Deployment",
    )
    lo, hi = spec.get("minReplicaCount"), spec.get("maxReplicaCount")
    check(
        isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= 100,
        f"ScaledObject replica counts missing or not sane: {lo}..{hi}",
    )
    behavior = ((spec.get("advanced") or {}).get("horizontalPodAutoscalerConfig") or {}).get(
        "behavior"
    )
    check(behavior and "scaleDown" in behavior, "ScaledObject has no scale-down behavior")
    triggers = [t for t in spec.get("triggers", []) if t.get("type") == "prometheus"]
    check(len(triggers) == 1, "ScaledObject has no single prometheus trigger")
    if not triggers:
        return None
    t = triggers[0]
    md = t.get("metadata", {})
    check(t.get("metricType", "AverageValue") == "AverageValue", "trigger is not AverageValue")
    check("lipsync_queue_seconds" in md.get("query", ""), "query does not read lipsync_queue_seconds")
    check(
        str(md.get("serverAddress", "")).startswith(("http://", "https://")),
        "serverAddress is not a URL",
    )
    for key in ("threshold", "activationThreshold"):
        if key in md or key == "threshold":
            v = md.get(key)
            check(
                isinstance(v, str) and number(v) is not None and number(v) >= 0,
                f"{key} is not a number string: {v!r}",
            )
    return md.get("threshold")


def main():
    overlay, rendered = sys.argv[1], sys.argv[2]
    keda = overlay.endswith("-keda")
    device = "gpu" if overlay.startswith("gpu") else "cpu"
    with open(rendered) as f:
        objs = [o for o in yaml.safe_load_all(f) if o]

    deps = of_kind(objs, "Deployment")
    if not check(len(deps) == 1, f"{len(deps)} Deployments, want 1"):
        return report(overlay, objs, None)
    dep = deps[0]
    name = dep["metadata"]["name"]
    d = check_deployment(dep, device)

    services = of_kind(objs, "Service")
    check(len(services) == 1, "not one Service")
    for s in services:
        sel = s["spec"].get("selector", {})
        check(
            d and sel and sel.items() <= d["pod_labels"].items(),
            "Service does not select the pods",
        )
        check("sessionAffinity" not in s["spec"], "Service sets sessionAffinity")
    claims = {c["metadata"]["name"]: c for c in of_kind(objs, "PersistentVolumeClaim")}
    if d:
        a = claims.get(d["avatar_claim"])
        check(
            a and a["spec"]["accessModes"] == ["ReadWriteMany"],
            "the avatars claim is not ReadWriteMany",
        )
        check(d["weights_claim"] in claims, "the weights are not on a claim of this overlay")
        dc = claims.get(d["data_claim"])
        check(
            dc and dc["spec"]["accessModes"] == ["ReadWriteMany"],
            "the data claim (LIPSYNC_DATA_DIR) is not ReadWriteMany",
        )
    pdbs = of_kind(objs, "PodDisruptionBudget")
    check(len(pdbs) == 1, "not one PodDisruptionBudget")
    for p in pdbs:
        sel = p["spec"].get("selector", {}).get("matchLabels", {})
        check(d and sel and sel.items() <= d["pod_labels"].items(), "PDB does not select the pods")

    hpas = of_kind(objs, "HorizontalPodAutoscaler")
    sos = of_kind(objs, "ScaledObject")
    if keda:
        check(len(sos) == 1, f"{len(sos)} ScaledObjects, want 1")
        check(not hpas, "an HPA beside the ScaledObject")
        target = check_scaledobject(sos[0], name) if len(sos) == 1 else None
        # The same target as the HPA of the overlay without the component.
        if len(sys.argv) > 3:
            with open(sys.argv[3]) as f:
                plain = of_kind([o for o in yaml.safe_load_all(f) if o], "HorizontalPodAutoscaler")
            want = plain[0]["spec"]["metrics"][0]["pods"]["target"]["averageValue"] if plain else None
            check(
                number(target) == number(want),
                f"threshold {target!r} differs from the HPA's averageValue {want!r} without keda",
            )
    else:
        check(not sos, "a ScaledObject without the keda component")
        check(len(hpas) == 1, f"{len(hpas)} HorizontalPodAutoscalers, want 1")
        target = check_hpa(hpas[0], name) if len(hpas) == 1 else None
    check((number(target) or 0) > 0, f"scaling target {target!r} is not a positive number")
    return report(overlay, objs, d, target, "ScaledObject" if keda else "HPA")


def report(overlay, objs, d, target=None, scaler=None):
    if problems:
        for p in problems:
            print(f"FAIL {overlay}: {p}")
        return 1
    print(
        f"checks passed: startup {d['startup_s']} s; preStop "
        f"{d['delay']} s + shutdown {d['shutdown']:g} s < grace {d['grace']} s; {scaler} on "
        f"{QUEUE_METRIC if scaler == 'HPA' else 'lipsync_queue_seconds'} at {target} s/pod; "
        f"jobs in PostgreSQL (Secret {d['jobs_db_secret']}), files on claim {d['data_claim']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
