/* The vector micro-kernels of ukernel_gguf.h, one body included once per ISA path inside a namespace that first
 * defines the path's lanes (no include guard: that is the point):
 *
 *   kW, kMR                 features per panel (32-bit lanes of I and F), rows per register tile
 *   I, F                    integer and float vectors of kW lanes
 *   ld(p), st(p, v), b8(v), b32(v), zero_i(), and_, or_, add, sub, mullo (32-bit lanes), shift(v, s) (left by s,
 *   right by -s), srl, sra, merge(low, high, mask) = low | (high & mask)
 *   cvt(I), half(p) (kW fp16), ldf, stf, bset, zero_f, mul, fma, neg, load_y / store_y (the first `cols` lanes)
 *   dots<R, MaxCode>(src, i, x, ldq, c0, c1, out)   out[r] += exact int32 dots of block i's chunks c0..c1-1
 *   madd16(acc, a, b)       acc + the int32 sums of a's and b's 16-bit lane pairs' products (vpdpwssd's)
 *   kScaledPairs, scaled_dots<R, P, B, MaxCode>(src, i0, x, ldq, c0, c1, sc16, isum), byte_pair_of, sbyte_pair_of
 *                           (AVX2) the K-quants' dots times their scales straight into the super-block's sums
 *   sbyte_pairs(v, t)       bytes 2t and 2t + 1 of each 32-bit lane as its two 16-bit halves, sign-extended
 *
 * Layouts and the arithmetic: ukernel_gguf.h. */

constexpr int kChunk = 4 * kW;  // bytes per chunk of a panel field

/* Everything below a tile is inlined into it, so that a block's index is a constant (shifts and offsets become
 * immediates, and the loads two blocks share are made once). */
#define KV_INLINE inline __attribute__((always_inline))

KV_INLINE I low4(I v) { return and_(v, b8(15)); }
KV_INLINE I high4(I v) { return and_(srl(v, 4), b8(15)); }

/* v as it is, in a register (an empty asm, no instruction): a super-block's integer sum stays one chain, where GCC
 * would otherwise reassociate it into a tree that keeps every block's products live at once (the unpacked tiles
 * spilled them: counted in the assembly) */
KV_INLINE void chain(I& v) { __asm__("" : "+v"(v)); }

/* ---- Each format's codes and scales straight from its panel: w is a group's first unit (8 blocks of 32, or
 * fewer at the end of a 32-weight row), i a block of the group (a constant once inlined), c a chunk: kW lanes of
 * 4 codes (one byte each) meeting activation codes 4c..4c+3 of the block. Loads the compiler may share between
 * the calls of one group (a qs chunk holds two blocks' nibbles). */

/* The 32-weight formats (one block a unit). qs chunk t holds codes 4t..4t+3 (low nibbles) and 16 + 4t.. (high):
 * chunks t and 4 + t of the block; Q5's fifth bits come from the permuted qh word (kv_qh_pack). */
template <class Fmt>
struct Unit32 {
  static constexpr int kMaxCode = Fmt::kMaxCode, kOffset = Fmt::kOffset;
  static constexpr bool kSigned = false;
  static constexpr bool kQ5 = Fmt::kMaxCode == 31, kMin = Fmt::kFold == Fold::kScaleMin;
  static constexpr int kQs = kMin ? (kQ5 ? 8 : 4) : (kQ5 ? 6 : 2);  // qs's offset in the unit, in kW bytes
  KV_INLINE static const uint8_t* unit(const uint8_t* w, int i) { return w + (int64_t)i * kLayouts[Fmt::kKind].bytes * kW; }
  KV_INLINE static I code(const uint8_t* w, int i, int c) {
    const uint8_t* u = unit(w, i);
    const I q = ld(u + kQs * kW + (c & 3) * kChunk);
    const I nibbles = c < 4 ? low4(q) : high4(q);
    if (!kQ5) return nibbles;
    return merge(nibbles, shift(ld(u + (kQs - 4) * kW), 4 - c), b8(0x10));  // bit c & 3 (low) or 4 + (c & 3)
  }
  KV_INLINE static F d(const uint8_t* w, int i) { return half(unit(w, i)); }
  KV_INLINE static F m(const uint8_t* w, int i) { return half(unit(w, i) + 2 * kW); }
  KV_INLINE static int shift_of(int) { return 0; }
};

