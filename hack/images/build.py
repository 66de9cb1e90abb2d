"""Builds Carpool's container images as OCI image layouts without a container engine.

    python hack/images/build.py [--out build/images] [--check-reproducible]

The base layer is Debian bookworm made from Debian's packages (`apt-get download`, unpacked
with `dpkg-deb -x`), Python 3.11 included; the application layer is the project's wheel and
its locked dependencies (docker/requirements.lock) installed for that Python. Nothing comes
from an image registry. Every tar entry has a fixed owner, mode and mtime and the entries are
sorted; gzip carries no name or time: the same inputs give the same digests.

Images (each an OCI layout directory under --out, pushed by hack/images/push.sh):
  carpool         operator, extender, device plugin, CLI; runs as 65532, read-only root works
  carpool-mps     the MPS control daemon's wrapper; the daemon itself comes from the host's
                  driver (the NVIDIA container toolkit mounts it)
  kube-scheduler  (--with-scheduler BIN) the cached kube-scheduler, for clusters that cannot
                  pull registry.k8s.io (the local test bed)

Debian packages and wheels are cached under $CARPOOL_CACHE/images (default
~/.cache/carpool). Unpacking needs root (dpkg-deb keeps owners; chroot compiles bytecode and
smoke-tests the image with its own Python).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SOURCE = "https://github.com/carpool-dev/carpool"
USER_ID = 65532
PYTHON = "python3.11"
CHROOT = shutil.which("chroot") or "/usr/sbin/chroot"
SITE_PACKAGES = "usr/local/lib/python3.11/dist-packages"

# What the base needs to run CPython 3.11 with ssl, ctypes, sqlite-free stdlib, a POSIX sh and
# coreutils (the MPS wrapper, `kubectl exec` debugging); libstdc++ for grpcio's extension.
# Named one by one instead of resolved: the resolver would drag in dpkg, perl and debconf.
DEBIAN_PACKAGES = (
    "base-files", "netbase", "media-types", "ca-certificates",
    "libc6", "libgcc-s1", "gcc-12-base", "libstdc++6", "zlib1g", "libssl3", "libffi8",
    "libexpat1", "libbz2-1.0", "liblzma5", "libsqlite3-0", "libncursesw6", "libtinfo6",
    "libreadline8", "readline-common", "libuuid1", "libdb5.3", "libgdbm6", "libnsl2",
    "libtirpc3", "libtirpc-common", "libgssapi-krb5-2", "libk5crypto3", "libkrb5-3",
    "libkrb5support0", "libkeyutils1", "libcom-err2", "libcrypt1",
    "libpython3.11-minimal", "libpython3.11-stdlib", "python3.11-minimal",
    "dash", "coreutils", "libacl1", "libattr1", "libselinux1", "libpcre2-8-0", "libgmp10",
)
# Trimmed from the base: documentation, translations, man pages, and what only dpkg reads.
PRUNE = ("usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale",
         "usr/share/lintian", "usr/share/bug", "usr/share/bash-completion")

MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"


class BuildError(RuntimeError):
    """A step failed; the message names it."""


def log(message: str) -> None:
    print(f"==> [images] {message}", file=sys.stderr, flush=True)


def run(command: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(command), capture_output=True, text=True, check=False, **kwargs)
    if done.returncode != 0:
        raise BuildError(f"`{' '.join(command)}` failed (exit {done.returncode}):\n"
                         f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done


def cache_dir() -> Path:
    return Path(os.environ.get("CARPOOL_CACHE", Path.home() / ".cache" / "carpool")) / "images"


def version() -> str:
    """The one version: pyproject's, which is also the chart's appVersion and the image tag."""
    return str(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"])


@functools.cache
def revision() -> str:
    """HEAD, "-dirty" with uncommitted changes; read once, so both builds of a check agree."""
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=False)
    head = done.stdout.strip() if done.returncode == 0 else "unknown"
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"],
                           capture_output=True, text=True, check=False).stdout.strip()
    return f"{head}-dirty" if dirty else head


def source_date_epoch() -> int:
    """Every mtime in every layer and the config's `created`: SOURCE_DATE_EPOCH, else 0."""
    return int(os.environ.get("SOURCE_DATE_EPOCH", "0"))


# --------------------------------------------------------------------------------------------
# Inputs: Debian packages and wheels, cached


