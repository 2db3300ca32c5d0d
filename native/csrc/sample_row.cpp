// One sampled token from a row of logits (engine/sampling.py's sample_token on a CPU), without sorting the
// vocabulary and without torch.multinomial.
//
// Over Llama 3's 128,256-token vocabulary, torch's CPU multinomial took ~3-5 ms a token and top-p's full sort
// ~15-20 ms (a 1B model's whole decode step is ~20 ms; BENCHMARKS.md, sampling). Here a row costs a few passes
// over its logits:
//
//   s_i = x_i / T (torch's float32 division; NaN -> -inf)     x: the row's logits, T: its temperature
//   mx = max_i s_i;  w_i = exp(s_i - mx), 0 below exp(-87.3)  w: the weights
//   top-k:  keep s_i >= the k-th largest s (ties kept, as torch.topk's threshold keeps them)
//   min-p:  keep w_i >= min_p                                 (p_i / p_max = w_i: the maximum's weight is 1)
//   top-p:  keep the shortest prefix of the kept tokens by s descending (ties by index) whose mass reaches
//           top_p of theirs: a token stays while the mass before it is below top_p (Holtzman et al. 2020),
//           the first always
//   token:  the first i with sum_{j <= i, kept} w_j > u * sum_{kept} w_j     (inverse CDF, index order)
//
// The k-th largest value and the top-p cut are found by a histogram of the tokens over buckets of 1/32 nat below
// mx (bucket = floor((mx - s) * 32), monotone in s), a walk down the buckets to the one where the count or the
// mass crosses, and a sort of that bucket's tokens alone (all of them where every logit is equal: the worst case,
// ~4x a typical row). The weights are exp8's (decode_core.h) on the AVX2 path
// and exp1's (its same operations) on the portable one, and every sum is in double in a fixed order, so a row
// picks the same token on every path. Reference: engine/sampling.py's torch path (filter_logits, then the same
// inverse CDF); tests/test_sampling.py compares them.
#include "decode_common.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace {

constexpr int kBuckets = 4096;
constexpr float kPerNat = 32.f;  // buckets per nat below the row's maximum: 128 nats, then one for the rest
constexpr float kInf = std::numeric_limits<float>::infinity();
// A token more than 87.3 nats below the maximum weighs 0 (a masked one, at -inf, too): exp8 clamps its
// argument there (to ~1e-38), which would give every such token that weight instead of nearly none.
constexpr float kLeast = -87.3f;

// The bucket of s (not NaN): 0 for the maximum, the last for 128 nats or more below it and for -inf.
inline int bucket_of(float s, float mx) {
  const float d = (mx - s) * kPerNat;
  return d < static_cast<float>(kBuckets - 1) ? static_cast<int>(d) : kBuckets - 1;
}

#ifdef KV_X86
using kvserve::decode::exp8;

// w[0 .. 8k) = exp8(s - mx), 0 where s - mx < kLeast; returns 8k (k as large as fits in n).
__attribute__((target("avx2,fma"))) int64_t weights_avx2(const float* s, int64_t n, float mx, float* w) {
  const __m256 m = _mm256_set1_ps(mx), least = _mm256_set1_ps(kLeast);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(s + i), m);
    _mm256_storeu_ps(w + i, _mm256_andnot_ps(_mm256_cmp_ps(d, least, _CMP_LT_OQ), exp8(d)));
  }
  return i;
}
#endif

// The row's maximum (the first pass). NaN cannot come from scale (it maps NaN to -inf): the check guards the
// function's own contract.
float checked_max(const float* s, int64_t V) {
  bool nan = false;
  const float mx = kvserve::decode::row_max(s, V, &nan);
  KV_CHECK(!nan, "sample_row: the logits hold NaN");
  KV_CHECK(mx > -kInf, "sample_row: every token is masked (-inf)");
  return mx;
}

void row_weights(const float* s, int64_t V, float mx, float* w) {
  int64_t i = 0;
#ifdef KV_X86
  if (kvserve::cpu::avx2()) i = weights_avx2(s, V, mx, w);
#endif
  for (; i < V; ++i) {
    const float d = s[i] - mx;
    w[i] = d < kLeast ? 0.f : kvserve::decode::exp1(d);
  }
}