/* Q4_K / Q5_K: qs chunk 8j + t holds sub-block 2j's codes 4t..4t+3 (low nibbles) and 2j + 1's (high); Q5_K's fifth
 * bit of sub-block u is bit u of qh chunk t's bytes. The 12 scale bytes are 3 chunks S0, S1, S2 (bytes 0-3, 4-7,
 * 8-11 of every lane), read as scale_min_k4 does: the scales of sub-blocks 0-3 are the low 6 bits of S0's bytes,
 * 4-7 the low nibbles of S2's with S0's top 2 bits above them (S1 and S2's high nibbles for the minimums). d and
 * -dmin as floats, sub-block i's scale sc(i) and the minimums of sub-blocks 2k, 2k + 1 as a 16-bit pair
 * mpair(k), in integer lanes. Q4_K's high nibbles may stay in place (kHighInPlace: codes 16 q, the dot shifted
 * back). */
template <int Bits>
struct UnitK45 {
  static constexpr int kMaxCode = (1 << Bits) - 1, kOffset = 0;
  static constexpr bool kSigned = false;
  static constexpr bool kInPlace = Bits == 4 && kHighInPlace;
  KV_INLINE static int shift_of(int i) { return kInPlace && (i & 1) ? 4 : 0; }
  /* InPlace: Q4_K's high nibbles as 16 q (shift_of says so); else every code as it is */
  template <bool InPlace = kInPlace>
  KV_INLINE static I code(const uint8_t* w, int i, int c) {
    const int t = 8 * (i / 2) + c;  // the qs chunk; Q5_K's first 8 alternate with qh's (q5_k_layout)
    const I q = ld(w + 16 * kW + (Bits == 4 ? t : t < 8 ? 2 * t + 1 : t + 8) * kChunk);
    if (InPlace) return and_(q, b8(i & 1 ? 0xF0 : 0x0F));
    const I nibbles = i & 1 ? high4(q) : low4(q);
    if (Bits == 4) return nibbles;
    return merge(nibbles, shift(ld(w + 16 * kW + 2 * c * kChunk), 4 - i), b8(0x10));
  }
  /* sub-block i's 6-bit field, zero-extended: from chunk `low` (S0 for scales, S1 for minimums) and the nibbles
   * at bit `nibble` of S2 */
  template <bool Pair = false>
  KV_INLINE static I six_bits(const uint8_t* w, int i, int low, int nibble) {
    const uint8_t* s = w + 4 * kW;
    const I lo = ld(s + low * kChunk);
    const I bytes = i < 4 ? and_(lo, b8(63)) : merge(and_(srl(ld(s + 2 * kChunk), nibble), b8(15)), srl(lo, 2), b8(0x30));
    return Pair ? byte_pair_of(bytes, i & 3) : byte_of(bytes, i & 3);
  }
  KV_INLINE static F d(const uint8_t* w, int) { return half(w); }
  KV_INLINE static F m(const uint8_t* w, int) { return neg(half(w + 2 * kW)); }
  KV_INLINE static I sc(const uint8_t* w, int i) { return six_bits(w, i, 0, 0); }
  /* sc(i) in both 16-bit halves of a lane (kScaledPairs) */
  KV_INLINE static I sc16(const uint8_t* w, int i) { return six_bits<true>(w, i, 0, 0); }
  KV_INLINE static I mpair(const uint8_t* w, int k) {
    return or_(six_bits(w, 2 * k, 1, 4), shift(six_bits(w, 2 * k + 1, 1, 4), 16));
  }
};

/* Q6_K (q6_k_layout: d, scales, then per half h and chunk c three chunks): block i = 4h + s's chunk c: the
 * nibbles of the half's chunk 3c + (s & 1) (high ones for s >= 2) and bits 2s, 2s + 1 of its chunk 3c + 2's bytes
 * (qh) as bits 4, 5; scale j (of 16 weights) is byte j % 4 of scales chunk j / 4, sign-extended. */
struct UnitQ6K {
  static constexpr int kMaxCode = 63, kOffset = 32;
  static constexpr bool kSigned = false;
  KV_INLINE static I code(const uint8_t* w, int i, int c) {
    const int h = i / 4, s = i % 4;
    const uint8_t* at = w + 18 * kW + (24 * h + 3 * c) * kChunk;
    const I q = ld(at + (s & 1) * kChunk);
    return merge(s >= 2 ? high4(q) : low4(q), shift(ld(at + 2 * kChunk), 4 - 2 * s), b8(0x30));
  }
  KV_INLINE static F d(const uint8_t* w, int) { return half(w); }
  KV_INLINE static int shift_of(int) { return 0; }
  KV_INLINE static I sc(const uint8_t* w, int j) { return sra(shift(ld(w + 2 * kW + (j / 4) * kChunk), 24 - 8 * (j % 4)), 24); }
  KV_INLINE static I sc16(const uint8_t* w, int j) { return sbyte_pair_of(ld(w + 2 * kW + (j / 4) * kChunk), j % 4); }
  /* scales 2k and 2k + 1 as a 16-bit pair (fold_super's offset) */
  KV_INLINE static I scpair(const uint8_t* w, int k) { return sbyte_pairs(ld(w + 2 * kW + (k / 2) * kChunk), k % 2); }
};

