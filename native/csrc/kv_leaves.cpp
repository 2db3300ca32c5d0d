// The int8 / int4 KV cache's paged decode attention (kv_attend.h: the body the extension's kv_quant.cpp runs) as
// three leaves, one per ISA path, and the prompt tiles over it as two (kv_attend_quant_tile_avx2 / _avx512), for
// the CPU emulator and ctypes (native/kv_leaves.py builds this file
// freestanding: no libc, no relocations, one pointer argument; tests/test_kv_quant_emulated.py runs it).
//
// Each leaf runs every (sequence, KV head) task of one call serially, in the extension's task order (the order
// changes no bit: a task writes only its own output rows), with the caller's scores buffer. The extension's
// argument checks stay in kv_quant.cpp (torch tensors); a leaf trusts its pointers and checks only what decides
// whether its path can run the shape at all, returning nonzero instead of running it.
#include "kv_attend.h"

extern "C" {

// kv_attend_quant_*'s argument: paged_decode_attention_quant's tensors as raw pointers (kv_quant.cpp documents
// them; native/kv_leaves.py's Args mirrors this struct field for field).
struct kv_attend_args {
  const float* q;              // [T, H, D] with strides q_row, q_head (floats), D contiguous
  float* out;                  // [T, H, D] contiguous
  const int64_t* rows;         // [B]: the row of q and out of sequence b
  const int64_t* tables;       // [B, width] block ids
  const int64_t* lens;         // [B] context lengths, 1 .. width * block_size
  const uint8_t* k_codes;      // [num_blocks * block_size, H_kv, D * bits / 8]
  const uint16_t* k_scales;    // [num_blocks * block_size, H_kv, D / G] float16 bits
  const uint8_t* v_codes;
  const uint16_t* v_scales;
  float* scores;               // (H / H_kv) * max over b of (lens[b] - first) floats, overwritten
  int64_t q_row, q_head;
  int64_t B, H, D, H_kv, width, block_size;
  int64_t window;              // tokens, or <= 0: the whole context
  int64_t G;                   // elements per scale
  float scale;                 // the softmax scale (q . k times it)
  int32_t bits;                // 8 or 4
};

// kv_half_to_float_*'s argument: n float16 bits at h -> n floats at out.
struct kv_half_args {
  const uint16_t* h;
  float* out;
  int64_t n;
};

}  // extern "C"

namespace {

namespace kvq = kvserve::kv_quant;

// Whether the body takes the shape (kv_quant.cpp's check_quant_cache and shape_fits, without messages), and the
// QuantAttend of it.
bool unpack(const kv_attend_args& p, kvq::QuantAttend* a) {
  if ((p.bits != 8 && p.bits != 4) || p.G < 1 || p.D % p.G != 0 || p.G % (p.bits == 8 ? 8 : 16) != 0 ||
      !kvq::shape_fits(p.D, p.G) || p.H_kv < 1 || p.H % p.H_kv != 0 || p.block_size < 1)
    return false;
  *a = {{p.q, p.q_row, p.q_head, p.out, p.rows, p.tables, p.lens, p.B, p.H, p.D, p.H_kv, p.H / p.H_kv, p.width,
         p.block_size, p.scale, p.window},
        p.k_codes, p.k_scales, p.v_codes, p.v_scales, p.bits, p.G};
  return true;
}

template <class Attend>
int attend_all(const kv_attend_args* p, Attend&& attend_head) {
  kvq::QuantAttend a;
  if (!unpack(*p, &a)) return 1;
  for (int64_t task = 0; task < a.call.B * a.call.H_kv; ++task)
    attend_head(a, task / a.call.H_kv, task % a.call.H_kv, p->scores);
  return 0;
}

}  // namespace

// 0 after writing out's rows of every sequence; 1, writing nothing, if the path does not take the shape (bits not
// 8 or 4, G not dividing D or not a multiple of 8 (int8) / 16 (int4), D > 512, more than 64 scales, H not a
// multiple of H_kv; the AVX-512 path also G not a multiple of 16 / 32: kv_quant.cpp runs AVX2 there).
extern "C" int kv_attend_quant_scalar(const kv_attend_args* args) {
  return attend_all(args, kvq::base::attend_head);
}

// Each path's float16 -> float of the scales (base: integer operations; the vector paths: vcvtph2ps, which the
// AVX-512 path shares), so a test checks every float16 value's conversion.
extern "C" void kv_half_to_float_scalar(const kv_half_args* args) {
  for (int64_t i = 0; i < args->n; ++i) args->out[i] = kvq::base::half_to_float(args->h[i]);
}

#ifdef KV_X86

extern "C" void kv_half_to_float_avx2(const kv_half_args* args) {
  for (int64_t i = 0; i < args->n; ++i) args->out[i] = kvq::avx2::half_to_float(args->h[i]);
}

extern "C" int kv_attend_quant_avx2(const kv_attend_args* args) { return attend_all(args, kvq::avx2::attend_head); }

extern "C" int kv_attend_quant_avx512(const kv_attend_args* args) {
  if (!kvq::avx512_takes(args->bits, args->G)) return 1;
  return attend_all(args, kvq::avx512::attend_head);
}

namespace {

// The extension's prompt tiles (kv_quant.cpp): every row of the call, which the caller makes one prompt's
// consecutive rows (context lengths growing by one over one block table), as one tile per KV head, each chunk of
// code rows dequantized once (kv_attend.h's QuantPool) for the float32 cache's tile on attend_tile's AVX-512
// branch or its AVX2 one. scores: group * the sum over b of (lens[b] - first) floats. 1, writing nothing, where
// the extension does not tile (D not a multiple of 8 or over QuantPool::kMaxD) or over kMaxQueries vectors.
constexpr int64_t kMaxQueries = 256;

int attend_tiled(const kv_attend_args* p, bool avx512) {
  kvq::QuantAttend a;
  if (!unpack(*p, &a) || p->D % 8 != 0 || p->D > kvq::QuantPool::kMaxD || p->B * a.call.group > kMaxQueries)
    return 1;
  const kvserve::decode::DecodeCall& call = a.call;
  kvserve::decode::TileQuery qs[kMaxQueries];
  for (int64_t g = 0; g < call.H_kv; ++g) {
    int64_t n = 0;
    float* next = p->scores;
    for (int64_t b = 0; b < call.B; ++b)
      for (int64_t j = 0; j < call.group; ++j) {
        const int64_t first = call.first_of(b);
        qs[n++] = {call.q_of(b, g) + j * call.q_head, call.out_of(b, g) + j * call.D, first, call.lens[b], next};
        next += call.lens[b] - first;
      }
    const kvq::QuantPool pool(a, call.table_of(call.B - 1), g);
    kvserve::decode::attend_tile(avx512, qs, n, pool, call.D, call.scale);
  }
  return 0;
}

}  // namespace

extern "C" int kv_attend_quant_tile_avx2(const kv_attend_args* args) { return attend_tiled(args, false); }

extern "C" int kv_attend_quant_tile_avx512(const kv_attend_args* args) { return attend_tiled(args, true); }

#endif
