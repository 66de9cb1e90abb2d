#!/usr/bin/env bash
# Installs what the real node needs from Debian: runc, the CNI plugins (bridge, loopback,
# host-local) and a static busybox (the payload of the locally built pause and test images).
# containerd is not Debian's (bookworm's 1.6 has no CDI): hack/build-containerd.sh builds it.
# iptables only for kube-proxy (NEED_IPTABLES=1). A no-op when everything is already there.
# Needs root.
set -euo pipefail

need=()
command -v runc >/dev/null || need+=(runc)
[ -x /usr/lib/cni/bridge ] && [ -x /usr/lib/cni/loopback ] && [ -x /usr/lib/cni/host-local ] \
  || need+=(containernetworking-plugins)
# busybox-static: the image payload must run without a dynamic loader inside the container.
if ! [ -x /bin/busybox ] || ldd /bin/busybox >/dev/null 2>&1; then need+=(busybox-static); fi
[ "${NEED_IPTABLES:-0}" = 0 ] || command -v iptables >/dev/null || need+=(iptables)

if [ ${#need[@]} -eq 0 ]; then
  echo "==> [node] host packages present: runc $(runc --version | awk 'NR==1{print $3}')"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "error: the real node needs root to install ${need[*]} (apt-get)" >&2
  exit 1
fi
echo "==> [node] apt-get install ${need[*]}"
start=$(date +%s)
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
echo "==> [node] installed in $(( $(date +%s) - start ))s"
