#!/usr/bin/env bash
# Copies the CRDs from crds/ (their single source of truth) into the Helm chart's crds/.
# Helm installs a chart's crds/ files as they are, so they must be real files in the chart, not
# templates or symlinks; tests/unit/packaging/test_helm_render.py fails when the copies drift.
#   hack/sync-chart-crds.sh           write the copies
#   hack/sync-chart-crds.sh --check   exit 1 (and say which) if a copy differs or is missing
exec bash "$(dirname "$0")/sync-chart-files.sh" crds helm/carpool/crds \
  "hack/sync-chart-crds.sh (make chart-crds)" "$@"
