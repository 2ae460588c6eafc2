// Attention over a 16-bit KV cache (fp16 or bf16) for CPUs with AVX2, FMA and F16C: decode and
// verification steps (a few query rows per KV head, memory-bound) and prefill chunks (hundreds of rows).
// The arithmetic is fp32 throughout; the cache is only stored in 16 bits.
//
// Queries q [B, KV, M, D] (fp32) attend over K/V [B, KV, L, D] (any strides but a contiguous last dim), or
// paged pools [NB, KV, BS, D] read through a block table [B, nblk] (magicdec::strided), with an additive bias
// [B, 1, R, L] (the cache's dtype, 0 / -inf; query row m takes bias row m % R, see magicdec::Bias), split
// into chunks of a fixed size as in decode_attention.cpp. A task takes one chunk of one (row, KV head), 8
// cached positions at a time: for every block of three query rows it widens each K vector to fp32 in a
// register (a shift for bf16, vcvtph2ps for fp16) and multiplies it into the three rows there, forms the 8
// scores (8 dot products, summed across lanes together), takes a chunk-local softmax and accumulates P @ V the
// same way. A one-token step (three rows per KV head in SmolLM2) thus reads each K and V element from memory
// once and widens it once; widening into a buffer instead cost as much as the arithmetic.
// Each query row is computed with the same arithmetic whatever M and L are (the order of its sums does not
// depend on the block it falls in), so a verification forward attends exactly as the one-token steps do.
// Tiles the bias hides from all of a task's rows are skipped. Pools of blocks of any power of two positions are read
// (a tile's rows looked up one by one where blocks hold fewer than 8), and the attention shares of one new token's
// query rows written on request (magicdec::Shares), as in decode_attention.cpp.
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "avx2.h"
#include "common.h"

