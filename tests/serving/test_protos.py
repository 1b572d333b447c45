"""The gRPC contract: the protos pass `buf lint` (STANDARD, buf.yaml at the repository root), and the
committed stubs in client/specpool_client/v1 are what `make proto` generates from them today."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STUBS = ROOT / "client" / "specpool_client" / "v1"


def test_protos_pass_buf_lint():
    buf = shutil.which("buf", path=str(Path(sys.executable).parent))  # PyPI buf-bin, from the test extra
    assert buf, "buf is not installed in this environment: make setup (the test extra's buf-bin)"
    done = subprocess.run([buf, "lint"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"buf lint:\n{done.stdout}{done.stderr}"


def test_committed_stubs_match_the_protos(tmp_path):
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "proto" / "specpool" / "v1").glob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Iproto", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *protos], cwd=ROOT, check=True)
    generated = sorted((tmp_path / "specpool" / "v1").glob("*_pb2*"))
    assert generated, "protoc generated nothing"
    stale = []
    for path in generated:
        # make proto makes the stubs' imports of each other relative (Makefile)
        want = path.read_text().replace("from specpool.v1 import", "from . import")
        committed = STUBS / path.name
        if not committed.exists() or committed.read_text() != want:
            stale.append(path.name)
    assert not stale, f"stubs differ from the protos, run `make proto`: {stale}"