/* Q8_0: d, then 8 chunks of signed codes (0..7 in order): as they are (kSignedDots), or + 128. */
struct UnitQ80 {
  static constexpr int kMaxCode = kSignedDots ? 128 : 255, kOffset = kSignedDots ? 0 : 128;
  static constexpr bool kSigned = kSignedDots;
  KV_INLINE static const uint8_t* unit(const uint8_t* w, int i) { return w + (int64_t)i * 34 * kW; }
  KV_INLINE static I code(const uint8_t* w, int i, int c) {
    const I q = ld(unit(w, i) + 2 * kW + c * kChunk);
    return kSignedDots ? q : xor_(q, b8(0x80));
  }
  KV_INLINE static F d(const uint8_t* w, int i) { return half(unit(w, i)); }
  KV_INLINE static int shift_of(int) { return 0; }
};

template <class Fmt> struct UnitOf;
template <> struct UnitOf<Q8_0> { using T = UnitQ80; };
template <> struct UnitOf<Q4_0> { using T = Unit32<Q4_0>; };
template <> struct UnitOf<Q4_1> { using T = Unit32<Q4_1>; };
template <> struct UnitOf<Q5_0> { using T = Unit32<Q5_0>; };
template <> struct UnitOf<Q5_1> { using T = Unit32<Q5_1>; };
template <> struct UnitOf<Q4_K> { using T = UnitK45<4>; };
template <> struct UnitOf<Q5_K> { using T = UnitK45<5>; };
template <> struct UnitOf<Q6_K> { using T = UnitQ6K; };

/* ---- A panel's group of blocks as a tile reads them: codes and scales made from the panel's bytes in registers
 * where they are used (measured: faster than unpacking a group once into memory for many rows and reloading). */
template <class Fmt>
struct Codes {
  using U = typename UnitOf<Fmt>::T;
  const uint8_t* w;
  KV_INLINE I code(int i, int c) const { return U::code(w, i, c); }
  KV_INLINE static int shift_of(int i) { return U::shift_of(i); }
  KV_INLINE F d(int i) const { return U::d(w, i); }
  KV_INLINE F m(int i) const {
    if constexpr (Fmt::kFold == Fold::kScaleMin || Fmt::kFold == Fold::kSuper) return U::m(w, i);
    return zero_f();
  }
  /* Q6_K's scale j (of 16 weights); a K-quant super-block's scale of sub-block j */
  KV_INLINE I sc(int j) const {
    if constexpr (Fmt::kFold == Fold::kScale16 || Fmt::kFold == Fold::kSuper) return U::sc(w, j);
    return zero_i();
  }
  KV_INLINE I sc16(int j) const {
    if constexpr (Fmt::kFold == Fold::kScale16 || Fmt::kFold == Fold::kSuper) return U::sc16(w, j);
    return zero_i();
  }
  KV_INLINE I mpair(int k) const {
    if constexpr (Fmt::kFold == Fold::kSuper) return U::mpair(w, k);
    return zero_i();
  }
  /* Q6_K's scales 2k and 2k + 1 as a 16-bit pair */
  KV_INLINE I scpair(int k) const {
    if constexpr (Fmt::kFold == Fold::kScale16) return U::scpair(w, k);
    return zero_i();
  }
};

/* ---- A K-quant panel's group unpacked once into memory for every tile of rows of a call that takes it (more rows
 * than kMR, where kUnpackGroups says so): the codes as the dots take them (every code as it is, in 0..MaxCode),
 * the block scales as the float steps take them, so the tiles spend their operations on the dots and the float
 * steps. */