// bucket[i] = bucket_of(s[i], mx) for every token (a pass the compiler vectorizes; top-k and top-p read it twice).
KV_BODY void buckets_body(const float* s, int64_t V, float mx, uint16_t* bucket) {
  for (int64_t i = 0; i < V; ++i) bucket[i] = static_cast<uint16_t>(bucket_of(s[i], mx));
}
KV_TWO_PATHS(buckets, (const float* s, int64_t V, float mx, uint16_t* bucket), (s, V, mx, bucket))

// The k-th largest of s[0 .. V) (0 < k < V), -inf entries counted as torch.topk counts them.
float kth_largest(const float* s, const uint16_t* bucket, int64_t V, int64_t k) {
  std::array<int64_t, kBuckets> count{};
  for (int64_t i = 0; i < V; ++i) ++count[bucket[i]];
  int b = 0;
  int64_t above = 0;
  for (; b < kBuckets - 1 && above + count[b] < k; ++b) above += count[b];
  std::vector<float> in;
  in.reserve(count[b]);
  for (int64_t i = 0; i < V; ++i)
    if (bucket[i] == b) in.push_back(s[i]);
  const int64_t r = k - above - 1;  // its rank within the bucket, 0 the largest
  std::nth_element(in.begin(), in.begin() + r, in.end(), std::greater<float>());
  return in[r];
}

// Which tokens a row keeps: s > -inf (not masked), s >= lo (top-k), w >= min_p; then the top-p cut (cut_s,
// cut_i): s > cut_s, or s == cut_s and index <= cut_i. (A kept token of weight 0, 87.3 nats or more below the
// maximum, is kept but never drawn.)
struct Keep {
  const float* s;
  const float* w;
  float lo = -kInf;
  float least_w = 0.f;  // the least float >= min_p (w >= min_p exactly when w >= least_w)
  float cut_s = -kInf;
  int64_t cut_i = std::numeric_limits<int64_t>::max();

  void set_min_p(double min_p) {
    min_p = std::min(min_p, 1.0);  // the maximum (weight 1) always stays
    least_w = static_cast<float>(min_p);
    if (static_cast<double>(least_w) < min_p) least_w = std::nextafter(least_w, kInf);
  }
  // Without branches (& not &&), so the zeroing loop below vectorizes.
  bool filtered(int64_t i) const { return (s[i] > -kInf) & (s[i] >= lo) & (w[i] >= least_w); }
  bool operator()(int64_t i) const {
    return filtered(i) & ((s[i] > cut_s) | ((s[i] == cut_s) & (i <= cut_i)));
  }
};

// w[i] = 0 where keep does not keep token i.
KV_BODY void zero_dropped_body(const Keep& keep, float* w, int64_t V) {
  for (int64_t i = 0; i < V; ++i) w[i] = keep(i) ? w[i] : 0.f;
}
KV_TWO_PATHS(zero_dropped, (const Keep& keep, float* w, int64_t V), (keep, w, V))

// Sets keep's top-p cut: the tokens kept so far in order of s descending (ties by index), up to and including
// the one at which the mass before it first reaches top_p of their total.
void nucleus(Keep& keep, const uint16_t* bucket, int64_t V, double top_p) {
  std::array<double, kBuckets> mass{};
  for (int64_t i = 0; i < V; ++i)
    if (keep.filtered(i)) mass[bucket[i]] += keep.w[i];
  double total = 0.0;
  for (int b = 0; b < kBuckets; ++b) total += mass[b];
  const double target = top_p * total;
  int b = 0;
  double before = 0.0;
  for (; b < kBuckets - 1 && before + mass[b] < target; ++b) before += mass[b];
  std::vector<std::pair<float, int64_t>> in;  // (s, index) of the bucket where the mass crosses
  for (int64_t i = 0; i < V; ++i)
    if (bucket[i] == b && keep.filtered(i)) in.emplace_back(keep.s[i], i);
  if (in.empty()) return;  // the sums' rounding ran past the last bucket: every kept token stays
  std::sort(in.begin(), in.end(), [](const auto& a, const auto& c) {
    return a.first > c.first || (a.first == c.first && a.second < c.second);
  });
  bool any = before > 0.0;  // a kept token in an earlier bucket (the maximum's, of weight 1, is in bucket 0)
  for (const auto& [s, i] : in) {
    if (any && before >= target) break;
    keep.cut_s = s;
    keep.cut_i = i;
    before += keep.w[i];
    any = true;
  }
}

