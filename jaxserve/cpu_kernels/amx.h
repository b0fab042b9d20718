// What both CPU kernels (linear.cc, paged_attention.cc) need to use Intel AMX's tiles.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace jaxserve {

// The operand of ldtilecfg (palette 1): each tile's rows and bytes a row.
struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands out AMX's tile state only to a process that asks for it (once); false
// where it refuses (a CPU without AMX).
inline bool RequestAmx() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool granted =
      syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

}  // namespace jaxserve
