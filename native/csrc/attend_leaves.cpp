// The KV cache's attention for one tile as leaves, for the CPU emulator and ctypes (native/attend_leaves.py builds
// this file freestanding: no libc, no relocations, one pointer argument; tests/test_attend_bf16_emulated.py and
// tests/test_attend_emulated.py run it): the bfloat16 cache's tile (attend_bf16.h: the body decode_ops.cpp's
// attend_decode_bf16 runs), one leaf per ISA path, and the float32 cache's (attend_tile.h: attend_decode's), one
// per vector path. A leaf runs one tile, as one (tile, KV head) task of the extension: the query vectors of one
// KV head g (a decode row's `group` heads, or those of a prompt's consecutive rows), with the caller's scratch.
#include "attend_bf16.h"

extern "C" {

// kv_attend_*'s argument (native/attend_leaves.py's Args mirrors it field for field).
struct kv_attend_args {
  const float* q;          // [n, D] the tile's query vectors, contiguous
  float* out;              // [n, D]
  const int64_t* first;    // [n] each vector's first key
  const int64_t* len;      // [n] each vector's key count (its keys: first .. len-1)
  float* scores;           // sum over j of len[j] - first[j] floats, overwritten
  uint16_t* qb;            // bfloat16 leaves: n * D bfloat16 values, overwritten
  const int64_t* table;    // block ids covering key max(len) - 1
  const void* kp;          // K, V [blocks, block_size, H_kv, D]: bfloat16 bits or float32, as the leaf's cache
  const void* vp;
  int64_t n, block_size, H_kv, g, D;
  float scale;
  int32_t scores_only;     // bfloat16 leaves: nonzero stops after the scores (attend_bf16.h's attend_tile)
};

}  // extern "C"

namespace {

namespace ba = kvserve::bf16_attend;
using kvserve::decode::TileQuery;

// The most query vectors a leaf takes (its TileQuery list lives on the stack); the extension's tiles hold
// kTileRows (32) rows of up to 8 heads each.
constexpr int64_t kMaxQueries = 256;

// The tile's query list into qs; false for a shape no leaf takes (n outside 1 .. kMaxQueries, D odd or over 512,
// a vector with no keys).
bool queries(const kv_attend_args* p, TileQuery* qs) {
  if (p->n < 1 || p->n > kMaxQueries || p->D < 2 || p->D % 2 != 0 || p->D > 512) return false;
  float* next = p->scores;
  for (int64_t j = 0; j < p->n; ++j) {
    if (p->first[j] < 0 || p->len[j] <= p->first[j]) return false;
    qs[j] = {p->q + j * p->D, p->out + j * p->D, p->first[j], p->len[j], next};
    next += p->len[j] - p->first[j];
  }
  return true;
}

// The bfloat16 tile: 0 after writing out; 1, writing nothing, for a shape its path does not take (above, or a
// vector path with D not a multiple of 32).
int attend_bf16(const kv_attend_args* p, kvserve::cpu::Isa isa) {
  TileQuery qs[kMaxQueries];
  if ((isa != kvserve::cpu::Isa::kScalar && !ba::vector_takes(p->D)) || !queries(p, qs)) return 1;
  const ba::Tile tile{p->table, static_cast<const uint16_t*>(p->kp), static_cast<const uint16_t*>(p->vp),
                      p->block_size, p->H_kv, p->g, p->D, p->scale};
  ba::attend_tile(isa, qs, p->n, tile, p->qb, p->scores_only != 0);
  return 0;
}

#ifdef KV_X86

// The float32 tile on attend_tile's AVX-512 branch (AVX-512 for D a multiple of 16, else AVX2, as the extension
// takes it) or its AVX2 one: 0 after writing out; 1, writing nothing, for a shape the extension does not give the
// vector tiles (above, or D not a multiple of 8).
int attend_f32(const kv_attend_args* p, bool avx512) {
  TileQuery qs[kMaxQueries];
  if (p->D % 8 != 0 || !queries(p, qs)) return 1;
  kvserve::decode::attend_tile(avx512, qs, p->n, p->table, static_cast<const float*>(p->kp),
                               static_cast<const float*>(p->vp), p->block_size, p->H_kv, p->g, p->D, p->scale);
  return 0;
}

#endif

}  // namespace

extern "C" int kv_attend_bf16_scalar(const kv_attend_args* args) {
  return attend_bf16(args, kvserve::cpu::Isa::kScalar);
}

#ifdef KV_X86

extern "C" int kv_attend_bf16_avx2(const kv_attend_args* args) { return attend_bf16(args, kvserve::cpu::Isa::kAvx2); }

extern "C" int kv_attend_bf16_avx512(const kv_attend_args* args) {
  return attend_bf16(args, kvserve::cpu::Isa::kAvx512);
}

extern "C" int kv_attend_f32_avx2(const kv_attend_args* args) { return attend_f32(args, false); }

extern "C" int kv_attend_f32_avx512(const kv_attend_args* args) { return attend_f32(args, true); }

#endif