template <class Fmt>
struct Unpacked {
  using U = typename UnitOf<Fmt>::T;
  I codes[8][8];  // [block][chunk]
  F D[8], Mn[8];  // D[0] = d (Q6_K); D[0] = d, Mn[0] = -dmin (Q4_K, Q5_K)
  I scales[16];   // Q6_K's scale per 16 weights, sign-extended; Q4_K and Q5_K's 8 sub-block scales in the first 8
  I scales16[16]; // kScaledPairs: the same in both 16-bit halves of a lane (Q4_K and Q5_K: instead of scales)
  I mpairs[4];    // Q4_K and Q5_K: the minimums of sub-blocks 2k, 2k + 1 as 16-bit pairs
  I scpairs[8];   // Q6_K: its scales 2k, 2k + 1 as 16-bit pairs
  KV_INLINE I code(int i, int c) const { return codes[i][c]; }
  KV_INLINE F d(int i) const { return Fmt::kFold == Fold::kScaleMin ? D[i] : D[0]; }
  KV_INLINE F m(int i) const { return Fmt::kFold == Fold::kScaleMin ? Mn[i] : Mn[0]; }
  KV_INLINE I sc(int j) const { return scales[j]; }
  KV_INLINE I sc16(int j) const { return scales16[j]; }
  KV_INLINE I mpair(int k) const { return mpairs[k]; }
  KV_INLINE I scpair(int k) const { return scpairs[k]; }
  KV_INLINE static int shift_of(int) { return 0; }
  /* From the group at w (8 blocks: K-quant groups are whole). */
  KV_INLINE void unpack(const uint8_t* w) {
    KV_UNROLL for (int i = 0; i < 8; ++i) KV_UNROLL for (int c = 0; c < 8; ++c) {
      if constexpr (Fmt::kKind == kQ6_K) codes[i][c] = U::code(w, i, c);
      else codes[i][c] = U::template code<false>(w, i, c);
    }
    if constexpr (Fmt::kFold == Fold::kScale16) {
      D[0] = U::d(w, 0);
      KV_UNROLL for (int j = 0; j < 16; ++j) {
        if constexpr (kScaledPairs) scales16[j] = U::sc16(w, j);  // their only form the scaled pairs read
        else scales[j] = U::sc(w, j);
      }
      KV_UNROLL for (int k = 0; k < 8; ++k) scpairs[k] = U::scpair(w, k);
    } else {
      D[0] = U::d(w, 0);
      Mn[0] = U::m(w, 0);
      KV_UNROLL for (int i = 0; i < 8; ++i) {
        if constexpr (kScaledPairs) scales16[i] = U::sc16(w, i);  // their only form the scaled dots read
        else scales[i] = U::sc(w, i);
      }
      KV_UNROLL for (int k = 0; k < 4; ++k) mpairs[k] = U::mpair(w, k);
    }
  }
};

/* Blocks a format's codes share loads across (a qs chunk holds two K-quant sub-blocks' nibbles; a Q6_K qh chunk
 * four blocks' high bits), and how many a direct tile takes at once: as many as share and fit kDotRegs. */
template <class Fmt>
constexpr int kShare = Fmt::kKind == kQ6_K ? 4 : Fmt::kKind == kQ4_K || Fmt::kKind == kQ5_K ? 2 : 1;
template <class Fmt, int R, int P>
constexpr int kBlocksAtOnce = [] {
  const int fit = kDotRegs / (R * P * (Fmt::kFold == Fold::kScale16 ? 2 : 1));
  return fit < 1 ? 1 : fit < kShare<Fmt> ? fit : kShare<Fmt>;
}();

/* ---- Blocks i0..i0+B-1 of a group (global block b0 + i0 ...) for rows m..m+R-1 of P panels (src[p]: Codes or
 * Unpacked): their integer dots, then each block's float steps in block order (ukernel_gguf.h's order per output),
 * or for the K-quants their part of the super-block's integer sum isum (fold_super's); the activation values are
 * read once for all panels. Q6_K's dots are of its codes as stored (q, not q - 32): fold_super takes the offset
 * off the super-block's sum. */
