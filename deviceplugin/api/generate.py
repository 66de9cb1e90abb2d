"""Generate the Python gRPC stubs for the kubelet device plugin API from `v1beta1/api.proto`.

    python -m carpool.deviceplugin.api.generate          # write the stubs next to the proto
    python -m carpool.deviceplugin.api.generate --check  # exit 1 if the committed stubs drifted

protoc names imports after the path it is given, so the proto is staged at the package path
(`carpool/deviceplugin/api/v1beta1/api.proto`) in a temporary root: the generated
`api_pb2_grpc.py` then imports `carpool.deviceplugin.api.v1beta1.api_pb2`, never a bare
`api_pb2` that only resolves with the folder itself on sys.path.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent / "v1beta1"
PROTO = HERE / "api.proto"
PACKAGE_PATH = Path("carpool/deviceplugin/api/v1beta1")
OUTPUTS = ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py")


def generate(into: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) and put the stubs in `into`; returns their paths."""
    protoc = importlib.import_module("grpc_tools.protoc")  # dev-only: needed to generate

    with tempfile.TemporaryDirectory(prefix="carpool-proto-") as tmp:
        root = Path(tmp)
        staged = root / "in" / PACKAGE_PATH / "api.proto"
        staged.parent.mkdir(parents=True)
        shutil.copyfile(PROTO, staged)
        out = root / "out"
        out.mkdir()
        code = protoc.main([
            "grpc_tools.protoc",
            f"-I{root / 'in'}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            str(PACKAGE_PATH / "api.proto"),
        ])
        if code != 0:
            raise RuntimeError(f"protoc failed with exit code {code} on {PROTO}")
        into.mkdir(parents=True, exist_ok=True)
        written = []
        for name in OUTPUTS:
            target = into / name
            shutil.copyfile(out / PACKAGE_PATH / name, target)
            written.append(target)
        return written


def drifted(committed: Path) -> list[str]:
    """Names of the stubs in `committed` that differ from a fresh generation (or are missing)."""
    with tempfile.TemporaryDirectory(prefix="carpool-proto-check-") as tmp:
        fresh = Path(tmp)
        generate(fresh)
        return [
            name for name in OUTPUTS
            if not (committed / name).is_file()
            or (committed / name).read_bytes() != (fresh / name).read_bytes()
        ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="fail if the committed stubs differ from freshly generated ones")
    args = parser.parse_args(argv)
    if args.check:
        stale = drifted(HERE)
        if stale:
            print(f"proto stubs out of date in {HERE}: {', '.join(stale)}; run `make proto`",
                  file=sys.stderr)
            return 1
        print(f"proto stubs up to date ({', '.join(OUTPUTS)})")
        return 0
    for path in generate(HERE):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
