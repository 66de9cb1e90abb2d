#!/usr/bin/env bash
# Copies the policies in hack/policies/ (their single source) into the Helm chart's
# files/policies/, which templates/policies.yaml reads with .Files.Get (Helm reads only files
# inside the chart). The template renames the objects after the release and fills the
# policies' account variables (`operator`, `extender`, `devicePlugin`) and chart settings with
# the release's values; nothing else changes.
# tests/unit/packaging/test_helm_render.py fails when the copies drift.
#   hack/policies/sync-chart.sh           write the copies
#   hack/policies/sync-chart.sh --check   exit 1 (and say which) if a copy differs or is missing
exec bash "$(dirname "$0")/../sync-chart-files.sh" hack/policies helm/carpool/files/policies \
  hack/policies/sync-chart.sh "$@"