template <class Fmt, int R, int P, int B, class Src>
KV_INLINE void blocks(const kv_ggml_args* a, const Src* src, int i0, int64_t b0, int64_t m, F (*acc)[R],
                      I (*isum)[R]) {
  using U = typename UnitOf<Fmt>::T;
  const int64_t at = m * a->ldb + b0 + i0;  // row m's first block
  const int8_t* x = a->xq + m * a->ldq + 32 * (b0 + i0);
  I dot[B][P][R];
  if constexpr (Fmt::kFold == Fold::kScale16) {
    /* each half's dot times its scale into the super-block's integer sum */
    KV_UNROLL for (int h = 0; h < 2; ++h) {
      if constexpr (kScaledPairs) {
        I sc16[B][P];
        KV_UNROLL for (int b = 0; b < B; ++b) KV_UNROLL for (int p = 0; p < P; ++p)
          sc16[b][p] = src[p].sc16(2 * (i0 + b) + h);
        scaled_dots<R, P, B, U::kMaxCode, U::kSigned>(src, i0, x, a->ldq, 4 * h, 4 * h + 4, sc16, isum);
        continue;
      }
      KV_UNROLL for (int b = 0; b < B; ++b) KV_UNROLL for (int p = 0; p < P; ++p) KV_UNROLL for (int r = 0; r < R; ++r)
        dot[b][p][r] = zero_i();
      dots<R, P, B, U::kMaxCode, U::kSigned>(src, i0, x, a->ldq, 4 * h, 4 * h + 4, dot);
      KV_UNROLL for (int b = 0; b < B; ++b) KV_UNROLL for (int p = 0; p < P; ++p) {
        const I sc = src[p].sc(2 * (i0 + b) + h);
        KV_UNROLL for (int r = 0; r < R; ++r) {
          isum[p][r] = add(isum[p][r], mullo(sc, dot[b][p][r]));
          chain(isum[p][r]);
        }
      }
    }
  } else if constexpr (Fmt::kFold == Fold::kSuper) {
    /* the super-block's integer sum: isum += sc dot (fold_super takes it) */
    if constexpr (kScaledPairs) {
      I sc16[B][P];
      KV_UNROLL for (int b = 0; b < B; ++b) KV_UNROLL for (int p = 0; p < P; ++p) sc16[b][p] = src[p].sc16(i0 + b);
      scaled_dots<R, P, B, U::kMaxCode, U::kSigned>(src, i0, x, a->ldq, 0, 8, sc16, isum);
      return;
    }
    KV_UNROLL for (int b = 0; b < B; ++b) KV_UNROLL for (int p = 0; p < P; ++p) KV_UNROLL for (int r = 0; r < R; ++r)
      dot[b][p][r] = zero_i();
    dots<R, P, B, U::kMaxCode, U::kSigned>(src, i0, x, a->ldq, 0, 8, dot);
    KV_UNROLL for (int b = 0; b < B; ++b) {
      const int down = Src::shift_of(i0 + b);
      KV_UNROLL for (int p = 0; p < P; ++p) {
        const I sc = src[p].sc(i0 + b);
        KV_UNROLL for (int r = 0; r < R; ++r) {
          I v = dot[b][p][r];
          if (down) v = sra(v, down);
          isum[p][r] = add(isum[p][r], mullo(sc, v));
          chain(isum[p][r]);
        }
      }
    }
  } else {
    KV_UNROLL for (int b = 0; b < B; ++b) KV_UNROLL for (int p = 0; p < P; ++p) KV_UNROLL for (int r = 0; r < R; ++r)
      dot[b][p][r] = zero_i();
    dots<R, P, B, U::kMaxCode, U::kSigned>(src, i0, x, a->ldq, 0, 8, dot);
    KV_UNROLL for (int b = 0; b < B; ++b) {
      const int down = Src::shift_of(i0 + b);
      KV_UNROLL for (int r = 0; r < R; ++r) {
        const int64_t row = at + b + r * a->ldb;
        const F xd = bset(a->xd[row]);
        const I offset = b32(U::kOffset * a->xsum[row]);
        KV_UNROLL for (int p = 0; p < P; ++p) {
          I v = dot[b][p][r];
          if (down) v = sra(v, down);
          if constexpr (U::kOffset != 0) v = sub(v, offset);
          acc[p][r] = fma(src[p].d(i0 + b), mul(cvt(v), xd), acc[p][r]);
          if constexpr (Fmt::kFold == Fold::kScaleMin) acc[p][r] = fma(src[p].m(i0 + b), bset(a->xs[row]), acc[p][r]);
        }
      }
    }
  }
}

/* Every cache line of the `bytes` at p towards L2 (prefetcht1). Measured on an AMD EPYC, one Llama-3.2-1B layer:
 * the same prefetches towards L1 (prefetcht0) made the decode tiles of 8 rows 0.8x as fast as none, towards L2
 * 1.5x (Q4_K and Q6_K), and the K-quants' tiles of many rows 1.1-1.2x faster at 32 rows than towards L1. */
KV_INLINE void prefetch(const uint8_t* p, int bytes) {
  for (int at = 0; at < bytes; at += 64) _mm_prefetch((const char*)(p + at), _MM_HINT_T1);
}

/* Every cache line of the `bytes` at p towards L1 (prefetcht0): tiles of one and two rows, a->ahead bytes ahead. */
KV_INLINE void prefetch_l1(const uint8_t* p, int bytes) {
  for (int at = 0; at < bytes; at += 64) _mm_prefetch((const char*)(p + at), _MM_HINT_T0);
}

/* Whether a tile of R rows takes a->ahead (the driver sets it for calls of 1 or 2 rows: cpu.h's
 * gguf_prefetch_default), each of its panels' streams: the K-quants' tiles of one and two rows, which kAhead's
 * prefetches towards L2 do not serve, on the path that defines kPrefetchL1 (AVX-512; on AVX2 measured slower).
 * Measured on a Zen 5 EPYC, a Q4_K_M Llama-3.2-1B step's projections: 1 row 1.3x, 2 rows 1.3-1.4x; from 3 rows,
 * on top of kAhead's, 0.8-0.98x. */
