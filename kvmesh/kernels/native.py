"""kvmesh's own C++ kernels, compiled on first use with torch's extension builder.

`decode_attention()` returns the `torch.ops.kvmesh.decode_attention_` operator,
`prefill_attention()` `torch.ops.kvmesh.prefill_attention_`, `write_kv()`
`torch.ops.kvmesh.write_kv_`, `small_linear()`
`torch.ops.kvmesh.small_linear` (AVX-512 and AVX2), `decode_layers()`
`torch.ops.kvmesh.decode_layers` (a decode step's layers in one call, AVX-512 and AVX2) and
`fused_ops()` the fused elementwise operators (`rms_norm`, `rotary_`, `silu_mul`) and the
sampler's (`greedy_pick`, `draw`), or None
when they cannot be used here (no C++ compiler, `KVMESH_NATIVE_KERNELS=0`); callers then take
the portable path. All are in one library. The build is cached by torch (`TORCH_EXTENSIONS_DIR`,
by default `~/.cache/torch_extensions`), so it costs about ten seconds once per machine and
source version; `make install` runs it
(`python -m kvmesh.kernels.native`). The build folder is named by a hash of the sources and
flags, and a process that finds the library already built loads it directly: torch's builder
would otherwise take its file lock and run ninja at every process start, and rebuild whenever two
checkouts (different source paths) alternate, so a restarted worker waited on someone else's
build.

The instruction set is chosen from what torch itself detected on this CPU (AVX-512, AVX2 or
neither) and named in the extension, so a cache shared between machines never hands a CPU code
it cannot run.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger("kvmesh.kernels")

_SOURCES = [Path(__file__).with_name("csrc") / name
            for name in ("decode_attention.cpp", "prefill_attention.cpp", "kv_write.cpp", "fused_ops.cpp",
                         "small_linear.cpp", "decode_layers.cpp")]
_HEADERS = [Path(__file__).with_name("csrc") / name for name in ("paged_cache.h", "claims.h", "amx.h")]
# Each ISA's compiler flags, and the CPU_CAPABILITY torch builds the same code for: ATen's vector
# types (used by fused_ops.cpp) take their intrinsics and Sleef functions from it.
_ISA_FLAGS = {
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "base": ["-DCPU_CAPABILITY=DEFAULT"],
}
# No multiply and add fused into one rounding where the source does not ask for it: the fused
# elementwise operators promise torch's float32 results.
_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]


# A build takes seconds; a lock file much older than that was left by a process killed while it
# built, and torch would wait on it forever.
_STALE_LOCK_S = 300


def _clear_stale_lock(build_dir: Path) -> None:
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > _STALE_LOCK_S:
        log.warning("removing %s, left %.0f s ago by a build that did not finish", lock, age)
        lock.unlink(missing_ok=True)


def _wait_for_other_build(build_dir: Path, poll_s: float = 0.5) -> None:
    """Returns once no other process holds the build lock: when the lock is gone (its builder
    done: the library may be on disk before that, half linked), or when it turns stale
    (`_clear_stale_lock` removes it). torch's
    builder waits on a lock it finds for as long as the file exists, so a process that found a
    build under way when that build's process was then killed (a worker stopped by its supervisor
    mid-build, a launch that timed out) waited forever, and so did every later one."""
    lock = build_dir / "lock"
    while lock.exists():
        _clear_stale_lock(build_dir)
        time.sleep(poll_s)


@cache
def amx_tiles() -> bool:
    """Whether this CPU has AMX tile units that torch's oneDNN multiplies bfloat16 on (there its
    products beat kvmesh's AVX-512 kernels from a few rows: `kernels.linear`, `kernels.attention`)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return probe is not None and probe()


def _isa() -> str:
    capability = torch.backends.cpu.get_cpu_capability().lower()  # "avx512", "avx2", "default", ...
    return capability if capability in _ISA_FLAGS else "base"


