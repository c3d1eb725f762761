import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
# Generated default models go to a per-run cache, never the user's.
os.environ.setdefault("KVMESH_CACHE", str(Path(__file__).parent.parent / ".pytest_cache" / "kvmesh"))
# Without a GPU, kvmesh's Triton kernels run in Triton's interpreter (read when a kernel is
# defined, so before anything imports kvmesh.kernels.triton_attention).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvmesh.modelgen import SIZES, make_model  # noqa: E402
from reference import save_hf_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Factory: a random checkpoint saved by transformers, one per (arch, overrides)."""
    made: dict = {}

    def make(arch: str = "llama", **overrides) -> Path:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = save_hf_checkpoint(arch, tmp_path_factory.mktemp(arch), **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny llama with a real tokenizer, for the tests that run the mesh."""
    return make_model(tmp_path_factory.mktemp("mesh-model"), "llama", **SIZES["tiny"])


@pytest.fixture(scope="session")
def long_model_dir(tmp_path_factory):
    """The tiny llama with a 131,072-token context: a request for local_mesh.LONG_REQUEST tokens outlasts any
    test on any machine, so a test that needs a request still running (a blocker, an abandoned
    stream) cancels it instead of racing its end."""
    return make_model(tmp_path_factory.mktemp("long-model"), "llama",
                      **{**SIZES["tiny"], "max_position_embeddings": 1 << 17})


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A redis-server of the test module's own (never a shared one): its URL."""
    from kvmesh.services.children import free_port
    from local_mesh import start_redis

    port = free_port()
    process = start_redis(port, str(tmp_path_factory.mktemp("redis")))
    yield f"redis://127.0.0.1:{port}/0"
    process.kill()
    process.wait()


@pytest.fixture(scope="module")
def mesh(model_dir):
    """A one-worker mesh per test module (modules that need another shape define their own `mesh`)."""
    from local_mesh import Mesh

    m = Mesh(model_dir, workers=1)
    yield m
    m.close()


@pytest.fixture(scope="module")
def receiver():
    """An OTLP trace endpoint (otlp_receiver.Receiver) for a module's mesh; `receiver.env` points services at it."""
    from otlp_receiver import Receiver

    r = Receiver()
    yield r
    r.server.stop(0)
