"""`kvmesh up` as a supervisor: a killed service comes back on the same ports and the mesh serves
again, and a service that cannot start is named with its cause and its log, within seconds.

Real processes and real signals: `kvmesh up` runs as a user starts it, on the default model, and
its children are killed with SIGKILL."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest

from kvmesh.services.children import Child, free_port, redis_answers
from kvmesh.services.config import service_environment
from kvmesh.services.supervisor import MAX_FAILED_STARTS, Supervisor
from kvmesh.v1 import generation_pb2 as gen
from kvmesh.v1 import generation_pb2_grpc, kvcache_pb2, kvcache_pb2_grpc

API_KEY = "supervision-test-key"
KV_MEMORY_MIB = 32
# Generous: the work these bound takes seconds, but the machine may be loaded (2 cores, several suites).
START_S, RECOVER_S, FAIL_S = 300, 120, 60


def kvmesh(*args, env=None, timeout=FAIL_S):
    """Runs the kvmesh command to its end: (exit code, stderr, seconds taken)."""
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "kvmesh.cli", *args], capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, **(env or {})})
    return out.returncode, out.stderr, time.monotonic() - started


class Up:
    """A running `kvmesh up` (default model, one worker) and what its summary says."""

    def __init__(self, out_path: Path):
        self.port, self.http_port = free_port(), free_port()
        self.out_path = out_path
        env = {**os.environ, "KVMESH_MAX_NUM_SEQS": "4"}  # a scheduler setting: stopped every other service before
        with open(out_path, "w") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kvmesh.cli", "up", "--workers", "1", "--port", str(self.port),
                 "--http-port", str(self.http_port), "--kv-memory-mib", str(KV_MEMORY_MIB), "--api-keys", API_KEY],
                stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + START_S
        while "\nready." not in self.output():
            assert self.process.poll() is None, f"kvmesh up exited:\n{self.output()}"
            assert time.monotonic() < deadline, f"kvmesh up was not ready in {START_S}s:\n{self.output()}"
            time.sleep(0.2)
        # "NAME  gRPC HOST:PORT ..." per service, "redis  redis://HOST:PORT/0", "logs  DIR"
        self.addresses = dict(re.findall(r"^(\S+)\s+gRPC (\S+)", self.output(), re.M))
        self.addresses["redis"] = re.search(r"^redis\s+redis://([^/\s]+)", self.output(), re.M).group(1)

    def output(self) -> str:
        return self.out_path.read_text()

    def child(self, name: str) -> psutil.Process:
        """The process `kvmesh up` runs now for `name` (redis: its redis-server)."""
        for p in psutil.Process(self.process.pid).children():
            cmd = p.cmdline()
            if (name == "redis" and "redis-server" in Path(cmd[0]).name) or \
                    (name != "redis" and "serve" in cmd and self.addresses[name].rsplit(":", 1)[1] in cmd
                     and p.status() != psutil.STATUS_ZOMBIE):
                return p
        raise LookupError(name)

    def serving(self, name: str) -> bool:
        if name == "redis":
            return redis_answers(self.addresses[name], 1)
        return Child(name, self.addresses[name], None, "").serving()

    def generate(self, prompt: str, n: int = 4) -> list[int]:
        """A greedy request through the router's gRPC port; the token ids."""
        request = gen.GenerateRequest(prompt=prompt, sampling=gen.SamplingParams(temperature=0.0),
                                      stopping=gen.StoppingParams(max_new_tokens=n, ignore_eos=True))
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            responses = list(stub.Generate(request, timeout=30, metadata=(("authorization", f"Bearer {API_KEY}"),)))
        assert responses[-1].finish.reason == gen.LENGTH
        return [t.id for r in responses for t in r.tokens]

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    mesh = Up(tmp_path_factory.mktemp("up") / "kvmesh-up.out")
    yield mesh
    if mesh.process.poll() is None:
        mesh.stop()


