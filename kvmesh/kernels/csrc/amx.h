// AMX's tile units (Intel Xeon from Sapphire Rapids): whether this process may use them, and the
// one tile configuration kvmesh's kernels share (small_linear.cpp's decode products,
// prefill_attention.cpp's bfloat16 attention).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace kvmesh {

// Linux gives a process the tile registers only when it asks for them (arch_prctl), once.
inline bool amx_ready() {
  static const bool ready = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool tile = edx & (1u << 24), bf16 = edx & (1u << 22);
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return tile && bf16 && syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

// Palette 1, eight tiles of 16 rows x 64 bytes (16 float32 sums, or 32 bfloat16 values as 16
// pairs, a row): what each tile holds is the kernel's choice.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// Each thread loads the configuration before its first tile instruction and releases the tiles
// after its last (amx_ready() must have been true).
__attribute__((target("amx-tile"))) inline void amx_start() {
  static const TileConfig config;
  _tile_loadconfig(&config);
}

__attribute__((target("amx-tile"))) inline void amx_end() { _tile_release(); }

}  // namespace kvmesh
#endif
