#!/usr/bin/env bash
# The Debian packages the test command needs beyond Python: each line below names a
# command the tests run and the package that brings it. Missing ones are installed with
# apt-get when this runs as root on Debian; elsewhere it says what is missing, and the
# tests that need it skip with that reason. `make test` runs this first.
#
#   promtool     prometheus   checks deploy/prometheus rules and /metrics output
#   chromium     chromium     the dashboard's browser test (headless)
#   slurmctld    slurm-wlm    the Slurm test (slurmctld, slurmd, sbatch, srun)
#   munge        munge        Slurm's authentication
#   ip           iproute2     network namespaces that cut a node off (cluster tests)
set -uo pipefail

NEEDED=(
    "promtool prometheus"
    "chromium chromium"
    "slurmctld slurm-wlm"
    "munge munge"
    "ip iproute2"
)

missing=()
for line in "${NEEDED[@]}"; do
    read -r command package <<<"$line"
    command -v "$command" >/dev/null 2>&1 || missing+=("$package")
done

if [ ${#missing[@]} -eq 0 ]; then
    echo "system packages: all present"
    exit 0
fi

if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "system packages missing: ${missing[*]} (not root on Debian, so not installed;"
    echo "  install them to run the tests that need them: they skip and say so)"
    exit 0
fi

echo "system packages: installing ${missing[*]} (apt-get, a few minutes the first time)"
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}"; }; then
    echo "system packages: apt-get could not install ${missing[*]}; the tests that need them skip"
fi
exit 0