def test_kvmesh_up_passes_settings_to_the_service_that_reads_them(up):
    # --api-keys reaches the router: a call without the key is refused, one with it served.
    with grpc.insecure_channel(f"127.0.0.1:{up.port}") as channel:
        with pytest.raises(grpc.RpcError) as refused:
            list(generation_pb2_grpc.GenerationStub(channel).Generate(gen.GenerateRequest(prompt="hi"), timeout=30))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert len(up.generate("settings")) == 4
    # --kv-memory-mib reaches the worker: its pool holds that much KV memory, not the 1 GiB default.
    with grpc.insecure_channel(up.addresses["kvcache"]) as channel:
        [worker] = kvcache_pb2_grpc.KVCacheStub(channel).Stats(kvcache_pb2.StatsRequest(), timeout=10).workers
    from kvmesh.modelgen import default_model_dir
    from kvmesh.services.worker.checkpoint import load_config

    cfg = load_config(default_model_dir())
    page_bytes = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4  # float32, 16 tokens a page
    assert worker.total_pages == (KV_MEMORY_MIB << 20) // page_bytes
    # KVMESH_MAX_NUM_SEQS, a scheduler setting, reaches the scheduler and no other service.
    assert up.child("scheduler").environ().get("KVMESH_MAX_NUM_SEQS") == "4"
    assert "KVMESH_MAX_NUM_SEQS" not in up.child("router").environ()
    assert "KVMESH_MAX_NUM_SEQS" not in up.child("worker-0").environ()


@pytest.mark.parametrize("name", ["scheduler", "router", "kvcache", "redis", "worker-0"])
def test_a_killed_service_comes_back_on_its_ports_and_the_mesh_serves_again(up, name):
    before = up.generate("the same prompt")
    old = up.child(name)
    old.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    deadline = killed + RECOVER_S
    while True:  # the same address answers from a new process, and a new request succeeds
        try:
            new = up.child(name)
            if new.pid != old.pid and up.serving(name) and up.generate("the same prompt") == before:
                break
        except (LookupError, grpc.RpcError, psutil.Error):
            pass
        assert up.process.poll() is None, f"kvmesh up exited after {name} was killed:\n{up.output()}"
        assert time.monotonic() < deadline, f"no answer {RECOVER_S}s after {name} was killed:\n{up.output()}"
        time.sleep(0.3)
    elapsed = time.monotonic() - killed
    print(f"{name}: serving again {elapsed:.1f}s after SIGKILL")
    assert up.process.poll() is None  # kvmesh up itself never stopped
    assert f"{name} exited with code -9" in up.output() and f"{name} restarted" in up.output()


def test_ctrl_c_or_sigterm_stops_kvmesh_up_and_every_service(up):
    children = psutil.Process(up.process.pid).children()
    assert up.stop() == 0
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive


def test_a_taken_http_port_is_named_before_anything_starts():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err, took = kvmesh("up", "--port", str(free_port()), "--http-port", str(port))
    assert code == 1 and took < FAIL_S
    assert f"router cannot start: its HTTP port (--http-port) 127.0.0.1:{port} is taken" in err
    assert "Traceback" not in err


