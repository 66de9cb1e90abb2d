#!/usr/bin/env bash
# Builds the real Kubernetes control plane, etcd, KWOK and Helm from the Go module proxy,
# once per machine, into a cache outside the repo keyed by version.
# Why a throwaway module: k8s.io/kubernetes replaces its staging modules with local paths,
# so `go install k8s.io/kubernetes/cmd/...@v` is refused (see docs/operations.md).
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-v1.35.4}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.6}"
KWOK_VERSION="${KWOK_VERSION:-v0.7.0}"
HELM_VERSION="${HELM_VERSION:-v3.19.0}"
CACHE="${CARPOOL_CACHE:-$HOME/.cache/carpool}"
BIN="$CACHE/bin/k8s-$K8S_VERSION-etcd-$ETCD_VERSION-kwok-$KWOK_VERSION-helm-$HELM_VERSION"
WANT=(kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet etcd kwok kwokctl helm)
# kube-proxy only for the real node running Carpool's chart as pods (testbed realnode --kube-proxy).
K8S_CMDS=(kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet)
if [ "${CARPOOL_KUBE_PROXY:-0}" != 0 ]; then WANT+=(kube-proxy); K8S_CMDS+=(kube-proxy); fi
export GOFLAGS=-mod=mod CGO_ENABLED=0

stage() { STAGE_START=$(date +%s); echo "==> [build] $*"; }
done_stage() { echo "    done in $(( $(date +%s) - STAGE_START ))s"; }

find_missing() { missing=(); for b in "${WANT[@]}"; do [ -x "$BIN/$b" ] || missing+=("$b"); done; }
find_missing
if [ ${#missing[@]} -eq 0 ]; then
  echo "==> [build] all binaries cached in $BIN"
  echo "$BIN"; exit 0
fi
# One build at a time per cache: a second caller (a parallel test run, another checkout) waits
# for the first and then finds the binaries built.
mkdir -p "$BIN" "$CACHE/src"
exec 9>"$CACHE/build.lock"
if ! flock -n 9; then
  echo "==> [build] another build of this cache is running; waiting for it"
  flock 9
  find_missing
  if [ ${#missing[@]} -eq 0 ]; then
    echo "==> [build] all binaries cached in $BIN"
    echo "$BIN"; exit 0
  fi
fi
echo "==> [build] missing: ${missing[*]} (cache $BIN)"
TOTAL_START=$(date +%s)

minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
staging_version="v0.${K8S_VERSION#v1.}"
has() { [ -x "$BIN/$1" ]; }

k8s_missing=0; for c in "${K8S_CMDS[@]}"; do has "$c" || k8s_missing=1; done
if [ "$k8s_missing" = 1 ]; then
  stage "kubernetes $K8S_VERSION: resolving staging modules"
  mod="$CACHE/src/k8s-$K8S_VERSION"; mkdir -p "$mod"
  gomod=$(cd "$mod" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  staging=$(grep -oE '^\s*k8s.io/[a-z0-9-]+ => \./staging' "$gomod" | awk '{print $1}' | sort -u)
  {
    echo "module local/k8sbins"; echo; echo "go 1.25.0"; echo
    echo "require k8s.io/kubernetes $K8S_VERSION"; echo; echo "replace ("
    for s in $staging; do echo "	$s => $s $staging_version"; done
    echo ")"
  } > "$mod/go.mod"
  cat > "$mod/tools.go" <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
)
GO
  echo "    $(echo "$staging" | wc -w) staging modules pinned at $staging_version"
  done_stage
  stage "kubernetes $K8S_VERSION: downloading modules"
  (cd "$mod" && go mod tidy -e >/dev/null 2>&1 || true; go mod download -x 2>&1 | grep -c '^# get' || true)
  done_stage
  LDF="-s -w -X k8s.io/component-base/version.gitVersion=$K8S_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=$minor"
  for c in "${K8S_CMDS[@]}"; do
    has "$c" && continue
    stage "kubernetes $K8S_VERSION: compiling $c"
    (cd "$mod" && go build -trimpath -ldflags "$LDF" -o "$BIN/$c" "k8s.io/kubernetes/cmd/$c")
    done_stage
  done
fi

if ! has etcd; then
  stage "etcd $ETCD_VERSION"
  mod="$CACHE/src/etcd-$ETCD_VERSION"; mkdir -p "$mod"
  cat > "$mod/go.mod" <<GOMOD
module local/etcdbin

go 1.24

require go.etcd.io/etcd/server/v3 $ETCD_VERSION
GOMOD
  cat > "$mod/main.go" <<'GO'
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
  (cd "$mod" && go mod tidy && go build -trimpath -ldflags "-s -w" -o "$BIN/etcd" .)
  done_stage
fi

for c in kwok kwokctl; do
  has "$c" && continue
  stage "$c $KWOK_VERSION"
  GOBIN="$BIN" go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/$c@$KWOK_VERSION"
  done_stage
done

if ! has helm; then
  stage "helm $HELM_VERSION"
  GOBIN="$BIN" go install -trimpath -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  done_stage
fi

echo "==> [build] all binaries built in $(( $(date +%s) - TOTAL_START ))s into $BIN"
echo "$BIN"
