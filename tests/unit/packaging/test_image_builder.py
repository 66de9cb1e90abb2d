"""hack/images/build.py's layers: the same tree gives the same bytes whatever the files'
times, owners and creation order; the version is the chart's appVersion."""

from __future__ import annotations

import io
import os
import tarfile
import time
from pathlib import Path
from types import ModuleType

import yaml

REPO = Path(__file__).resolve().parents[3]


def make_tree(root: Path, order: list[str], mtime: float) -> None:
    for name in order:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"content of {name}\n")
        os.utime(path, (mtime, mtime))
    (root / "bin").mkdir(exist_ok=True)
    (root / "bin" / "sh").symlink_to("dash")


def test_layers_do_not_depend_on_times_or_creation_order(tmp_path: Path,
                                                         image_builder: ModuleType) -> None:
    build = image_builder
    first, second = tmp_path / "a", tmp_path / "b"
    make_tree(first, ["usr/b.txt", "usr/a.txt", "etc/x"], time.time())
    make_tree(second, ["etc/x", "usr/a.txt", "usr/b.txt"], 1000.0)
    layer_a = build.Layer.of(build.layer_tar(first), "t")
    layer_b = build.Layer.of(build.layer_tar(second), "t")
    assert layer_a.gz == layer_b.gz
    with tarfile.open(fileobj=io.BytesIO(layer_a.tar)) as tar:
        names = tar.getmembers()
    assert [m.name for m in names] == ["bin", "bin/sh", "etc", "etc/x", "usr", "usr/a.txt",
                                       "usr/b.txt"]
    assert {(m.uid, m.gid, m.mtime, m.uname) for m in names} == {(0, 0, 0, "")}
    (second / "usr" / "a.txt").write_text("changed\n")
    assert build.Layer.of(build.layer_tar(second), "t").gz != layer_a.gz


def test_layout_digest_is_the_manifest(tmp_path: Path, image_builder: ModuleType) -> None:
    build = image_builder
    make_tree(tmp_path / "root", ["etc/x"], 0)
    layer = build.Layer.of(build.layer_tar(tmp_path / "root", {"etc/x": 65532}), "t")
    image = build.Image("x", (layer,), {"User": "65532:65532"},
                        {"org.opencontainers.image.version": "1"})
    digest, _ = build.write_layout(image, "1", tmp_path / "out")
    blob = tmp_path / "out" / "blobs" / "sha256" / digest.split(":")[1]
    assert build.sha256(blob.read_bytes()) == digest
    with tarfile.open(fileobj=io.BytesIO(layer.tar)) as tar:
        member = tar.getmember("etc/x")
    assert (member.uid, member.gid) == (65532, 65532)


def test_one_version_for_package_chart_and_images(image_builder: ModuleType) -> None:
    chart = yaml.safe_load((REPO / "helm" / "carpool" / "Chart.yaml").read_text())
    assert image_builder.version() == str(chart["appVersion"]) == str(chart["version"])