namespace {

using magicdec::Bf16;
using magicdec::Fp16;

using magicdec::kNegInf;
using magicdec::Strided;

constexpr int kTile = 8;  // cached positions per tile: one ymm of fp32 scores
constexpr int kRowBlock = 3;  // query rows that meet each widened K or V vector in registers
constexpr int kPrefetch = 16;  // positions ahead

// The first n (< 8) words of p widened to fp32, the rest filled with `fill` (bits of the same type).
template <class S>
inline __m256 load_partial(const uint16_t* p, int64_t n, uint16_t fill) {
  alignas(16) uint16_t tmp[kTile];
  std::fill(tmp, tmp + kTile, fill);
  std::memcpy(tmp, p, n * sizeof(uint16_t));
  return S::load8(tmp);
}

// exp(x) for x <= 0 (Cephes expf: range reduction by ln 2, degree-6 polynomial, 2^n built in the exponent
// field); 0 where x is -inf.
inline __m256 exp8(__m256 x) {
  const __m256 finite = _mm256_cmp_ps(x, _mm256_set1_ps(kNegInf), _CMP_NEQ_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(magicdec::kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(magicdec::kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(magicdec::kLn2Lo), r);
  __m256 p = _mm256_set1_ps(magicdec::kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(magicdec::kExpPoly[i]));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(pow2n)), finite);
}

// The sums of 8 vectors' lanes in a tree, in two stages so that a caller holds two vectors where it had eight.
// sum_lanes4: lane e of each 128-bit half of the result is the sum of that half of a[e]; sum_halves: lane i of the
// result is the sum of the 8 lanes of the i % 4-th vector that sum_lanes4 took to u[i / 4].
inline __m256 sum_lanes4(const __m256 a[4]) {
  return _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
}

inline __m256 sum_halves(const __m256 u[2]) {
  return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}

inline float sum_lanes(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

inline float max_lanes(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

template <int D, class S>
struct Task {
  const float* q;  // [M, D] this head's queries
  int64_t M;
  Strided K, V;
  magicdec::Bias bias;
  float scale;
  magicdec::ShareRows share;  // where the numerators of the rows of the shares' bias row go (attend_in_chunks)
  struct Buffers {  // a thread's, reused across its tasks
    std::vector<float> scores;  // [tiles, M, 8]: scores, then softmax numerators in place
    std::vector<char> visible;
    std::vector<__m256> lanes;  // [M]: each row's maxima, then sums, lane by lane
    std::vector<float> queries;  // a group's queries (magicdec::attend_groups)
  };

  // Pointers to the tile's rows [l, l + 8) of K or V; rows past n point at zeros (never read from the cache).
  // The rows kPrefetch positions ahead are prefetched (a prefetch past the cache's end does not fault): the dot
  // products between the loads leave the hardware prefetcher behind.
  void tile_rows(const Strided& X, int64_t b, int64_t h, int64_t l, int64_t n, const uint16_t* (&rows)[kTile]) const {
    static const uint16_t zeros[D] = {};
    const uint16_t* ahead[kTile];
    X.tile(b, h, l, rows);
    X.tile(b, h, l + kPrefetch, ahead);
    for (int64_t i = 0; i < kTile; ++i) {
      if (i >= n) rows[i] = zeros;
      for (int c = 0; c < D; c += 32) _mm_prefetch(reinterpret_cast<const char*>(ahead[i] + c), _MM_HINT_T0);
    }
  }

  __m256 bias_tile(int64_t b, int64_t r, int64_t l, int64_t n) const {  // bias row r
    const uint16_t* p = bias.at(b, r, l);
    return n == kTile ? S::load8(p) : load_partial<S>(p, n, S::kNegInfBits);
  }

  bool tile_visible(int64_t b, int64_t l, int64_t n) const {
    for (int64_t j = 0; j < bias.distinct(M); ++j) {
      const uint16_t* p = bias.at(b, bias.row(j), l);
      for (int64_t i = 0; i < n; ++i)
        if (p[i] != S::kNegInfBits) return true;
    }
    return false;
  }

  // Scores of queries [M] against tile positions [l, l + 8) (n of them real), into s[m * 8 + i]. Query rows go
  // kRowBlock at a time and positions 4 at a time, with 12 accumulators: each K vector is widened once into a
  // register and meets the block's rows there.
  void score_tile(int64_t b, int64_t h, int64_t l, int64_t n, float* s) const {
    const uint16_t* k[kTile];
    tile_rows(K, b, h, l, n, k);
    magicdec::for_each_row_block<kRowBlock>(M, [&](int64_t m0, auto block) {
      constexpr int R = decltype(block)::value;
      __m256 quads[R][kTile / 4];  // each four positions' dot products, their lanes summed in part (sum_lanes4)
      for (int i = 0; i < kTile; i += 4) {
        __m256 acc[R][4];
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
        for (int c = 0; c < D / 8; ++c) {
          __m256 qc[R];
          for (int r = 0; r < R; ++r) qc[r] = _mm256_loadu_ps(q + (m0 + r) * D + 8 * c);
          for (int j = 0; j < 4; ++j) {
            const __m256 kc = S::load8(k[i + j] + 8 * c);
            for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(qc[r], kc, acc[r][j]);
          }
        }
        for (int r = 0; r < R; ++r) quads[r][i / 4] = sum_lanes4(acc[r]);
      }
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r;
        _mm256_storeu_ps(s + m * kTile, _mm256_fmadd_ps(sum_halves(quads[r]), _mm256_set1_ps(scale),
                                                        bias_tile(b, bias.row(m), l, n)));
      }
    });
  }

  // Softmax numerators in place of the scores [tiles, M, 8] (0 in hidden tiles), and in the share rows' `share`
  // buffers; each row's chunk maximum and the sum of its numerators. Tile by tile, each row's maxima and sums kept
  // lane by lane: a prefill chunk's scores reach past L2, and walking one row across the tiles waited on each of them.
  // A row's sums run over the tiles in order.
  void softmax(int64_t tiles, float* scores, const char* visible, std::vector<__m256>& lanes, float* row_max,
               float* row_sum) const {
    lanes.assign(M, _mm256_set1_ps(kNegInf));
    for (int64_t t = 0; t < tiles; ++t)
      if (visible[t])
        for (int64_t m = 0; m < M; ++m) lanes[m] = _mm256_max_ps(lanes[m], _mm256_loadu_ps(scores + (t * M + m) * kTile));
    for (int64_t m = 0; m < M; ++m) row_max[m] = max_lanes(lanes[m]);
    lanes.assign(M, _mm256_setzero_ps());
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t m = 0; m < M; ++m) {
        float* st = scores + (t * M + m) * kTile;
        const __m256 e = visible[t] && row_max[m] != kNegInf
                             ? exp8(_mm256_sub_ps(_mm256_loadu_ps(st), _mm256_set1_ps(row_max[m])))
                             : _mm256_setzero_ps();
        _mm256_storeu_ps(st, e);
        if (float* numer = share.row(m)) _mm256_storeu_ps(numer + t * kTile, e);
        lanes[m] = _mm256_add_ps(lanes[m], e);
      }
    for (int64_t m = 0; m < M; ++m) row_sum[m] = sum_lanes(lanes[m]);
  }

  // out[m] += sum_i p[m, i] V[l + i] over the tile's positions, query rows kRowBlock at a time, 16 dims at a time.
  void accumulate_tile(int64_t b, int64_t h, int64_t l, int64_t n, const float* probs, float* out) const {
    const uint16_t* v[kTile];
    tile_rows(V, b, h, l, n, v);
    magicdec::for_each_row_block<kRowBlock>(M, [&](int64_t m0, auto block) {
      constexpr int R = decltype(block)::value;
      for (int c = 0; c < D; c += 16) {
        __m256 acc[R][2];
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < 2; ++j) acc[r][j] = _mm256_loadu_ps(out + (m0 + r) * D + c + 8 * j);
        for (int i = 0; i < kTile; ++i) {
          const __m256 v0 = S::load8(v[i] + c), v1 = S::load8(v[i] + c + 8);
          for (int r = 0; r < R; ++r) {
            const __m256 p = _mm256_broadcast_ss(probs + (m0 + r) * kTile + i);
            acc[r][0] = _mm256_fmadd_ps(p, v0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(p, v1, acc[r][1]);
          }
        }
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < 2; ++j) _mm256_storeu_ps(out + (m0 + r) * D + c + 8 * j, acc[r][j]);
      }
    });
  }