def test_the_router_names_its_taken_http_port_itself(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err, took = kvmesh("serve", "router", "--model", str(model_dir), "--redis-url", "redis://127.0.0.1:1/0",
                                 "--port", "0", "--http-port", str(port))
    assert code == 1
    assert f"cannot serve HTTP on 127.0.0.1:{port} (--http-port)" in err and "gRPC" not in err
    assert "Traceback" not in err


def test_a_missing_model_folder_is_named_with_the_service_and_its_log(tmp_path):
    missing = tmp_path / "no-such-model"
    code, err, took = kvmesh("up", "--model", str(missing), "--port", str(free_port()), "--http-port", str(free_port()))
    assert code == 1 and took < FAIL_S, err
    service = re.search(r"kvmesh up: (router|worker-0) failed at start \(exit code 2\)", err)
    assert service, err
    assert f"model: {missing} is not a checkpoint folder (it does not exist)" in err
    log = re.search(r"log: (\S+)", err).group(1)
    assert Path(log).name == f"{service.group(1)}.log" and str(missing) in Path(log).read_text()


def test_an_unreachable_redis_is_named_with_its_url():
    url = f"redis://127.0.0.1:{free_port()}/0"
    code, err, took = kvmesh("up", "--redis-url", url, "--port", str(free_port()), "--http-port", str(free_port()))
    assert code == 1 and took < FAIL_S
    assert f"redis at {url} does not answer" in err and "Connection refused" in err


def test_worker_check_fails_on_a_folder_without_a_checkpoint(tmp_path):
    code, err, _ = kvmesh("serve", "worker", "--model", str(tmp_path), "--check")
    assert code == 2 and f"model: {tmp_path} is not a checkpoint folder (it has no config.json)" in err


def test_kvmesh_up_refuses_a_variable_no_service_reads():
    code, err, _ = kvmesh("up", env={"KVMESH_MAX_NUM_SEQ": "4"})
    assert code == 2 and "unknown setting KVMESH_MAX_NUM_SEQ " in err


def test_each_service_gets_only_the_variables_it_reads():
    env = {"KVMESH_MAX_NUM_SEQS": "8", "KVMESH_API_KEYS": "k", "KVMESH_REDIS_URL": "redis://r:1/0", "PATH": "/bin"}
    assert service_environment("scheduler", env) == {"KVMESH_MAX_NUM_SEQS": "8", "KVMESH_REDIS_URL": "redis://r:1/0",
                                                     "PATH": "/bin"}
    assert service_environment("router", env) == {"KVMESH_API_KEYS": "k", "KVMESH_REDIS_URL": "redis://r:1/0",
                                                  "PATH": "/bin"}


def test_a_service_that_keeps_failing_at_start_stops_the_supervisor_with_its_last_lines(tmp_path):
    # A kvcache that served once, then dies at every start: the supervisor gives up, naming it.
    argv = (sys.executable, "-c", "import sys; print('kvcache: error: cannot open the prefix store'); sys.exit(3)")
    child = Child("kvcache", f"127.0.0.1:{free_port()}", None, "", "kvcache", argv=argv,
                  log_path=str(tmp_path / "kvcache.log"))
    child.start()
    supervisor = Supervisor([child], f"redis://127.0.0.1:{free_port()}/0", str(tmp_path))
    deadline = time.monotonic() + FAIL_S
    try:
        while (fatal := supervisor.poll()) is None:
            assert time.monotonic() < deadline, supervisor.events
            time.sleep(0.1)
    finally:
        supervisor.close()
    assert fatal.startswith(f"kvcache keeps failing at start ({MAX_FAILED_STARTS} times in a row, last exit code 3)")
    assert "| kvcache: error: cannot open the prefix store" in fatal
    assert f"log: {tmp_path / 'kvcache.log'}" in fatal
    assert sum("kvcache restarted" in e for e in supervisor.events) == MAX_FAILED_STARTS


def test_a_port_reserved_for_the_router_is_never_handed_to_another_service(monkeypatch):
    """`kvmesh up --http-port P` starts the router last; before the fix free_port could draw P
    for kvcache, which then answered the user's HTTP calls with gRPC frames."""
    from kvmesh.services import children

    def unused_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    reserved, other = unused_port(), unused_port()
    draws = iter([reserved, reserved, other])
    monkeypatch.setattr(children, "_ephemeral_low", lambda: 32768)  # ports are drawn, not left to the OS
    monkeypatch.setattr(children, "_draw", type("Draw", (), {"randrange": lambda self, a, b: next(draws)})())
    children.reserve_ports(reserved, None, 0)
    assert children.free_port() == other


SERVICE_WITH_A_LEFTOVER_TASK = """
import asyncio, logging, sys
from kvmesh.services.grpc_server import run_service

async def leftover():
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if sys.argv[1] == "stuck":
                continue  # the defect: the task goes on after its cancellation
            if sys.argv[1] == "fails":
                raise ValueError("failed while stopping")
            raise

async def serve():
    asyncio.create_task(leftover(), name="leftover")
    await asyncio.to_thread(sum, range(10))  # the default executor has a thread to end as well
    print("stopped", flush=True)

logging.basicConfig()
run_service(serve(), settle_s=1)
print("ended", flush=True)
"""


@pytest.mark.parametrize("task", ["ends", "fails", "stuck"])
def test_a_stopped_service_exits_whatever_its_leftover_tasks_do(task):
    """asyncio.run waits without limit for the tasks still running when a service's serve() returned:
    one that does not end when cancelled kept a router alive after SIGTERM. A service's process ends
    either way; a stuck task is named, with where it was, and the exit status says it (1); a task
    that fails as it ends is reported, as asyncio.run reports it."""
    out = subprocess.run([sys.executable, "-c", SERVICE_WITH_A_LEFTOVER_TASK, task], capture_output=True,
                         text=True, timeout=FAIL_S)
    if task == "ends":
        assert (out.returncode, out.stdout, out.stderr) == (0, "stopped\nended\n", "")
    elif task == "fails":
        assert (out.returncode, out.stdout) == (0, "stopped\nended\n")
        assert "unhandled exception while stopping" in out.stderr and "ValueError: failed while stopping" in out.stderr
    else:
        assert (out.returncode, out.stdout) == (1, "stopped\n")
        assert "stopping: task leftover did not end within 1 s of its cancellation" in out.stderr
        assert ", in leftover" in out.stderr  # its stack
