"""The committed generated protobuf code matches protos/ (regenerate with `make protos`)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_current(tmp_path):
    protos = sorted(str(p.relative_to(ROOT / "protos")) for p in (ROOT / "protos").rglob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", "protos", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
         f"--grpc_python_out={tmp_path}", *protos],
        cwd=ROOT, check=True,
    )
    generated = sorted(tmp_path.rglob("*_pb2*.py*"))
    assert generated, "protoc produced nothing"
    for fresh in generated:
        committed = ROOT / fresh.relative_to(tmp_path)
        assert committed.is_file(), f"{committed} is missing: run `make protos`"
        assert committed.read_text() == fresh.read_text(), f"{committed} is stale: run `make protos`"
