"""The `kvmesh` command: offline inference, model generation (and, with the mesh, the services).

Every subcommand takes flags; an unknown flag is an error. Sizes accept suffixes (`512MiB`, `2GiB`).
"""

from __future__ import annotations

import argparse
import errno
import re
import sys
from pathlib import Path

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|KB|MB|GB)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_size(text: str) -> int:
    """'512MiB' -> bytes. argparse turns the ValueError into a usage error naming the flag."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 536870912, 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])


def _at_least_one(text: str) -> int:
    """argparse type: a whole number >= 1 (an error naming the value otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, help="Hugging Face checkpoint folder (default: the generated default model)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto: CUDA when torch sees a device)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="override the checkpoint's dtype (default: bfloat16 on CUDA, the checkpoint's on the CPU)")
    p.add_argument("--kv-memory", type=parse_size, default=1 << 30, help="KV cache memory (default 1GiB)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    p.add_argument("--max-batched-tokens", type=int,
                   help="tokens per step (default 1024; 2048 for bfloat16 on a CPU with AVX512-BF16 or AMX)")
    p.add_argument("--max-num-seqs", type=int, default=128, help="running sequences at most (default 128)")
    p.add_argument("--victim-policy", choices=["newest", "priority", "size"], default="newest")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prompt prefix sharing")
    p.add_argument("--threads", type=int, help="torch threads (default: one per core)")


def engine_from_args(args: argparse.Namespace):
    from kvmesh.engine import EngineConfig, LLMEngine, set_threads
    from kvmesh.modelgen import default_model_dir
    from kvmesh.services.scheduler.core import SchedulerConfig

    set_threads(args.threads)
    model_dir = args.model or default_model_dir()
    config = EngineConfig(
        model=model_dir,
        device=args.device,
        dtype=args.dtype,
        page_size=args.page_size,
        kv_memory_bytes=args.kv_memory,
        enable_prefix_caching=not args.no_prefix_caching,
        scheduler=SchedulerConfig(args.max_batched_tokens, args.max_num_seqs, args.victim_policy),
    )
    return LLMEngine(config), model_dir


def cmd_offline(args: argparse.Namespace) -> int:
    from kvmesh.offline import load_tokenizer, run_offline

    from kvmesh.services.config import UnusableSetting

    lines = [line for line in args.input.read_text(encoding="utf-8").splitlines() if line.strip()]
    try:
        engine, model_dir = engine_from_args(args)
    except UnusableSetting as e:
        print(f"kvmesh offline: error: {e}", file=sys.stderr)
        return 2
    with open(args.output, "w", encoding="utf-8") as out:
        counts = run_offline(engine, load_tokenizer(model_dir), lines, out, progress=not args.quiet)
    print(f"{counts['completed']} completed, {counts['errors']} rejected -> {args.output}", file=sys.stderr)
    return 0


def cmd_make_model(args: argparse.Namespace) -> int:
    from kvmesh.modelgen import SIZES, make_model

    out = make_model(args.out, args.arch, seed=args.seed, dtype=args.dtype, **SIZES[args.size])
    print(out)
    return 0


SERVICES = ("router", "scheduler", "kvcache", "worker")