def debian_packages(cache: Path) -> list[Path]:
    """The .debs of DEBIAN_PACKAGES at the versions apt's index names now, downloaded once."""
    debs = cache / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    shown = run(["apt-cache", "show", "--no-all-versions", *DEBIAN_PACKAGES]).stdout
    wanted: list[Path] = []
    missing: list[str] = []
    for stanza in shown.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in stanza.splitlines()
                      if ": " in line and not line.startswith(" "))
        if "Filename" not in fields:
            continue
        # apt-get download's file name: the epoch's colon is written %3a.
        version_part = fields["Version"].replace(":", "%3a")
        path = debs / f"{fields['Package']}_{version_part}_{fields['Architecture']}.deb"
        wanted.append(path)
        if not path.is_file():
            missing.append(f"{fields['Package']}={fields['Version']}")
    if len(wanted) != len(DEBIAN_PACKAGES):
        raise BuildError(f"apt-cache knows {len(wanted)} of {len(DEBIAN_PACKAGES)} packages; "
                         "run `apt-get update`")
    if missing:
        log(f"apt-get download: {len(missing)} packages into {debs}")
        run(["apt-get", "download", "-q", *missing], cwd=debs)
    return sorted(wanted)


def project_wheel(work: Path) -> Path:
    """The carpool wheel, built from a copy of the files git tracks (no stale build/ files)."""
    tree = work / "src-tree"
    listed = run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"]).stdout
    for name in sorted(filter(None, listed.split("\0"))):
        source = REPO / name
        if source.is_file():
            target = tree / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    out = work / "wheel"
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(tree)], env={**os.environ, "SOURCE_DATE_EPOCH": "315532800"})
    (wheel,) = out.glob("carpool-*.whl")
    return wheel


def dependency_wheels(cache: Path) -> list[Path]:
    """docker/requirements.lock's wheels for CPython 3.11 on manylinux x86_64, cached."""
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    lock = REPO / "docker" / "requirements.lock"
    pins = [line.split("#")[0].strip() for line in lock.read_text().splitlines()]
    pins = [pin for pin in pins if pin]

    def find(pin: str) -> Path | None:
        name, _, ver = pin.partition("==")
        prefix = f"{re.sub(r'[-_.]+', '_', name).lower()}-{ver}-"
        found = sorted(p for p in wheels.glob("*.whl") if p.name.lower().startswith(prefix))
        return found[-1] if found else None

    if any(find(pin) is None for pin in pins):
        log(f"pip download: {len(pins)} pinned wheels into {wheels}")
        run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
             "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
             "--platform", "manylinux2014_x86_64", "-d", str(wheels), "-r", str(lock)])
    chosen = []
    for pin in pins:
        wheel = find(pin)
        if wheel is None:
            raise BuildError(f"no wheel for {pin} in {wheels}")
        chosen.append(wheel)
    return chosen


# --------------------------------------------------------------------------------------------
# Root filesystems


def unpack_base(debs: Sequence[Path], root: Path) -> None:
    for deb in debs:
        run(["dpkg-deb", "-x", str(deb), str(root)])
    for prune in PRUNE:
        shutil.rmtree(root / prune, ignore_errors=True)
    # What maintainer scripts would have made.
    for link, target in (("usr/bin/python3", PYTHON), ("usr/bin/python", PYTHON),
                         ("bin/sh", "dash")):
        path = root / link
        if not path.is_symlink() and not path.exists():
            path.symlink_to(target)
    certs = sorted((root / "usr/share/ca-certificates").rglob("*.crt"))
    bundle = root / "etc/ssl/certs/ca-certificates.crt"
    bundle.parent.mkdir(parents=True, exist_ok=True)
    bundle.write_bytes(b"".join(cert.read_bytes() for cert in certs))
    (root / "etc/passwd").write_text(
        f"root:x:0:0:root:/root:/bin/sh\ncarpool:x:{USER_ID}:{USER_ID}:carpool:/home/carpool:"
        "/usr/sbin/nologin\n")
    (root / "etc/group").write_text(f"root:x:0:\ncarpool:x:{USER_ID}:\n")
    for name in ("tmp", "home/carpool", "root", "proc", "sys", "dev", "run"):
        (root / name).mkdir(parents=True, exist_ok=True)
    # dpkg's database, so that scanners can list what the image holds.
    status = []
    for deb in debs:
        control = run(["dpkg-deb", "-f", str(deb)]).stdout.strip()
        status.append(control.replace("\nVersion:", "\nStatus: install ok installed\nVersion:", 1))
    (root / "var/lib/dpkg").mkdir(parents=True, exist_ok=True)
    (root / "var/lib/dpkg/status").write_text("\n\n".join(status) + "\n")
    compile_bytecode(root, "usr/lib/python3.11")


