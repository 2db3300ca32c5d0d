/* The GGUF formats' units as the kernels' panels hold them: each format's fields in packed order (UnitLayout,
 * kLayouts) and the move of one feature's unit between the file's bytes and its panel (move_unit). Shared by the
 * GGUF kernels (ukernel_gguf.h: packing, unpacking, the tiles that read the panels) and the decode stack, which
 * looks up a tied embedding's rows in its LM head's panels (decode_layers.cpp). Leaf-safe: constants and inline
 * byte loops only (ukernel.h). */
#ifndef KVSERVE_GGUF_LAYOUT_H
#define KVSERVE_GGUF_LAYOUT_H

#include <stdint.h>

namespace kvserve::gguf {

/* ---- Layouts: every GGUF format the kernels serve (ukernel_q4_1.h / ukernel_q8_0.h's too), as the packing reads
 * them. A field is `bytes` bytes at `raw` in the file's unit; fields are packed in this order. */
struct Field {
  int16_t raw, bytes;
  int16_t permuted; /* Q5_0 / Q5_1's qh: stored through kv_qh_pack */
};
constexpr int kMaxFields = 52;
struct UnitLayout {
  int16_t bytes, weights, fields;
  Field field[kMaxFields];
};

enum Kind { kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K, kKinds };

/* A layout of `bytes` / `weights` from its fields in packed order (raw offset, bytes, permuted). */
struct LayoutOf {
  UnitLayout l;
  constexpr LayoutOf(int bytes, int weights) : l{(int16_t)bytes, (int16_t)weights, 0, {}} {}
  constexpr LayoutOf& add(int raw, int bytes, int permuted = 0) {
    l.field[l.fields++] = Field{(int16_t)raw, (int16_t)bytes, (int16_t)permuted};
    return *this;
  }
};

/* Q5_K: d, dmin, scales; then qh's chunks and qs's first 8 alternating, as the first pair of sub-blocks reads
 * them chunk by chunk (both); then the rest of qs. A unit is read front to back. */
constexpr UnitLayout q5_k_layout() {
  LayoutOf o(176, 256);
  o.add(0, 2).add(2, 2).add(4, 12);
  for (int c = 0; c < 8; ++c) o.add(16 + 4 * c, 4).add(48 + 4 * c, 4);
  return o.add(80, 96).l;
}

/* Q6_K: d, scales; then per half h (128 weights) and chunk c, the three chunks the half's four blocks read
 * together: ql chunk 16h + c (blocks 4h and 4h + 2), ql chunk 16h + 8 + c (4h + 1, 4h + 3), qh chunk 8h + c. A
 * unit is read front to back (measured: ggml's order, ql then qh, read as the blocks need it, streams from memory
 * at a third of the speed on an AMD EPYC). */
constexpr UnitLayout q6_k_layout() {
  LayoutOf o(210, 256);
  o.add(208, 2).add(192, 16);
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < 8; ++c) o.add(64 * h + 4 * c, 4).add(64 * h + 32 + 4 * c, 4).add(128 + 32 * h + 4 * c, 4);
  return o.l;
}

/* Indexed by Kind. */
static constexpr UnitLayout kLayouts[kKinds] = {
    LayoutOf(18, 32).add(0, 2).add(2, 16).l,                       /* Q4_0: d, qs */
    LayoutOf(20, 32).add(0, 2).add(2, 2).add(4, 16).l,             /* Q4_1: d, m, qs */
    LayoutOf(22, 32).add(0, 2).add(2, 4, 1).add(6, 16).l,          /* Q5_0: d, qh, qs */
    LayoutOf(24, 32).add(0, 2).add(2, 2).add(4, 4, 1).add(8, 16).l,  /* Q5_1: d, m, qh, qs */
    LayoutOf(34, 32).add(0, 2).add(2, 32).l,                       /* Q8_0: d, qs */
    LayoutOf(144, 256).add(0, 2).add(2, 2).add(4, 12).add(16, 128).l,  /* Q4_K: d, dmin, scales, qs */
    q5_k_layout(),
    q6_k_layout(),
};

/* Q5_0 / Q5_1's qh word in the kernels' bit order (see the packed layout above) and back. */
inline uint32_t kv_qh_pack(uint32_t qh) {
  uint32_t out = 0;
  for (int k = 0; k < 32; ++k) {
    const int t = (k & 15) >> 2, i = k & 3;
    out |= ((qh >> k) & 1u) << (8 * i + t + (k >= 16 ? 4 : 0));
  }
  return out;
}
inline uint32_t kv_qh_unpack(uint32_t packed) {
  uint32_t out = 0;
  for (int k = 0; k < 32; ++k) {
    const int t = (k & 15) >> 2, i = k & 3;
    out |= ((packed >> (8 * i + t + (k >= 16 ? 4 : 0))) & 1u) << k;
  }
  return out;
}

/* Moves feature n's unit between the file's bytes (`raw`, layout.bytes) and its panel unit (`panel`, nr *
 * layout.bytes), to_panel or back. Byte loops: no memcpy in a leaf. */
inline void move_unit(const UnitLayout& layout, uint8_t* raw, uint8_t* panel, int64_t nr, int64_t n, bool to_panel) {
  int64_t at = 0;  // the field's offset in the panel unit, in units of nr bytes
  for (int f = 0; f < layout.fields; ++f) {
    const Field& field = layout.field[f];
    if (field.bytes == 2) {
      for (int i = 0; i < 2; ++i) {
        uint8_t& p = panel[at * nr + 2 * n + i];
        uint8_t& r = raw[field.raw + i];
        if (to_panel) p = r; else r = p;
      }
    } else {
      for (int c = 0; c < field.bytes / 4; ++c) {
        uint8_t* p = panel + at * nr + 4 * (c * nr + n);
        uint8_t* r = raw + field.raw + 4 * c;
        if (field.permuted) {
          const uint8_t* from = to_panel ? r : p;
          uint32_t v = (uint32_t)from[0] | (uint32_t)from[1] << 8 | (uint32_t)from[2] << 16 | (uint32_t)from[3] << 24;
          v = to_panel ? kv_qh_pack(v) : kv_qh_unpack(v);
          uint8_t* to = to_panel ? p : r;
          for (int i = 0; i < 4; ++i) to[i] = (uint8_t)(v >> (8 * i));
        } else {
          for (int i = 0; i < 4; ++i) {
            if (to_panel) p[i] = r[i]; else r[i] = p[i];
          }
        }
      }
    }
    at += field.bytes;
  }
}

}  // namespace kvserve::gguf

#endif  // KVSERVE_GGUF_LAYOUT_H