def library_path() -> Path:
    """Where torch's extension builder puts the library for this source, flags and ISA: its own
    folder (the build root plus a Python/CUDA tag, e.g. py311_cpu/NAME), which a path made here by
    hand would miss, finding no library and waiting on torch's build lock at every start."""
    from torch.utils import cpp_extension

    isa = _isa()
    cflags = [*_CFLAGS, *_ISA_FLAGS[isa]]
    text = b"".join(src.read_bytes() for src in [*_SOURCES, *_HEADERS])
    digest = hashlib.sha256(text + " ".join(cflags).encode()).hexdigest()[:12]
    name = f"kvmesh_attention_{isa}_{digest}"
    return Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}.so"


@cache
def _library() -> bool:
    """Loads (building on first use) the library of kvmesh's operators; False where it cannot be built."""
    if os.environ.get("KVMESH_NATIVE_KERNELS", "1") == "0":
        return False
    cflags = [*_CFLAGS, *_ISA_FLAGS[_isa()]]
    try:
        from torch.utils import cpp_extension

        built = library_path()
        build_dir, name = built.parent, built.stem
        _wait_for_other_build(build_dir)
        if built.is_file():
            torch.ops.load_library(str(built))
        else:
            cpp_extension.load(name=name, sources=[str(src) for src in _SOURCES], extra_cflags=cflags,
                               extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as exc:  # no compiler, no ninja, a failed build: the portable path still works
        log.warning("kvmesh's C++ kernels are unavailable (%s); using torch's attention per sequence", exc)
        return False
    return True


@cache
def decode_attention():
    """The decode attention operator, built on first call; None where it cannot be built."""
    return torch.ops.kvmesh.decode_attention_ if _library() else None


@cache
def decode_shared_units():
    """The operator that says how the decode kernel groups a step's chunks by shared prefix pages
    (`decode_shared_units(indptr, slot_ids)`); None where the kernels cannot be built."""
    return torch.ops.kvmesh.decode_shared_units if _library() else None


@cache
def prefill_attention():
    """The prefill (chunk) attention operator, built on first call; None where it cannot be built."""
    return torch.ops.kvmesh.prefill_attention_ if _library() else None


@cache
def fused_ops():
    """The fused elementwise operators (`rms_norm`, `rotary_`, `silu_mul`) and the sampler's
    (`greedy_pick`, `draw`) as a namespace with those attributes; None where the library cannot be
    built."""
    return torch.ops.kvmesh if _library() else None


@cache
def small_linear():
    """The few-rows matrix product (`kernels.linear`), or None where the library cannot be built or
    has no vector path for it (AVX-512 and AVX2 builds have)."""
    return torch.ops.kvmesh.small_linear if _isa() in ("avx512", "avx2") and _library() else None


@cache
def decode_layers():
    """A decode step's decoder layers in one call (kernels/csrc/decode_layers.cpp: the per-layer
    operators in CausalLM.forward's order, without Python between them), or None where the
    few-rows kernel it multiplies with is missing."""
    return torch.ops.kvmesh.decode_layers if small_linear() is not None else None


@cache
def tile_products() -> bool:
    """Whether kvmesh's kernels multiply bfloat16 on AMX's tile units here (the few-rows products,
    prefill attention): an AVX-512 build, a CPU with AMX, and an OS that gave this process the tile
    registers (Linux 5.16 and later)."""
    return small_linear() is not None and _isa() == "avx512" and bool(torch.ops.kvmesh.amx_tiles_ready())


def small_linear_columns() -> int:
    """Output columns per block of the few-rows kernel's weight layout in this build."""
    return 32 if _isa() == "avx512" else 16


@cache
def write_kv():
    """The KV cache write operator (a row copy per token); None where the library cannot be built."""
    return torch.ops.kvmesh.write_kv_ if _library() else None


if __name__ == "__main__":
    op = decode_attention()
    print(f"kvmesh native kernels ({_isa()}): {'built' if op is not None else 'unavailable, using the portable path'}")
    sys.exit(0)