template <class Fmt, int R>
constexpr bool kPrefetchNear = kPrefetchL1 && kLayouts[Fmt::kKind].weights == 256 && R <= 2;

/* Panel p of a call: its first unit of group b0, its outputs, its features stored. */
KV_INLINE const uint8_t* group_at(const kv_ggml_args* a, int kind, int p, int b0) {
  const UnitLayout& layout = kLayouts[kind];
  return a->w + p * a->ldw + (int64_t)(b0 / (layout.weights / 32)) * layout.bytes * kW;
}
KV_INLINE float* panel_y(const kv_ggml_args* a, int p, int64_t m) { return a->y + m * a->ldy + (int64_t)p * kW; }
KV_INLINE int panel_cols(const kv_ggml_args* a, int p) { return p == a->panels - 1 ? a->cols : kW; }

/* A K-quant super-block's float steps for rows m..m+R-1 of P panels (ukernel_gguf.h's order): its integer sums
 * isum (sum_j sc_j dot_j), for Q4_K / Q5_K the minimums' sum_j m_j qsum_j from 16-bit pairs (vpdpwssd: xsum16's
 * pairs against mpair's), then two fused multiply-adds (Q6_K: one). */
template <class Fmt, int R, int P, class Src>
KV_INLINE void fold_super(const kv_ggml_args* a, const Src* src, int64_t b0, int64_t m, I (*isum)[R], F (*acc)[R]) {
  if constexpr (Fmt::kFold == Fold::kScale16) {
    /* the offset's part, 32 sum_j sc_j qsum16_j (|sum_j| < 2^23, x 32 < 2^28: exact in int32), off the sum: 8
     * vpdpwssd (vpmaddwd) a row and super-block, from the scales' 16-bit pairs against the per-16 sums' (xsum16h).
     * Measured on a Zen 5 EPYC (AVX-512), against each half-block's dot starting from its row's -32 qsum16 (a
     * broadcast and its address per half-block and row): Q6_K's tiles of 32 and 512 rows 1.1-1.2x faster. */
    I sp[P][8];
    KV_UNROLL for (int p = 0; p < P; ++p) KV_UNROLL for (int k = 0; k < 8; ++k) sp[p][k] = src[p].scpair(k);
    KV_UNROLL for (int r = 0; r < R; ++r) {
      const int16_t* sums = a->xsum16h + 2 * ((m + r) * a->ldb + b0);
      KV_UNROLL for (int p = 0; p < P; ++p) {
        I off = zero_i();
        KV_UNROLL for (int k = 0; k < 8; ++k)
          off = madd16(off, sp[p][k], b32(kv_load_i32((const int8_t*)(sums + 2 * k))));
        isum[p][r] = sub(isum[p][r], shift(off, 5));
      }
    }
    KV_UNROLL for (int r = 0; r < R; ++r) {
      const F xd = bset(a->xd[(m + r) * a->ldb + b0]);
      KV_UNROLL for (int p = 0; p < P; ++p) acc[p][r] = fma(src[p].d(0), mul(cvt(isum[p][r]), xd), acc[p][r]);
    }
    return;
  }
  I mp[P][4];
  KV_UNROLL for (int p = 0; p < P; ++p) KV_UNROLL for (int k = 0; k < 4; ++k) mp[p][k] = src[p].mpair(k);
  KV_UNROLL for (int r = 0; r < R; ++r) {
    const int64_t row = (m + r) * a->ldb + b0;
    const F xd = bset(a->xd[row]);
    KV_UNROLL for (int p = 0; p < P; ++p) {
      I im = zero_i();
      KV_UNROLL for (int k = 0; k < 4; ++k)
        im = madd16(im, mp[p][k], b32(kv_load_i32((const int8_t*)(a->xsum16 + row + 2 * k))));
      acc[p][r] = fma(src[p].d(0), mul(cvt(isum[p][r]), xd), acc[p][r]);
      acc[p][r] = fma(src[p].m(0), mul(cvt(im), xd), acc[p][r]);
    }
  }
}

/* One group's blocks (nblk, from global block b0) for rows m..m+R-1 of P panels, B blocks at once (a K-quant
 * super-block's float steps after its last). */