  // Positions [l0, l1) of (b, h): the chunk's maxima [M], softmax sums [M] and unnormalized out [M, D].
  void run(int64_t b, int64_t h, int64_t l0, int64_t l1, Buffers& buffers, float* row_max, float* row_sum,
           float* out) const {
    const int64_t tiles = (l1 - l0 + kTile - 1) / kTile;
    std::vector<float>& scores = buffers.scores;
    std::vector<char>& visible = buffers.visible;
    scores.resize(tiles * M * kTile);
    visible.resize(tiles);
    K.prefetch_rows(b, h, l0, l1);
    V.prefetch_rows(b, h, l0, l1);
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t l = l0 + t * kTile, n = std::min<int64_t>(kTile, l1 - l);
      visible[t] = tile_visible(b, l, n);
      if (visible[t]) score_tile(b, h, l, n, scores.data() + t * M * kTile);
    }
    softmax(tiles, scores.data(), visible.data(), buffers.lanes, row_max, row_sum);
    std::fill(out, out + M * D, 0.0f);
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t l = l0 + t * kTile;
      if (visible[t]) accumulate_tile(b, h, l, std::min<int64_t>(kTile, l1 - l), scores.data() + t * M * kTile, out);
    }
  }
};

template <int D, class S>
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
                  int64_t chunk, const std::optional<at::Tensor>& table, int64_t L, const magicdec::Shares& shares,
                  bool groups) {
  const int64_t M = q.size(2);
  auto qf = q.to(at::kFloat).contiguous();
  const float* qp = qf.data_ptr<float>();
  std::vector<int64_t> k_blocks, v_blocks;
  const Strided K = magicdec::strided(k, table, k_blocks), V = magicdec::strided(v, table, v_blocks);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const auto bias_rows = magicdec::bias_of(bias, M, L);
  const int64_t H = q.size(1);
  return magicdec::attend_in_chunks<D>(
      q.size(0), H, M, L, chunk, bias_rows, qf.options(), shares,
      [&](int64_t bh, int64_t m0, int64_t rows, magicdec::Bias block_bias) {
        return Task<D, S>{qp + (bh * M + m0) * D, rows, K, V, block_bias, scale};
      },
      [&] {
        return table && groups ? magicdec::sharing_of(K, V, bias_rows, q.size(0), L, chunk) : magicdec::Sharing{};
      },
      [&](const int32_t* rows, int64_t n, int64_t h, magicdec::Bias block_bias, auto& buffers) {
        return Task<D, S>{magicdec::gather_queries(qp, rows, n, h, H, M * D, buffers.queries), n * M, K, V, block_bias,
                          scale};
      });
}

template <class S>
at::Tensor attend_head_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
                           int64_t chunk, const std::optional<at::Tensor>& table, int64_t L,
                           const magicdec::Shares& shares, bool groups) {
  switch (q.size(3)) {
    case 64: return attend<64, S>(q, k, v, bias, chunk, table, L, shares, groups);
    case 128: return attend<128, S>(q, k, v, bias, chunk, table, L, shares, groups);
    case 256: return attend<256, S>(q, k, v, bias, chunk, table, L, shares, groups);  // Gemma 3
    default: TORCH_CHECK(false, "decode_attention: head dim ", q.size(3), " is not 64, 128 or 256");
  }
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
                            int64_t chunk, const std::optional<at::Tensor>& block_table,
                            const std::optional<at::Tensor>& shares, int64_t share_row, bool groups) {
  const auto type = k.scalar_type();
  TORCH_CHECK((type == at::kHalf || type == at::kBFloat16) && v.scalar_type() == type &&
                  bias.scalar_type() == type, "decode_attention: K, V and bias must be all fp16 or all bf16");
  const int64_t L = magicdec::attended(q, k, v, bias, block_table);
  // Tiles start at multiples of 8: in blocks of 8 positions or more one lies in one block (Strided).
  TORCH_CHECK(chunk > 0 && chunk % kTile == 0, "decode_attention: chunk must be a positive multiple of 8");
  const auto share = magicdec::shares_of(shares, share_row, q.size(0), q.size(1), q.size(2), bias.size(2), L, kTile);
  return type == at::kHalf ? attend_head_dim<Fp16>(q, k, v, bias, chunk, block_table, L, share, groups)
                           : attend_head_dim<Bf16>(q, k, v, bias, chunk, block_table, L, share, groups);
}

// Attention over an fp16 or bf16 KV cache in fp32 (AVX2, FMA, F16C), contiguous or paged (a block table over blocks
// of any power of two positions: magicdec::strided); `shares`, where given, receives the attention shares of the
// query rows of bias row `share_row` (magicdec::Shares)
TORCH_LIBRARY_FRAGMENT(magicdec_avx2, m) {
  m.def(MAGICDEC_ATTENTION_SCHEMA("decode_attention"), &decode_attention);
}
