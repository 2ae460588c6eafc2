// AMX tiles for the avx512bf16 kernels: the tile configuration and the OS's permission to use them.
#pragma once
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <c10/util/Exception.h>

#include <cstdint>

namespace magicdec {

struct TileConfig {  // the 64-byte operand of ldtilecfg (palette 1)
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads `cfg` into this thread's tile unit. The compiler is told the config memory is read: GCC 12 does not see
// ldtilecfg read its operand and drops the stores that filled it.
inline void load_tiles(const TileConfig& cfg) {
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// Whether this process may use AMX tiles: Linux grants the tile state on request (once per process).
inline bool tiles_ready() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
  static const bool ready = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
  return ready;
}

// Fails the operator `op` with a clear error where the OS refused the tiles (a fault otherwise).
inline void require_tiles(const char* op) {
  TORCH_CHECK(tiles_ready(), op, ": the OS refused the AMX tile state");
}

}  // namespace magicdec