template <class Fmt, int R, int P, int B, class Src>
KV_INLINE void group(const kv_ggml_args* a, const Src* src, int64_t b0, int nblk, int64_t m, F (*acc)[R]) {
  constexpr bool super = Fmt::kFold == Fold::kSuper || Fmt::kFold == Fold::kScale16;
  I isum[P][R];
  if constexpr (super)
    KV_UNROLL for (int p = 0; p < P; ++p) KV_UNROLL for (int r = 0; r < R; ++r) isum[p][r] = zero_i();
  /* many accumulators (kPrefillPanels' tiles): the super-block's sums live in memory, taken once a block where the
   * scaled pairs are widened, so the registers hold the pairs (kept in registers, GCC spilled the pairs instead) */
  if constexpr (super && kScaledPairs && P * R > 4) __asm__ volatile("" : : "r"(&isum[0][0]) : "memory");
  KV_UNROLL for (int i = 0; i < 8; i += B) {
    if (i >= nblk) break;  // a K-quant group is whole: B divides 8
    blocks<Fmt, R, P, B>(a, src, i, b0, m, acc, isum);
    /* the next blocks load their own codes: codes kept from these ones (the loads two of them share) would not
     * fit the registers */
    __asm__ volatile("" ::: "memory");
  }
  if constexpr (super) fold_super<Fmt, R, P>(a, src, b0, m, isum, acc);
}

/* Rows m..m+R-1 of panels p0..p0+P-1 over the whole row, codes straight from the panels: the accumulators stay
 * in registers, one chain per output in block order. Ahead: prefetch the groups to come (kAhead). */
template <class Fmt, int R, int P, bool Ahead>
inline void tile(const kv_ggml_args* a, int p0, int64_t m = 0) {
  F acc[P][R];
  KV_UNROLL for (int p = 0; p < P; ++p) KV_UNROLL for (int r = 0; r < R; ++r) acc[p][r] = zero_f();
  const int group_bytes = kLayouts[Fmt::kKind].bytes * kW * (256 / kLayouts[Fmt::kKind].weights);
  for (int b0 = 0; b0 < a->nb; b0 += 8) {
    Codes<Fmt> src[P];
    KV_UNROLL for (int p = 0; p < P; ++p) {
      src[p].w = group_at(a, Fmt::kKind, p0 + p, b0);
      /* the group after next of the panel, or past its end the first of the panel the next tile takes: a tile
       * reads P streams at once, more than the hardware prefetchers follow from memory */
      const int ahead = b0 + 16 < a->nb ? p0 + p : p0 + p + P;
      if (Ahead && ahead < a->panels) prefetch(group_at(a, Fmt::kKind, ahead, (b0 + 16) % a->nb), group_bytes);
    }
    if constexpr (kPrefetchNear<Fmt, R>) {
      /* one or two rows: the bytes a->ahead past this group of each panel, towards L1 (kPrefetchNear) */
      if (a->ahead > 0) {
        KV_UNROLL for (int p = 0; p < P; ++p) {
          const uint8_t* next = src[p].w + a->ahead;
          if (next + group_bytes <= a->w + (int64_t)a->panels * a->ldw) prefetch_l1(next, group_bytes);
        }
      }
    }
    group<Fmt, R, P, kBlocksAtOnce<Fmt, R, P>>(a, src, b0, a->nb - b0 < 8 ? a->nb - b0 : 8, m, acc);
  }
  KV_UNROLL for (int p = 0; p < P; ++p)
    KV_UNROLL for (int r = 0; r < R; ++r) store_y(panel_y(a, p0 + p, m + r), acc[p][r], panel_cols(a, p0 + p));
}

/* tile.run<R'>() for R' = n (1..N) as an if chain of constants (no jump table). */
template <int N, class Tile>
inline void with_count(int n, const Tile& tile) {
  if constexpr (N > 1) {
    if (n < N) {
      with_count<N - 1>(n, tile);
      return;
    }
  }
  tile.template run<N>();
}

/* Whether a tile prefetches its panels' groups to come (towards L2): the K-quants' tiles of many rows, and their
 * decode tiles of 3 rows or more (measured on an AMD EPYC, one Llama-3.2-1B layer: decode tiles of 3 to 8 rows
 * 1.3-1.6x on AVX-512, of 4 rows on AVX2 1.06x (Q4_K) and 1.2x (Q6_K); at 1 and 2 rows the hardware prefetchers
 * serve the one stream better alone, the prefetches costing 3-20%; the 32-weight formats' tiles of many rows lose
 * 5-10% with them). */
template <class Fmt, int R>
constexpr bool kAhead = kLayouts[Fmt::kKind].weights == 256 && R >= 3;

template <class Fmt, int R>
struct TilePanels {
  const kv_ggml_args* a;
  int p0;
  template <int P> void run() const { tile<Fmt, R, P, kAhead<Fmt, R>>(a, p0); }
};

template <class Fmt>
struct DecodeRows {
  const kv_ggml_args* a;
  template <int R> void run() const {
    for (int p = 0; p < a->panels; p += kPanelsOf<Fmt, R>)
      with_count<kPanelsOf<Fmt, R>>(a->panels - p, TilePanels<Fmt, R>{a, p});
  }
};

