// What the AMX kernels (amx_matmul.cpp, amx_attention.cpp) share: the target attribute that
// lets a file built without AMX compile AMX functions, and the tile configuration.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <string>

// Compiled for these extensions whatever -march says (the file is built without AMX by
// default); called only after amx_status() found the CPU and the OS ready for them.
#define ISOSERVE_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,f16c,fma")))

namespace isoserve {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

ISOSERVE_AMX inline void load_tile_config(const TileConfig& cfg) {
  // GCC 12 does not count ldtilecfg as reading its operand: with every field a constant it
  // dropped the stores that fill it (seen in a scratch kernel, which then faulted on its first
  // tile load). The barrier keeps them whatever the compiler can prove.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

}  // namespace isoserve

// "" when the AMX kernels can run here, else why not (amx_matmul.cpp).
std::string amx_status();