// The sum of w[0 .. n) in float64 over 8 lanes (lane l: w[l], w[l + 8], ...), the lanes added pairwise: the same
// operations on every path (the compiler may put the lanes in vector registers, never reorder them).
KV_BODY void lane_sum_body(const float* w, int64_t n, double* sum) {
  double a[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) a[l] += w[i + l];
  for (int l = 0; i < n; ++i, ++l) a[l] += w[i];
  *sum = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}
KV_TWO_PATHS(lane_sum, (const float* w, int64_t n, double* sum), (w, n, sum))

// The first i whose weights w[0 .. i] sum past u times their total (w >= 0, not all 0): the total from sums of
// chunks of kChunk (lane_sum), then the chunk where the running sum crosses, token by token. Where rounding keeps a
// chunk's own running sum from crossing its sum's mark, the walk goes on; past the end, the last token of weight
// > 0 (u * total rounded to the total).
int64_t inverse_cdf(const float* w, int64_t V, double u) {
  constexpr int64_t kChunk = 64;
  const int64_t chunks = (V + kChunk - 1) / kChunk;
  thread_local std::vector<double> sums;
  sums.resize(chunks);
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    lane_sum(w + c * kChunk, std::min(kChunk, V - c * kChunk), &sums[c]);
    total += sums[c];
  }
  KV_CHECK(total > 0.0, "sample_row: no token kept");  // the maximum always stays (weight 1): unreachable
  const double target = u * total;
  double cum = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    if (!(cum + sums[c] > target)) {
      cum += sums[c];
      continue;
    }
    for (int64_t i = c * kChunk; i < std::min(V, (c + 1) * kChunk); ++i) {
      cum += w[i];
      if (w[i] > 0.f && cum > target) return i;
    }
  }
  int64_t last = V - 1;
  while (last > 0 && !(w[last] > 0.f)) --last;
  return last;
}

// s[i] = x[i] / temperature in float32 (torch's x / temperature: the divisor rounded to float32, one IEEE
// division), then NaN -> -inf and +inf -> the largest float (engine/sampling.py's finite_logits).
KV_BODY void scale_body(const float* x, int64_t V, float temperature, float* s) {
  constexpr float kMax = std::numeric_limits<float>::max();
  for (int64_t i = 0; i < V; ++i) {
    const float v = x[i] / temperature;
    s[i] = v != v ? -kInf : (v == kInf ? kMax : v);
  }
}
KV_TWO_PATHS(scale, (const float* x, int64_t V, float temperature, float* s), (x, V, temperature, s))

// One row: logits x [V], temperature (> 0), top_k (<= 0 or >= V: off), top_p (>= 1: off), min_p (<= 0: off), u in
// [0, 1) -> the token; processed (when not null) [V] <- the scaled row with every token it did not keep at -inf.
// Scratch per thread, so rows may run on several threads at once.
int64_t sample_one(const float* x, int64_t V, double temperature, int64_t top_k, double top_p, double min_p,
                   double u, float* processed) {
  KV_CHECK(temperature > 0.0, "sample_row: temperature must be > 0");
  KV_CHECK(u >= 0.0 && u < 1.0, "sample_row: u must be in [0, 1)");
  KV_CHECK(!std::isnan(top_p) && !std::isnan(min_p), "sample_row: top_p and min_p must not be NaN");
  thread_local std::vector<float> scaled, weights;
  thread_local std::vector<uint16_t> bucket;
  scaled.resize(V);
  scale(x, V, static_cast<float>(temperature), scaled.data());
  const float* s = scaled.data();
  const float mx = checked_max(s, V);
  weights.resize(V);
  row_weights(s, V, mx, weights.data());
  Keep keep{s, weights.data()};
  const bool top_k_on = top_k > 0 && top_k < V;
  if (top_k_on || top_p < 1.0) {
    bucket.resize(V);
    buckets(s, V, mx, bucket.data());
  }
  if (top_k_on) keep.lo = kth_largest(s, bucket.data(), V, top_k);
  keep.set_min_p(min_p);
  if (top_p < 1.0) nucleus(keep, bucket.data(), V, top_p);
  if (processed != nullptr)
    for (int64_t i = 0; i < V; ++i) processed[i] = keep(i) ? s[i] : -kInf;
  if (top_k_on || min_p > 0.0 || top_p < 1.0)
    zero_dropped(keep, weights.data(), V);  // (masked tokens weigh 0 already)
  return inverse_cdf(weights.data(), V, u);
}

