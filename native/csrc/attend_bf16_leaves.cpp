// The bfloat16 KV cache's attention for one tile (attend_bf16.h: the body decode_ops.cpp's attend_decode_bf16
// runs) as three leaves, one per ISA path, for the CPU emulator and ctypes (native/attend_bf16_leaves.py builds
// this file freestanding: no libc, no relocations, one pointer argument; tests/test_attend_bf16_emulated.py runs
// it). A leaf runs one tile, as one (tile, KV head) task of the extension: the query vectors of one KV head g
// (a decode row's `group` heads, or those of a prompt's consecutive rows), with the caller's scratch.
#include "attend_bf16.h"

extern "C" {

// kv_attend_bf16_*'s argument (native/attend_bf16_leaves.py's Args mirrors it field for field).
struct kv_attend_bf16_args {
  const float* q;          // [n, D] the tile's query vectors, contiguous
  float* out;              // [n, D]
  const int64_t* first;    // [n] each vector's first key
  const int64_t* len;      // [n] each vector's key count (its keys: first .. len-1)
  float* scores;           // sum over j of len[j] - first[j] floats, overwritten
  uint16_t* qb;            // n * D bfloat16 values, overwritten
  const int64_t* table;    // block ids covering key max(len) - 1
  const uint16_t* kp;      // K, V bfloat16 bits [blocks, block_size, H_kv, D]
  const uint16_t* vp;
  int64_t n, block_size, H_kv, g, D;
  float scale;
  int32_t scores_only;     // nonzero: stop after the scores (attend_bf16.h's attend_tile), out untouched
};

}  // extern "C"

namespace {

namespace ba = kvserve::bf16_attend;

// The most query vectors a leaf takes (its TileQuery list lives on the stack); the extension's tiles hold
// kTileRows (32) rows of up to 8 heads each.
constexpr int64_t kMaxQueries = 256;

// 0 after writing out; 1, writing nothing, for a shape the path does not take (n outside 1 .. kMaxQueries, D odd
// or over 512, a vector path with D not a multiple of 32, a vector with no keys).
int attend(const kv_attend_bf16_args* p, kvserve::cpu::Isa isa) {
  if (p->n < 1 || p->n > kMaxQueries || p->D < 2 || p->D % 2 != 0 || p->D > 512 ||
      (isa != kvserve::cpu::Isa::kScalar && !ba::vector_takes(p->D)))
    return 1;
  kvserve::decode::TileQuery qs[kMaxQueries];
  float* next = p->scores;
  for (int64_t j = 0; j < p->n; ++j) {
    if (p->first[j] < 0 || p->len[j] <= p->first[j]) return 1;
    qs[j] = {p->q + j * p->D, p->out + j * p->D, p->first[j], p->len[j], next};
    next += p->len[j] - p->first[j];
  }
  const ba::Tile tile{p->table, p->kp, p->vp, p->block_size, p->H_kv, p->g, p->D, p->scale};
  ba::attend_tile(isa, qs, p->n, tile, p->qb, p->scores_only != 0);
  return 0;
}

}  // namespace

extern "C" int kv_attend_bf16_scalar(const kv_attend_bf16_args* args) {
  return attend(args, kvserve::cpu::Isa::kScalar);
}

#ifdef KV_X86

extern "C" int kv_attend_bf16_avx2(const kv_attend_bf16_args* args) { return attend(args, kvserve::cpu::Isa::kAvx2); }

extern "C" int kv_attend_bf16_avx512(const kv_attend_bf16_args* args) {
  return attend(args, kvserve::cpu::Isa::kAvx512);
}

#endif