def compile_bytecode(root: Path, folder: str) -> None:
    """With the image's own Python (chroot), hash-based .pyc: no mtimes, and a read-only root
    never needs to write one."""
    run([CHROOT, str(root), f"/usr/bin/{PYTHON}", "-m", "compileall", "-q", "-j", "1",
         "--invalidation-mode", "unchecked-hash", "-x", "/(test|tests|idlelib|lib2to3|ensurepip|"
         "tkinter|turtledemo)/", f"/{folder}"],
        env={"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "LC_ALL": "C.UTF-8"})


def install_wheels(wheels: Sequence[Path], root: Path) -> None:
    """Unpacks the wheels into root's /usr/local with console scripts for the image's Python."""
    from installer import install
    from installer.destinations import SchemeDictionaryDestination
    from installer.sources import WheelFile

    scheme = {"purelib": SITE_PACKAGES, "platlib": SITE_PACKAGES, "headers": "usr/local/include",
              "scripts": "usr/local/bin", "data": "usr/local"}
    destination = SchemeDictionaryDestination(
        {key: str(root / value) for key, value in scheme.items()},
        interpreter=f"/usr/bin/{PYTHON}", script_kind="posix", bytecode_optimization_levels=())
    for wheel in wheels:
        with WheelFile.open(wheel) as source:
            install(source, destination, additional_metadata={"INSTALLER": b"carpool-images\n"})


def smoke_test(root: Path) -> None:
    """The image's Python imports every component from the image's files, as user 65532."""
    check = ("import sys, operator, ssl, grpc, orjson, kopf, kubernetes, aiohttp, yaml, pynvml;"
             "import uvloop;"
             "import carpool.operator.handlers, carpool.extender, carpool.deviceplugin;"
             "import carpool.cli.kubectl_plugin;"
             "assert hasattr(operator, 'itemgetter'); print(sys.version.split()[0])")
    done = run([CHROOT, "--userspec", f"{USER_ID}:{USER_ID}", str(root),
                f"/usr/bin/{PYTHON}", "-c", check],
               env={"PATH": "/usr/local/bin:/usr/bin:/bin",
                    "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/home/carpool"})
    log(f"smoke test: Python {done.stdout.strip()} imports every component as {USER_ID}")


# --------------------------------------------------------------------------------------------
# Reproducible layers and OCI layouts


def layer_tar(root: Path, owners: dict[str, int] | None = None,
              skip: Sequence[str] = ()) -> bytes:
    """An uncompressed layer of root's tree: sorted entries, owner 0 (or `owners[path]`),
    mtime SOURCE_DATE_EPOCH, modes as unpacked."""
    owners = owners or {}
    epoch = source_date_epoch()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in walk_sorted(root):
            name = path.relative_to(root).as_posix()
            if any(name == s or name.startswith(f"{s}/") for s in skip):
                continue
            info = tar.gettarinfo(str(path), arcname=name)
            info.uid = owners.get(name, 0)
            info.gid = owners.get(name, 0)
            info.uname = info.gname = ""
            info.mtime = epoch
            info.pax_headers = {}
            if info.isreg():
                with path.open("rb") as handle:
                    tar.addfile(info, handle)
            else:
                tar.addfile(info)
    return buffer.getvalue()


def walk_sorted(root: Path) -> Iterator[Path]:
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        yield entry
        if entry.is_dir() and not entry.is_symlink():
            yield from walk_sorted(entry)


def gzip_bytes(data: bytes) -> bytes:
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0, compresslevel=6) as out:
        out.write(data)
    return buffer.getvalue()


@dataclass(frozen=True)
class Layer:
    tar: bytes
    gz: bytes
    comment: str

    @classmethod
    def of(cls, tar: bytes, comment: str) -> Layer:
        return cls(tar, gzip_bytes(tar), comment)


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Image:
    name: str
    layers: tuple[Layer, ...]
    config: dict[str, Any]
    annotations: dict[str, str]


def write_layout(image: Image, tag: str, out: Path) -> tuple[str, int]:
    """An OCI image layout directory; returns the manifest digest and the compressed size."""
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(source_date_epoch()))
    config = {
        "architecture": "amd64", "os": "linux", "created": created,
        "config": {**image.config, "Labels": dict(image.annotations)},
        "rootfs": {"type": "layers", "diff_ids": [sha256(layer.tar) for layer in image.layers]},
        "history": [{"created": created, "created_by": layer.comment} for layer in image.layers],
    }
    blobs = {}
    config_bytes = canonical(config)
    blobs[sha256(config_bytes)] = config_bytes
    for layer in image.layers:
        blobs[sha256(layer.gz)] = layer.gz
    manifest = {
        "schemaVersion": 2, "mediaType": MEDIA_MANIFEST,
        "config": {"mediaType": MEDIA_CONFIG, "digest": sha256(config_bytes),
                   "size": len(config_bytes)},
        "layers": [{"mediaType": MEDIA_LAYER, "digest": sha256(layer.gz), "size": len(layer.gz)}
                   for layer in image.layers],
        "annotations": dict(image.annotations),
    }
    manifest_bytes = canonical(manifest)
    blobs[sha256(manifest_bytes)] = manifest_bytes
    index = {"schemaVersion": 2, "mediaType": MEDIA_INDEX, "manifests": [{
        "mediaType": MEDIA_MANIFEST, "digest": sha256(manifest_bytes),
        "size": len(manifest_bytes), "platform": {"architecture": "amd64", "os": "linux"},
        "annotations": {"org.opencontainers.image.ref.name": tag}}]}
    shutil.rmtree(out, ignore_errors=True)
    (out / "blobs" / "sha256").mkdir(parents=True)
    (out / "oci-layout").write_bytes(canonical({"imageLayoutVersion": "1.0.0"}))
    (out / "index.json").write_bytes(canonical(index))
    for digest, data in blobs.items():
        (out / "blobs" / "sha256" / digest.split(":")[1]).write_bytes(data)
    return sha256(manifest_bytes), sum(len(layer.gz) for layer in image.layers) + len(
        config_bytes)