// logits [V] float32 (contiguous), temperature, top_k, top_p, min_p, u -> (token, the processed row when
// want_processed, else an empty tensor); see sample_one.
std::tuple<int64_t, torch::Tensor> sample_row(const torch::Tensor& logits, double temperature, int64_t top_k,
                                              double top_p, double min_p, double u, bool want_processed) {
  KV_CHECK(logits.scalar_type() == torch::kFloat32 && logits.is_cpu() && logits.dim() == 1 &&
               logits.is_contiguous() && logits.numel() > 0,
           "sample_row: logits must be a contiguous non-empty float32 CPU vector");
  torch::Tensor processed = want_processed ? torch::empty_like(logits) : torch::Tensor();
  py::gil_scoped_release released;
  const int64_t token = sample_one(logits.data_ptr<float>(), logits.numel(), temperature, top_k, top_p, min_p, u,
                                   want_processed ? processed.data_ptr<float>() : nullptr);
  return {token, processed};
}

// logits [R, V] float32 (contiguous), temperature float64 [R], top_k int64 [R], top_p, min_p, u float64 [R] ->
// tokens int64 [R]: each row as sample_row draws it, the rows spread over the threads (a decode step's sampled
// sequences at once).
torch::Tensor sample_rows(const torch::Tensor& logits, const torch::Tensor& temperature, const torch::Tensor& top_k,
                          const torch::Tensor& top_p, const torch::Tensor& min_p, const torch::Tensor& u) {
  KV_CHECK(logits.scalar_type() == torch::kFloat32 && logits.is_cpu() && logits.dim() == 2 &&
               logits.is_contiguous() && logits.size(1) > 0,
           "sample_rows: logits must be a contiguous float32 CPU [R, V]");
  const int64_t R = logits.size(0), V = logits.size(1);
  KV_CHECK(top_k.scalar_type() == torch::kLong && top_k.is_contiguous() && top_k.numel() == R,
           "sample_rows: top_k must be int64 [R]");
  for (const auto* t : {&temperature, &top_p, &min_p, &u})
    KV_CHECK(t->scalar_type() == torch::kDouble && t->is_contiguous() && t->numel() == R,
             "sample_rows: temperature, top_p, min_p and u must be float64 [R]");
  const double *up = u.data_ptr<double>(), *tp = temperature.data_ptr<double>();
  auto tokens = torch::empty({R}, top_k.options());
  const float* x = logits.data_ptr<float>();
  const int64_t* kp = top_k.data_ptr<int64_t>();
  const double *pp = top_p.data_ptr<double>(), *mp = min_p.data_ptr<double>();
  int64_t* out = tokens.data_ptr<int64_t>();
  py::gil_scoped_release released;
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) out[r] = sample_one(x + r * V, V, tp[r], kp[r], pp[r], mp[r], up[r], nullptr);
  });
  return tokens;
}

}  // namespace

void bind_sample_row(py::module& m) {
  m.def("sample_row", &sample_row, py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
        py::arg("min_p"), py::arg("u"), py::arg("want_processed"),
        "logits [V] f32, temperature, top_k, top_p, min_p, u in [0, 1), want_processed -> "
        "(token: top-k, min-p, top-p, then the inverse CDF at u over the kept weights in index order; the row "
        "with what it did not keep at -inf, or an empty tensor)");
  m.def("sample_rows", &sample_rows, py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
        py::arg("min_p"), py::arg("u"),
        "logits [R,V] f32, temperature float64 [R], top_k int64 [R], top_p, min_p, u float64 [R] -> tokens int64 [R] "
        "(each row as sample_row, the rows over the threads)");
}
