#!/usr/bin/env bash
# Pushes every OCI layout under build/images (hack/images/build.py) to $REGISTRY with crane,
# tagged as the layout's ref name; default REGISTRY: the local one (started if needed).
# Prints "REF DIGEST" per image; the digest pushed is the one built.
set -euo pipefail
cd "$(dirname "$0")/../.."
IMAGES="${IMAGES:-build/images}"
bin=$(bash hack/build-registry.sh | tail -1)
REGISTRY="${REGISTRY:-$(bash hack/images/registry.sh up)}"
insecure=()
case "$REGISTRY" in localhost:*|127.0.0.1:*) insecure=(--insecure) ;; esac
for layout in "$IMAGES"/*/; do
  name=$(basename "$layout")
  [ -f "$layout/index.json" ] || continue
  tag=$(python3 -c 'import json,sys; m=json.load(open(sys.argv[1]))["manifests"][0]; print(m["annotations"]["org.opencontainers.image.ref.name"], m["digest"])' "$layout/index.json")
  read -r tag built <<< "$tag"
  ref="$REGISTRY/$name:$tag"
  pushed=$("$bin/crane" push "${insecure[@]}" "$layout" "$ref" 2>/dev/null | tail -1)
  if [ "${pushed##*@}" != "$built" ]; then
    echo "pushed $ref as ${pushed##*@}, but the layout's manifest is $built" >&2; exit 1
  fi
  echo "$ref $built"
done