# --------------------------------------------------------------------------------------------
# The images


def annotations(title: str, description: str) -> dict[str, str]:
    return {
        "org.opencontainers.image.title": title,
        "org.opencontainers.image.description": description,
        "org.opencontainers.image.source": SOURCE,
        "org.opencontainers.image.version": version(),
        "org.opencontainers.image.revision": revision(),
        "org.opencontainers.image.licenses": "Apache-2.0",
        "org.opencontainers.image.base.name": "debian:bookworm (from Debian packages)",
    }


def build(out: Path, scheduler_binary: Path | None) -> dict[str, tuple[str, int]]:
    if os.geteuid() != 0:
        raise BuildError("unpacking Debian packages with their owners and chroot need root")
    cache = cache_dir()
    started = time.monotonic()
    debs = debian_packages(cache)
    wheels = dependency_wheels(cache)
    with tempfile.TemporaryDirectory(prefix="carpool-images-") as tmp:
        work = Path(tmp)
        wheels = [*wheels, project_wheel(work)]
        base_root = work / "base"
        unpack_base(debs, base_root)
        base = Layer.of(layer_tar(base_root, {"home/carpool": USER_ID}),
                        f"debian bookworm: {len(debs)} packages, python 3.11")
        log(f"base layer: {len(base.gz) / 2**20:.1f} MiB compressed")

        # The application layer: what installing the wheels and compiling them adds.
        app_root = work / "app"
        install_wheels(wheels, app_root)
        merged = work / "merged"
        shutil.copytree(base_root, merged, symlinks=True)
        shutil.copytree(app_root, merged, symlinks=True, dirs_exist_ok=True)
        compile_bytecode(merged, SITE_PACKAGES)
        smoke_test(merged)
        shutil.rmtree(app_root)
        shutil.copytree(merged / "usr/local", app_root / "usr/local", symlinks=True)
        app = Layer.of(layer_tar(app_root), f"carpool {version()} and "
                       f"{len(wheels) - 1} locked dependency wheels")
        log(f"app layer: {len(app.gz) / 2**20:.1f} MiB compressed")

        mps_root = work / "mps"
        (mps_root / "usr/local/bin").mkdir(parents=True)
        for script in ("mps-entrypoint.sh", "mps-ready.sh"):
            target = mps_root / "usr/local/bin" / script
            shutil.copyfile(REPO / "docker" / script, target)
            target.chmod(0o755)
        mps = Layer.of(layer_tar(mps_root), "the MPS control daemon's wrapper scripts")

    env = ["PATH=/usr/local/bin:/usr/bin:/bin", "PYTHONUNBUFFERED=1",
           "PYTHONDONTWRITEBYTECODE=1", "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"]
    images = [
        Image("carpool", (base, app), {
            "User": f"{USER_ID}:{USER_ID}", "Env": env, "WorkingDir": "/home/carpool",
            "Cmd": ["kopf", "run", "--standalone", "--all-namespaces", "-m",
                    "carpool.operator.handlers"]},
            annotations("carpool", "Carpool GPU sharing: operator, scheduler extender, "
                        "device plugin, CLI")),
        Image("carpool-mps", (base, mps), {
            "User": "0:0", "WorkingDir": "/",
            "Env": ["PATH=/usr/local/bin:/usr/bin:/bin:/usr/local/nvidia/bin",
                    "NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
                    "CUDA_MPS_PIPE_DIRECTORY=/run/carpool/mps/pipe",
                    "CUDA_MPS_LOG_DIRECTORY=/run/carpool/mps/log"],
            "Entrypoint": ["/usr/local/bin/mps-entrypoint.sh"]},
            annotations("carpool-mps", "Carpool's CUDA MPS control daemon wrapper (the daemon "
                        "comes from the host's NVIDIA driver)")),
    ]
    tags = {"carpool": version(), "carpool-mps": version()}
    if scheduler_binary is not None:
        scheduler_version = run([str(scheduler_binary), "--version"]).stdout.split()[-1]
        with tempfile.TemporaryDirectory(prefix="carpool-images-") as tmp:
            root = Path(tmp)
            (root / "usr/local/bin").mkdir(parents=True)
            shutil.copyfile(scheduler_binary, root / "usr/local/bin/kube-scheduler")
            (root / "usr/local/bin/kube-scheduler").chmod(0o755)
            (root / "etc").mkdir()
            (root / "etc/passwd").write_text(f"nonroot:x:{USER_ID}:{USER_ID}::/:/nologin\n")
            (root / "tmp").mkdir()
            (root / "tmp").chmod(0o1777)
            sched = Layer.of(layer_tar(root), f"kube-scheduler {scheduler_version}")
        images.append(Image("kube-scheduler", (sched,), {
            "User": f"{USER_ID}:{USER_ID}", "Env": ["PATH=/usr/local/bin"],
            "Entrypoint": ["/usr/local/bin/kube-scheduler"]},
            {**annotations("kube-scheduler", "kube-scheduler built from the Go module proxy"),
             "org.opencontainers.image.version": scheduler_version,
             "org.opencontainers.image.source": "https://github.com/kubernetes/kubernetes"}))
        tags["kube-scheduler"] = scheduler_version

    results = {}
    for image in images:
        digest, size = write_layout(image, tags[image.name], out / image.name)
        results[f"{image.name}:{tags[image.name]}"] = (digest, size)
    log(f"built in {time.monotonic() - started:.1f}s")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "build" / "images")
    parser.add_argument("--with-scheduler", type=Path, metavar="BIN",
                        help="also package this kube-scheduler binary")
    parser.add_argument("--check-reproducible", action="store_true",
                        help="build twice into separate folders and compare every digest")
    parser.add_argument("--print-version", action="store_true",
                        help="print the version (image tag, chart appVersion) and exit")
    args = parser.parse_args(argv)
    if args.print_version:
        print(version())
        return 0
    try:
        first = build(args.out, args.with_scheduler)
        for ref, (digest, size) in first.items():
            print(f"{ref}\t{digest}\t{size / 2**20:.1f} MiB")
        if args.check_reproducible:
            again = args.out.with_name(args.out.name + "-again")
            second = build(again, args.with_scheduler)
            differ = [ref for ref in first if first[ref] != second.get(ref)]
            if differ:
                for ref in differ:
                    print(f"DIFFERENT {ref}: {first[ref][0]} then {second[ref][0]} "
                          f"(layouts {args.out} and {again})")
                return 1
            shutil.rmtree(again)
            print(f"reproducible: two builds gave the same {len(first)} digests")
    except BuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
