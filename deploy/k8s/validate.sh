#!/usr/bin/env bash
# Renders every overlay under deploy/k8s/overlays with kubectl's built-in kustomize and
# validates each object offline, strictly, against Kubernetes 1.32's schemas
# (kubernetes-validate from PyPI, in a venv at target/k8s-venv); then check.py checks what
# the schemas cannot (probes, grace period, non-root, GPU, the autoscaler and its signal, the
# job store's Secret and claims). The examples under deploy/k8s/examples are validated too.
# Fails on any error and on any warning: kubernetes-validate only warns, exit code 0, about
# a kind it has no schema for, so `kind: Deploymnet` would pass otherwise. The one warning
# allowed is KEDA's ScaledObject in an overlay named *-keda.
#
#   deploy/k8s/validate.sh        (no arguments; needs kubectl and python3)
set -euo pipefail
cd "$(dirname "$0")/../.."

KV_VERSION=1.37.0   # kubernetes-validate; it bundles the schemas of Kubernetes 1.25 to 1.37
K8S_VERSION=1.32.0
VENV=target/k8s-venv

command -v kubectl >/dev/null || { echo "validate.sh: kubectl not found" >&2; exit 1; }
if [ "$("$VENV/bin/kubernetes-validate" --version 2>/dev/null)" != "$KV_VERSION" ]; then
    echo "installing kubernetes-validate $KV_VERSION into $VENV"
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "kubernetes-validate==$KV_VERSION"
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=0
overlays=()
for dir in deploy/k8s/overlays/*/; do
    overlay=$(basename "$dir")
    if kubectl kustomize "$dir" >"$work/$overlay.yaml" 2>"$work/err"; then
        overlays+=("$overlay")
    else
        echo "FAIL $overlay: kubectl kustomize: $(cat "$work/err")"
        failed=1
    fi
done

allowed='^WARN - Couldn.t find schema for kind ScaledObject with api version keda\.sh/v1alpha1 '
for overlay in "${overlays[@]}"; do
    rendered="$work/$overlay.yaml"
    objects=$(grep -c '^kind:' "$rendered" || true)
    rc=0
    "$VENV/bin/kubernetes-validate" -k "$K8S_VERSION" --strict - <"$rendered" >"$work/out" 2>&1 || rc=$?
    passed=$(grep -c '^INFO - passed for resource ' "$work/out" || true)
    unknown=0
    plain=()
    if [[ $overlay == *-keda ]]; then
        unknown=$(grep -c "$allowed" "$work/out" || true)
        plain=("$work/${overlay%-keda}.yaml")
    fi
    # Every line is a pass, or (with keda) the one allowed warning; anything else fails.
    bad=$(grep -v '^INFO - passed for resource ' "$work/out" | { if [[ $overlay == *-keda ]]; then grep -v "$allowed"; else cat; fi; } || true)
    if [ "$rc" -ne 0 ] || [ -n "$bad" ] || [ $((passed + unknown)) -ne "$objects" ] || [ "$unknown" -gt 1 ]; then
        echo "FAIL $overlay: kubernetes-validate (exit $rc, $passed of $objects objects passed):"
        sed 's/^/  /' "$work/out"
        failed=1
        continue
    fi
    if summary=$(PYTHONDONTWRITEBYTECODE=1 "$VENV/bin/python" deploy/k8s/check.py "$overlay" "$rendered" "${plain[@]}"); then
        schema="$passed/$objects objects valid against Kubernetes $K8S_VERSION (strict)"
        [ "$unknown" -eq 0 ] || schema+=" + ScaledObject (no schema; checked by check.py)"
        echo "$overlay: $schema; $summary"
    else
        echo "$summary"
        failed=1
    fi
done
# The examples applied by hand (the Secrets the Deployment reads): valid objects too.
for example in deploy/k8s/examples/*.yaml; do
    objects=$(grep -c '^kind:' "$example" || true)
    rc=0
    "$VENV/bin/kubernetes-validate" -k "$K8S_VERSION" --strict - <"$example" >"$work/out" 2>&1 || rc=$?
    passed=$(grep -c '^INFO - passed for resource ' "$work/out" || true)
    if [ "$rc" -ne 0 ] || [ "$passed" -ne "$objects" ] || grep -qv '^INFO - passed for resource ' "$work/out"; then
        echo "FAIL $example: kubernetes-validate (exit $rc, $passed of $objects objects passed):"
        sed 's/^/  /' "$work/out"
        failed=1
    else
        echo "$example: $passed/$objects objects valid against Kubernetes $K8S_VERSION (strict)"
    fi
done
for o in cpu gpu; do
    [ -d "deploy/k8s/overlays/$o" ] || { echo "FAIL: overlay $o missing"; failed=1; }
done
ls -d deploy/k8s/overlays/*-keda >/dev/null 2>&1 || { echo "FAIL: no *-keda overlay"; failed=1; }

if [ "$failed" -ne 0 ]; then
    echo "deploy/k8s: FAILED"
    exit 1
fi
echo "deploy/k8s: all overlays valid"
