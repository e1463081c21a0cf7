"""Regenerate the checked-in gRPC code from proto/pitstop/v1/*.proto.

    python scripts/gen_proto.py          # rewrite the generated files
    python scripts/gen_proto.py --check  # exit 1 if the checked-in files are stale

The test command runs ``--check`` so a .proto edit without regeneration fails CI.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE_DIR = PROTO_ROOT / "pitstop" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    """Run protoc (from grpcio-tools) over every .proto into ``out_dir``."""
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PACKAGE_DIR.glob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")


def generated_files(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.name.endswith(GENERATED_SUFFIXES)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if generated code is stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        generate(tmp_path)
        fresh_dir = tmp_path / "pitstop" / "v1"
        fresh = generated_files(fresh_dir)
        if args.check:
            current = generated_files(PACKAGE_DIR)
            stale = sorted(
                name
                for name in fresh | current
                if name not in fresh
                or name not in current
                or not filecmp.cmp(fresh_dir / name, PACKAGE_DIR / name, shallow=False)
            )
            if stale:
                print(
                    "generated proto code is stale: " + ", ".join(stale) + "\n"
                    "fix: run `python scripts/gen_proto.py` and commit the result",
                    file=sys.stderr,
                )
                return 1
            print(f"generated proto code is fresh ({len(fresh)} files)")
            return 0
        for name in generated_files(PACKAGE_DIR) - fresh:
            (PACKAGE_DIR / name).unlink()
        for name in fresh:
            shutil.copyfile(fresh_dir / name, PACKAGE_DIR / name)
        print(f"wrote {len(fresh)} files to {PACKAGE_DIR.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