template <class Fmt, int P = 1>
struct PrefillRows {
  const kv_ggml_args* a;
  int p;
  int64_t m;
  template <int R> void run() const { tile<Fmt, R, P, kAhead<Fmt, kMR>>(a, p, m); }  // every tile of a panel: kMR's
};

/* Rows m..m+R-1 of panel p over the group at block b0, from its unpacked form: the accumulators come from y (but
 * for the first group) and go back to it, so each output still takes the float steps of its blocks in K order.
 * Not inlined: one function per R keeps the tile's dots in registers (inlined into with_count's chain, GCC kept
 * them on the stack). */
template <class Fmt, int R>
__attribute__((noinline)) void group_tile(const kv_ggml_args* a, const Unpacked<Fmt>* u, int p, int b0, int64_t m) {
  F acc[1][R];
  const int cols = panel_cols(a, p);
  if constexpr (Fmt::kFold == Fold::kSuper || Fmt::kFold == Fold::kScale16) {
    /* the super-block's integer sums first, the accumulators only for its float steps (held over the dots, they
     * took registers the dots need) */
    I isum[1][R];
    KV_UNROLL for (int r = 0; r < R; ++r) isum[0][r] = zero_i();
    KV_UNROLL for (int i = 0; i < 8; ++i) {
      blocks<Fmt, R, 1, 1>(a, u, i, b0, m, acc, isum);
      __asm__ volatile("" ::: "memory");
    }
    KV_UNROLL for (int r = 0; r < R; ++r) acc[0][r] = b0 == 0 ? zero_f() : load_y(panel_y(a, p, m + r), cols);
    fold_super<Fmt, R, 1>(a, u, b0, m, isum, acc);
  } else {
    KV_UNROLL for (int r = 0; r < R; ++r) acc[0][r] = b0 == 0 ? zero_f() : load_y(panel_y(a, p, m + r), cols);
    group<Fmt, R, 1, 1>(a, u, b0, 8, m, acc);
  }
  KV_UNROLL for (int r = 0; r < R; ++r) store_y(panel_y(a, p, m + r), acc[0][r], cols);
}

template <class Fmt>
struct GroupRows {
  const kv_ggml_args* a;
  const Unpacked<Fmt>* u;
  int p;
  int b0;
  int64_t m;
  template <int R> void run() const { group_tile<Fmt, R>(a, u, p, b0, m); }
};

/* a->panels panels (a->nr == kW) x a->rows rows. Up to kMR rows (a decode batch): one tile of rows over several
 * panels at once. More: per panel, every tile of kMR rows (the panel's weights stay in L1 or L2 meanwhile); the
 * K-quants kUnpackGroups names (or kUnpackable ones where a->unpack says so) group by group, each group unpacked
 * once for all the tiles; Q4_K on AVX2 two panels a tile (kPrefillPanels), the last odd panel alone. */
template <class Fmt>
inline void kernel(const kv_ggml_args* a) {
  if (a->rows <= kMR) {
    with_count<kMR>(a->rows, DecodeRows<Fmt>{a});
    return;
  }
  if constexpr (kUnpackGroups<Fmt> || kUnpackable<Fmt>) {
    if (kUnpackGroups<Fmt> || a->unpack) {
      const int group_bytes = kLayouts[Fmt::kKind].bytes * kW;
      Unpacked<Fmt> u;
      for (int p = 0; p < a->panels; ++p)
        for (int b0 = 0; b0 < a->nb; b0 += 8) {
          /* the group after next, or past the panel's end the next panel's first ones (as tile's) */
          const int ahead = b0 + 16 < a->nb ? p : p + 1;
          if (ahead < a->panels) prefetch(group_at(a, Fmt::kKind, ahead, (b0 + 16) % a->nb), group_bytes);
          u.unpack(group_at(a, Fmt::kKind, p, b0));
          for (int64_t m = 0; m < a->rows; m += kMR)
            with_count<kMR>(a->rows - m < kMR ? (int)(a->rows - m) : kMR, GroupRows<Fmt>{a, &u, p, b0, m});
        }
      return;
    }
  }
  int p = 0;
  if constexpr (kPrefillPanels<Fmt> == 2)
    for (; p + 2 <= a->panels; p += 2)
      for (int64_t m = 0; m < a->rows; m += kMR)
        with_count<kMR>(a->rows - m < kMR ? (int)(a->rows - m) : kMR, PrefillRows<Fmt, 2>{a, p, m});
  for (; p < a->panels; ++p)
    for (int64_t m = 0; m < a->rows; m += kMR)
      with_count<kMR>(a->rows - m < kMR ? (int)(a->rows - m) : kMR, PrefillRows<Fmt>{a, p, m});
}

#undef KV_INLINE