def cmd_serve(args: argparse.Namespace) -> int:
    import importlib
    import logging

    from kvmesh.services import config as c
    from kvmesh.services.grpc_server import run_service

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cls = c.SERVICE_CONFIGS[args.service]
    try:
        c.check_environment(c.service_classes(args.service))
        common, cfg = c.from_args(c.CommonConfig, args), c.from_args(cls, args)
    except ValueError as e:
        print(f"kvmesh serve {args.service}: error: {e}", file=sys.stderr)
        return 2
    if args.check:
        print(f"{args.service}: configuration ok: {c.describe(common)} {c.describe(cfg)}")
        return 0
    module = importlib.import_module(f"kvmesh.services.{args.service}.server")
    try:
        run_service(module.serve(common, cfg))
    except c.UnusableSetting as e:  # a setting this machine cannot honour (a CUDA device it lacks, a memory budget)
        print(f"kvmesh serve {args.service}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
            raise
        print(f"kvmesh serve {args.service}: error: {e.strerror}", file=sys.stderr)  # a port taken: say which
        return 1
    return 0


# `kvmesh up` flags for the settings people change most, each passed to the one service that reads it
# (the rest: --SERVICE-arg).
UP_SETTINGS = {"scheduler": ("max_num_seqs", "max_batched_tokens", "max_prefill_chunk", "backlog_decode_every",
                             "victim_policy", "batching", "kv_fetch"),
               "worker": ("device", "dtype", "kv_memory_mib", "gpu_memory_utilization", "kv_offload_mib", "threads",
                          "page_size"),
               "router": ("api_keys", "api_keys_file", "served_model_name", "stream_interval")}


def add_up_service_flags(p: argparse.ArgumentParser) -> None:
    import dataclasses

    from kvmesh.services import config as c

    for service, names in UP_SETTINGS.items():
        fields = {f.name: f for f in dataclasses.fields(c.SERVICE_CONFIGS[service])}
        for name in names:
            kind = c.field_type(c.SERVICE_CONFIGS[service], name)
            p.add_argument("--" + name.replace("_", "-"), type=kind, metavar=kind.__name__.upper(),
                           help=f"{service}: {fields[name].metadata.get('help', '')}")
    for service in SERVICES:
        p.add_argument(f"--{service}-arg", action="append", default=[], metavar="ARG",
                       help=f"more arguments for every {service}, as `kvmesh serve {service}` takes them; "
                            f"write the value with '=' or in quotes: --{service}-arg=--flag=VALUE (repeatable)")


def up_service_args(args: argparse.Namespace) -> dict[str, list[str]]:
    """Service -> the arguments `kvmesh up` adds to its command line."""
    import shlex

    out: dict[str, list[str]] = {service: [] for service in SERVICES}
    for service, names in UP_SETTINGS.items():
        for name in names:
            if (value := getattr(args, name)) is not None:
                out[service] += ["--" + name.replace("_", "-"), str(value)]
    for service in SERVICES:
        for arg in getattr(args, f"{service}_arg"):
            out[service] += shlex.split(arg)
    return out


def cmd_up(args: argparse.Namespace) -> int:
    from kvmesh.services import config as c
    from kvmesh.services.launcher import up
    from kvmesh.services.router.pools import parse_models

    try:  # each service gets the variables it reads; one that none reads is a mistake
        c.check_environment([c.CommonConfig, *c.SERVICE_CONFIGS.values()])
    except ValueError as e:
        print(f"kvmesh up: error: {e}", file=sys.stderr)
        return 2

    if not args.model:
        model = None
    elif len(args.model) == 1 and "=" not in args.model[0]:
        model = args.model[0]
    else:
        try:
            model = parse_models(",".join(args.model), "default")
        except ValueError as e:
            print(f"kvmesh up: error: --model: {e}", file=sys.stderr)
            return 2
    from kvmesh.services.tls import check_files

    try:
        check_files({"--tls-cert": args.tls_cert or "", "--tls-key": args.tls_key or ""})
    except ValueError as e:
        print(f"kvmesh up: error: {e}", file=sys.stderr)
        return 2
    return up(model, args.workers, args.redis_url, args.port, args.http_port, args.autoscale, up_service_args(args),
              tls=args.tls, tls_cert=args.tls_cert or "", tls_key=args.tls_key or "", tls_names=args.tls_name,
              schedulers=args.schedulers)


def client_channel(args: argparse.Namespace, aio: bool = False):
    """A CLI client's channel (grpc.aio with `aio`) to `args.addr`: TLS to the router's public port with
    `--tls-ca` (or `--tls`: gRPC's bundled roots), else mTLS with the mesh identity (for an internal
    service) when `--mesh-*` or KVMESH_MESH_* name one, else plaintext. ValueError for bad settings."""
    from kvmesh.services import config as c
    from kvmesh.services.tls import channel, mesh_channel, mesh_identity, public_client_credentials

    if args.tls_ca or args.tls:
        return channel(args.addr, public_client_credentials(args.tls_ca), aio=aio)
    if getattr(args, "plaintext", False) or not hasattr(args, "mesh_ca"):
        return channel(args.addr, aio=aio)
    return mesh_channel(args.addr, mesh_identity(c.from_args(c.MeshTLSConfig, args)), aio=aio)


def add_client_tls_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", help="the router's public port has TLS: trust this CA certificate (PEM)")
    p.add_argument("--tls", action="store_true", help="the router's public port has TLS: trust gRPC's bundled roots")


def cmd_rollout(args: argparse.Namespace) -> int:
    """Starts, shows or aborts a model pool's canary rollout; the state lives in Redis, where the
    pool's scheduler drives it and every router reads the traffic split."""
    import asyncio

    from kvmesh.services import rollout_admin

    try:
        return asyncio.run(rollout_admin.run(args))
    except ValueError as e:
        print(f"kvmesh rollout {args.action}: error: {e}", file=sys.stderr)
        return 2


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 when the gRPC health check at the address answers SERVING (for container health checks)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        channel = client_channel(args)
    except (ValueError, OSError) as e:
        print(f"kvmesh health: error: {e}", file=sys.stderr)
        return 2
    with channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=args.service),
                                                               timeout=args.timeout).status
        except grpc.RpcError as e:
            print(f"{args.addr}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print(f"{args.addr}: {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}")
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


def cmd_certs(args: argparse.Namespace) -> int:
    from kvmesh.services.tls import MESH_NAMES, MeshCertificates

    certs = MeshCertificates.create(args.out, args.name)
    print(f"CA {certs.ca_path}; certificates for {', '.join(MESH_NAMES)} in {certs.folder}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Streams one completion; when the stream breaks (the router died), reconnects by request_id
    and goes on where it stopped (kvmesh.client)."""
    import asyncio

    import grpc

    from kvmesh import client
    from kvmesh.v1 import generation_pb2 as gen
    from kvmesh.v1 import generation_pb2_grpc

    request = gen.GenerateRequest(model=args.model, prompt=args.prompt,
                                  sampling=gen.SamplingParams(temperature=args.temperature),
                                  stopping=gen.StoppingParams(max_new_tokens=args.max_new_tokens, stop=args.stop))

    def reconnecting(e: grpc.aio.AioRpcError) -> None:
        print(f"\n[stream broke: {e.code().name}; resuming]", file=sys.stderr)

    async def run() -> int:
        async with client_channel(args, aio=True) as channel:
            try:
                async for response in client.generate([generation_pb2_grpc.GenerationStub(channel)], request,
                                                      on_reconnect=reconnecting):
                    for token in response.tokens:
                        print(token.text, end="", flush=True)
                    if response.HasField("finish"):
                        f = response.finish
                        resumed = f", resumed {f.resumes} times" if f.resumes else ""
                        print(f"\n[{gen.FinishReason.Name(f.reason).lower()}] prompt {f.prompt_tokens} tokens "
                              f"({f.cached_prompt_tokens} cached), completion {f.completion_tokens} tokens; "
                              f"queue {f.queue_ms:.0f} ms, first token {f.ttft_ms:.0f} ms, total {f.total_ms:.0f} ms"
                              f"{resumed}", file=sys.stderr)
            except grpc.aio.AioRpcError as e:
                print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
                return 1
        return 0

    return asyncio.run(run())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh", description="kvmesh: LLM inference over a mesh of gRPC services")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("offline", help="batch inference from a JSONL file")
    add_engine_flags(p)
    p.add_argument("--input", type=Path, required=True, help="JSONL requests")
    p.add_argument("--output", type=Path, required=True, help="JSONL results, in input order")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_offline)

    from kvmesh.modelgen import SIZES

    p = sub.add_parser("make-model", help="write a small random checkpoint with a BPE tokenizer")
    p.add_argument("--arch", choices=["llama", "mistral", "qwen2"], default="llama")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_make_model)

    from kvmesh.services import config as c

    p = sub.add_parser("serve", help="run one service of the mesh")
    services = p.add_subparsers(dest="service", required=True)
    for name in SERVICES:
        sp = services.add_parser(name, help=f"run the {name}")
        c.add_flags(sp, c.CommonConfig)
        c.add_flags(sp, c.SERVICE_CONFIGS[name])
        sp.add_argument("--check", action="store_true", help="validate the configuration and exit")
        sp.set_defaults(func=cmd_serve)

    p = sub.add_parser("up", help="run a whole local mesh (Redis, kvcache, scheduler, workers, router)")
    p.add_argument("--model", action="append", metavar="DIR|NAME=DIR",
                   help="checkpoint folder (default: the generated default model); NAME=DIR, repeated, starts one pool per model")
    p.add_argument("--workers", type=int, default=1, help="workers per pool")
    p.add_argument("--schedulers", type=_at_least_one, default=1,
                   help="schedulers per pool: each owns some of the pool's workers, and the others adopt them when it dies")
    p.add_argument("--autoscale", action="store_true",
                   help="start and stop workers to the count each pool's scheduler asks for (token queue, TTFT SLO, warm pool)")
    p.add_argument("--redis-url", help="use this Redis instead of starting redis-server")
    p.add_argument("--port", type=int, default=50051, help="router gRPC port")
    p.add_argument("--http-port", type=int, default=8000, help="router HTTP port (OpenAI-compatible API, /metrics)")
    add_up_service_flags(p)
    p.add_argument("--tls", action="store_true",
                   help="mTLS between the services: a private CA and a certificate per service in the state folder")
    p.add_argument("--tls-name", action="append", default=[], metavar="NAME",
                   help="with --tls: another DNS name or IP the certificates carry (repeatable; always: localhost, 127.0.0.1, ::1, the hostname)")
    p.add_argument("--tls-cert", help="TLS on the router's public ports (gRPC and HTTP): its certificate chain (PEM)")
    p.add_argument("--tls-key", help="the private key of --tls-cert (PEM)")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("rollout", help="canary rollouts of a model pool: start, status, abort")
    p.add_argument("action", choices=["start", "status", "abort"])
    p.add_argument("--model", required=True, help="the pool (model name)")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--canary", help="start: the new version")
    p.add_argument("--stable", help="start: the version serving now (default: the pool's only other ready version)")
    p.add_argument("--steps", default="1,5,25,50,100", help="start: canary traffic percents, the last 100")
    p.add_argument("--interval", default="60s", help="start: how long each step must stay healthy (e.g. 60s, 5m)")
    p.add_argument("--min-requests", type=int, default=20, help="start: canary requests a window needs before advancing")
    p.add_argument("--max-p99-ratio", type=float, default=1.2,
                   help="start: roll back when the canary's p99 latency is above this many times the stable's")
    p.add_argument("--reason", default="aborted by hand", help="abort: recorded in the history")
    p.set_defaults(func=cmd_rollout)

    p = sub.add_parser("health", help="check a service's gRPC health (exit 0 when SERVING)")
    p.add_argument("addr", help="host:port of any kvmesh service")
    p.add_argument("--service", default="", help="a service name (default: the whole server)")
    p.add_argument("--timeout", type=float, default=3.0)
    c.add_flags(p, c.MeshTLSConfig)
    add_client_tls_flags(p)
    p.add_argument("--plaintext", action="store_true",
                   help="no TLS even when KVMESH_MESH_* are set (the router's public port without a certificate)")
    p.set_defaults(func=cmd_health)

    p = sub.add_parser("generate", help="stream a completion from a running mesh")
    p.add_argument("prompt")
    p.add_argument("--addr", default="127.0.0.1:50051")
    p.add_argument("--model", default="")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_client_tls_flags(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("certs", help="make a private CA and a certificate per service, for mTLS inside the mesh")
    p.add_argument("--out", type=Path, required=True, help="folder (an existing ca.pem and ca-key.pem there are reused)")
    p.add_argument("--name", action="append", default=[], metavar="NAME",
                   help="a DNS name or IP the certificates carry, besides loopback and the hostname (repeatable)")
    p.set_defaults(func=cmd_certs)

    from kvmesh import bench

    bench.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
