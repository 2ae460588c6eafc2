// Attention over a bf16 KV cache for CPUs with AVX512-BF16: decode and verification steps (a few query
// rows per KV head, memory-bound) and prefill chunks (hundreds of rows, compute-bound).
//
// Queries q [B, KV, M, D] (M = query heads per KV head x new tokens per row; bf16) attend over K/V
// [B, KV, L, D] (bf16; any strides but a contiguous last dim), or paged pools [NB, KV, BS, D] read through a block
// table [B, nblk] (magicdec::strided), with an additive bias [B, 1, R, L]
// (bf16, 0 / -inf; query row m takes bias row m % R, see magicdec::Bias). The context is split into
// chunks of a fixed size (flash-decoding). A task takes one chunk of one (row, KV head), 16 cached
// positions at a time: `vdpbf16ps` forms the scores, either along the head dims with the K rows as the cache
// stores them, four query rows at a time, and the lanes summed across afterwards (head dims 128 and 256), or
// 16 positions per instruction from a transposed K tile (head dim 64; kept in registers at a decode step's four
// query rows or fewer, copied through memory for more); it takes a chunk-local softmax and
// accumulates P @ V with the V tile interleaved by position pairs, so every K and V element is read from
// memory once however many queries there are (a prefill chunk's rows may be split into a few blocks, for
// threads). The rows 128 positions ahead are prefetched into L2.
// Chunks are merged by their maxima. Each query row is computed with the same arithmetic whatever M and
// L are: a verification forward attends exactly as the one-token steps do. Tiles the bias hides
// entirely (unfilled cache slots) are skipped. A pool's blocks may hold fewer than 16 positions (down to one: a
// token table naming single positions anywhere in a pool); a tile's rows are then looked up one by one.
// On request the ops also write the attention shares of one new token's query rows (magicdec::Shares): the
// softmax numerators the row sums add, weighted by the merged maxima and denominators; the output's bits do not
// change.
//
// With AMX tiles (`kTiles`, where the linear kernel takes them too) the products run on the tile unit: a 16-position
// K tile is an A operand as the cache stores it (no transpose; so blocks of 16 positions or more), the queries a B
// operand (pairs of head dims by query, 16 queries wide), and P @ V multiplies a tile of 16 queries' bf16
// probabilities by V interleaved by position pairs. A verification forward's 16 or so query rows per KV head then
// cost about what one row does, the K/V read. Each query row is still computed alike in any batch: rows and columns
// of a tile product do not mix. P @ V walks V by 32 dims at a time (two output tiles), so a chunk's V is interleaved
// once into a buffer, reading each position's row whole: walking the cache itself 32 dims at a time read V from
// memory at half the rate K is read.
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "amx.h"
#include "common.h"

namespace {

using magicdec::Bias;
using magicdec::kNegInf;
using magicdec::Strided;
using magicdec::StridedOf;

constexpr int64_t kTile = 16;  // cached positions per tile: one zmm of fp32 scores
constexpr uint16_t kBf16NegInf = 0xFF80;
// With int8 V, a probability of 1 times the chunk's largest V scale, as an int16: 2^14, so that a chunk's int32 sums
// of probabilities times V's int8 values (|v| <= 127) cannot overflow (1024 x 2^14 x 127 < 2^31).
constexpr float kProbOne = 16384.0f;
// Cached positions ahead whose K and V rows are prefetched into L2 (16-64 KB ahead at head dims 64-256): the hardware prefetcher alone,
// with the arithmetic between the loads, kept Gemma 3's global layers at half the rate a plain sum reads (Zen 4).
constexpr int64_t kPrefetch = 128;

// Prefetches the 64 bytes at p into L2. Each load of a cached row is preceded by the prefetch of the line it will
// load kPrefetch positions on: a tile's prefetches issued together, ahead of its arithmetic, held the loads behind
// them and read a Zen 4's memory at 0.6x the rate of the spread ones.
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T2); }

// exp(x) for x <= 0 (Cephes expf: range reduction by ln 2, degree-6 polynomial); 0 where x is -inf.
inline __m512 exp16(__m512 x) {
  const __mmask16 finite = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kNegInf), _CMP_NEQ_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(magicdec::kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(magicdec::kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(magicdec::kLn2Lo), r);
  __m512 p = _mm512_set1_ps(magicdec::kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(magicdec::kExpPoly[i]));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(finite, _mm512_scalef_ps(p, n));
}

inline __m512 bf16_to_fp32(__m256i x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

// In-place transpose of a 16 x 16 matrix of 32-bit words held in 16 registers. Always inlined: GCC kept it out of
// line, and its registers went through memory on every K tile (a plain step's attention 1.2x slower, Zen 4).
__attribute__((always_inline)) inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// The sums of 16 vectors' lanes in a tree, in two stages so that a caller holds four vectors where it had 16.
// sum_lanes4: lane e of each 128-bit block b of the result is the sum of block b of a[e] (pairs of vectors, then pairs of
// pairs); sum_blocks4: lane i of the result is the sum of the 16 lanes of the i % 4-th vector that sum_lanes4 took to
// u[i / 4] (the four 128-bit blocks).
inline __m512 sum_lanes4(const __m512 a[4]) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
  const __m512d x = _mm512_castps_pd(t0), y = _mm512_castps_pd(t1);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}

inline __m512 sum_blocks4(const __m512 u[4]) {
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xdd));
}

// Tiles 0: scores of 16 positions x 16 queries; 1: K (16 positions x 32 dims); 2: queries (16 dim pairs x 16);
// 3: probabilities (`rows` queries x 16 positions); 4: V (8 position pairs x 16 dims); 5, 6: outputs (`rows` x 16).
inline void configure_tiles(int rows) {
  magicdec::TileConfig cfg;
  const int tile_rows[7] = {16, 16, 16, rows, 8, rows, rows}, tile_cols[7] = {64, 64, 64, 32, 64, 64, 64};
  for (int t = 0; t < 7; ++t) {
    cfg.rows[t] = tile_rows[t];
    cfg.colsb[t] = tile_cols[t];
  }
  magicdec::load_tiles(cfg);
}

// An int8 row's scale: the fp32 after its D values (magicdec.kv.quant).
template <int D>
inline float row_scale(const int8_t* row) {
  float s;
  std::memcpy(&s, row + D, sizeof s);
  return s;
}

// kInt8: K/V rows of D int8 values and their fp32 scale (magicdec.kv.quant), queries quantized per row to int8
// (`quantize_queries`); the scores are integer dot products (`vpdpbusd`, AVX512-VNNI: 64 byte products an instruction
// where `vdpbf16ps` takes 32 bf16 ones), and so is P @ V: each position's V scale folded into its probability, an int16
// taken as two bytes against V's int8 as the cache stores it (`values_int8_tile`).
template <int D, bool kTiles, bool kInt8 = false>
struct Task {
  static_assert(!(kTiles && kInt8), "int8 K/V are read on vector instructions");
  using Elem = std::conditional_t<kInt8, int8_t, uint16_t>;
  static constexpr int P = D / 2;  // bf16 pairs per row: the dot-product unit of vdpbf16ps
  const uint32_t* q;               // [M, P] this head's queries as bf16 pairs; int8: [M, D / 4] as quads of int8
  int64_t M;
  StridedOf<Elem> K, V;
  Bias bias;
  float scale;
  const float* q_scale = nullptr;  // int8: [M, D / 32] the scale of each query row's groups of 32 dims
  const int32_t* q_sum = nullptr;  // int8: [M, D / 32] the sums of their int8 values
  magicdec::ShareRows share;       // where the numerators of the rows of the shares' bias row go (attend_in_chunks)
  struct Buffers {  // a thread's, reused across its tasks
    std::vector<float> scores;
    std::vector<uint16_t> probs;
    std::vector<char> visible;
    std::vector<uint32_t> qt;  // tiles: the queries as B operands, [M / 16][D / 32][16 pairs][16 queries]
    std::vector<__m512i> vt;   // tiles: the chunk's V interleaved by position pairs
    std::vector<__m512> lanes;  // [M]: each row's maxima, then sums, lane by lane
    std::vector<float> v_scale;  // int8: [tiles * 16] each position's V scale (0 past the chunk's end)
    std::vector<float> v_max;    // int8: [M] the largest V scale each row sees in the chunk
    std::vector<uint32_t> queries;  // a group's queries (magicdec::attend_groups)
  };

  // Scores of queries [M] against tile positions [l, l + 16) (n of them real), into s[m * 16 + i]. With 128 or 256
  // head dims the products run along the dims and each position's lanes are summed across afterwards; with 64 there
  // are only two 32-dim slices a position, the sum across lanes would cost more than the products, and the K tile is
  // transposed instead (once for all rows: a prefill chunk's hundreds of rows ran 1.4x slower along the dims).
  void score_tile(int64_t b, int64_t h, int64_t l, int64_t n, float* s) const {
    if constexpr (kInt8) {
      score_tile_int8(b, h, l, n, s);
    } else if constexpr (D >= 128) {
      score_tile_along_dims(b, h, l, n, s);
    } else {
      score_tile_transposed(b, h, l, n, s);
    }
  }

  // Query rows four at a time and positions four at a time (16 accumulators): each 32-dim slice of a K row is read
  // from the cache once per block of rows and multiplied into the rows' queries in registers; each four positions'
  // lanes are summed across in part as soon as they are done (four vectors a row stay live where 16 were spilled),
  // the 16 positions' sums finished after the tile: one tree either way, the same bits.
  void score_tile_along_dims(int64_t b, int64_t h, int64_t l, int64_t n, float* s) const {
    static const uint16_t zeros[D] = {};
    const uint16_t *k[kTile], *ahead[kTile];  // the rows, and those prefetched while the first block reads them
    K.tile(b, h, l, k);
    K.tile(b, h, l + kPrefetch, ahead);
    for (int i = n; i < kTile; ++i) k[i] = zeros;
    magicdec::for_each_row_block<4>(M, [&](int64_t m0, auto block) {
      constexpr int R = decltype(block)::value;
      __m512 quads[R][kTile / 4];  // each four positions' dot products, their lanes summed in part (sum_lanes4)
      for (int i = 0; i < kTile; i += 4) {
        __m512 acc[R][4];
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
        for (int c = 0; c < P / 16; ++c) {
          __m512bh qc[R];
          for (int r = 0; r < R; ++r) qc[r] = (__m512bh)_mm512_loadu_si512(q + (m0 + r) * P + 16 * c);
          for (int j = 0; j < 4; ++j) {
            if (m0 == 0) prefetch(ahead[i + j] + 32 * c);
            const __m512bh kc = (__m512bh)_mm512_loadu_si512(k[i + j] + 32 * c);
            for (int r = 0; r < R; ++r) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], qc[r], kc);
          }
        }
        for (int r = 0; r < R; ++r) quads[r][i / 4] = sum_lanes4(acc[r]);
      }
      for (int r = 0; r < R; ++r) store_scores(b, m0 + r, l, n, sum_blocks4(quads[r]), s);
    });
  }

  // s[m * 16 + i] = the scaled dot products plus query row m's bias.
  void store_scores(int64_t b, int64_t m, int64_t l, int64_t n, __m512 dots, float* s) const {
    const __mmask16 real = (__mmask16)((1u << n) - 1);
    const __m512 bias_m = bf16_to_fp32(_mm256_mask_loadu_epi16(
        _mm256_set1_epi16(kBf16NegInf), real, bias.at(b, bias.row(m), l)));
    _mm512_storeu_ps(s + m * kTile, _mm512_fmadd_ps(dots, _mm512_set1_ps(scale), bias_m));
  }

  void score_tile_transposed(int64_t b, int64_t h, int64_t l, int64_t n, float* s) const {
    if (M <= 4) {
      magicdec::for_each_row_block<4>(M, [&](int64_t, auto block) {
        score_few_rows<decltype(block)::value>(b, h, l, n, s);
      });
      return;
    }
    const uint16_t *k[kTile], *ahead[kTile];
    K.tile(b, h, l, k);
    K.tile(b, h, l + kPrefetch, ahead);
    // Each 64-byte slice of the 16 rows is read and transposed in turn (the rows copied whole first, a sequential
    // read, made a verification's 9 rows 3-5% slower on a Zen 4: the prefetches have the rows in L2 already).
    alignas(64) __m512i kt[P];  // kt[p] lane i: pair p of position l + i
    for (int c = 0; c < P / 16; ++c) {
      __m512i r[16];
      for (int i = 0; i < kTile; ++i) {
        prefetch(ahead[i] + 32 * c);
        r[i] = i < n ? _mm512_loadu_si512(k[i] + 32 * c) : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int p = 0; p < 16; ++p) kt[16 * c + p] = r[p];
    }
    for (int64_t m = 0; m < M; ++m) {
      // Four independent accumulator chains: vdpbf16ps has a latency of several cycles.
      __m512 acc4[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      const uint32_t* qm = q + m * P;
      for (int p = 0; p < P; p += 4)
        for (int u = 0; u < 4; ++u)
          acc4[u] = _mm512_dpbf16_ps(acc4[u], (__m512bh)_mm512_set1_epi32(qm[p + u]), (__m512bh)kt[p + u]);
      store_scores(b, m, l, n, _mm512_add_ps(_mm512_add_ps(acc4[0], acc4[1]), _mm512_add_ps(acc4[2], acc4[3])), s);
    }
  }

  // score_tile_transposed for a decode step's few query rows (a KV head's query heads at one token): each 32-dim half
  // of the tile is read, transposed and multiplied while it is in registers, the rows' accumulators live across the
  // halves. Copying the tile and its transpose through memory, as more rows need the transpose, cost a plain step's
  // attention a sixth of its time (Zen 4). The accumulator chains are those of the path above, pair by pair: the same
  // bits. (The loads and transposes in a shared function kept nothing in registers: 1.7x slower.)
  template <int R>
  void score_few_rows(int64_t b, int64_t h, int64_t l, int64_t n, float* s) const {
    const uint16_t *k[kTile], *ahead[kTile];
    K.tile(b, h, l, k);
    K.tile(b, h, l + kPrefetch, ahead);
    __m512 acc[R][4];
    for (int m = 0; m < R; ++m)
      for (int u = 0; u < 4; ++u) acc[m][u] = _mm512_setzero_ps();
    for (int c = 0; c < P / 16; ++c) {
      __m512i r[16];  // then r[p] lane i: pair 16c + p of position l + i
      for (int i = 0; i < kTile; ++i) {
        prefetch(ahead[i] + 32 * c);
        r[i] = i < n ? _mm512_loadu_si512(k[i] + 32 * c) : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int m = 0; m < R; ++m) {
        const uint32_t* qm = q + m * P + 16 * c;
        for (int p = 0; p < 16; p += 4)
          for (int u = 0; u < 4; ++u)
            acc[m][u] = _mm512_dpbf16_ps(acc[m][u], (__m512bh)_mm512_set1_epi32(qm[p + u]), (__m512bh)r[p + u]);
      }
    }
    for (int m = 0; m < R; ++m) {
      const __m512 dots = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3]));
      store_scores(b, m, l, n, dots, s);
    }
  }

  // score_tile over int8 rows: the tile's rows are read position after position, made unsigned (k + 128) and
  // transposed 16 dwords at a time, so that each `vpdpbusd` multiplies four dims of 16 positions by a query's four
  // bytes; sum (k + 128) q - 128 sum q is the exact integer dot product, scaled by the key's and the query's scales.
  void score_tile_int8(int64_t b, int64_t h, int64_t l, int64_t n, float* s) const {
    alignas(64) __m512i kt[D / 4];  // kt[p] lane i: dims [4p, 4p + 4) of position l + i, as k + 128
    alignas(64) float k_scale[kTile];
    const int8_t *k[kTile], *ahead[kTile];
    K.tile(b, h, l, k);
    K.tile(b, h, l + kPrefetch, ahead);
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int i = 0; i < kTile; ++i) {
      prefetch(ahead[i] + D);  // the row's last line: its scale
      k_scale[i] = i < n ? row_scale<D>(k[i]) : 0.0f;
    }
    for (int c = 0; c < D / 64; ++c) {
      __m512i r[16];
      for (int i = 0; i < kTile; ++i) {
        prefetch(ahead[i] + 64 * c);
        r[i] = i < n ? _mm512_xor_si512(_mm512_loadu_si512(k[i] + 64 * c), flip) : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int p = 0; p < 16; ++p) kt[16 * c + p] = r[p];
    }
    const __m512 ks = _mm512_load_ps(k_scale);
    constexpr int kGroups = D / 32;  // each query row's groups of 32 dims (8 dwords of kt), scaled apart
    for (int64_t m = 0; m < M; ++m) {
      const uint32_t* qm = q + m * (D / 4);
      __m512 dots = _mm512_setzero_ps();
      for (int g = 0; g < kGroups; ++g) {
        __m512i acc2[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
        for (int p = 8 * g; p < 8 * g + 8; p += 2)
          for (int u = 0; u < 2; ++u)
            acc2[u] = _mm512_dpbusd_epi32(acc2[u], kt[p + u], _mm512_set1_epi32(static_cast<int>(qm[p + u])));
        const __m512i group = _mm512_sub_epi32(_mm512_add_epi32(acc2[0], acc2[1]),
                                               _mm512_set1_epi32(128 * q_sum[m * kGroups + g]));
        dots = _mm512_fmadd_ps(_mm512_cvtepi32_ps(group), _mm512_set1_ps(q_scale[m * kGroups + g]), dots);
      }
      store_scores(b, m, l, n, _mm512_mul_ps(dots, ks), s);
    }
  }

  // The queries as tile B operands: for each group of 16 queries and 32 dims, pair p of query j at [p][j] (0 past M).
  void tile_queries(std::vector<uint32_t>& qt) const {
    const int64_t groups = (M + 15) / 16;
    qt.assign(groups * (D / 32) * 256, 0);
    for (int64_t m = 0; m < M; ++m)
      for (int p = 0; p < P; ++p) qt[((m / 16 * (D / 32) + p / 16) * 16 + p % 16) * 16 + m % 16] = q[m * P + p];
  }

  // score_tile on tiles: S^T [16 positions, 16 queries] = K tile @ queries, per group of 16 queries.
  void score_tile_on_tiles(int64_t b, int64_t h, int64_t l, int64_t n, const uint32_t* qt, float* s) const {
    alignas(64) uint16_t kpad[16 * D];  // a partial tile's positions, zero past n (the cache may end there)
    const uint16_t* kt = K.at(b, h, l);  // the tile's rows K.sl apart: blocks of 16 or more (attend_any)
    int64_t stride = K.sl * 2;
    if (n < 16) {
      std::fill(kpad, kpad + 16 * D, uint16_t(0));
      for (int64_t i = 0; i < n; ++i) std::copy(K.at(b, h, l + i), K.at(b, h, l + i) + D, kpad + i * D);
      kt = kpad;
      stride = D * 2;
    }
    alignas(64) float st[16 * 16];
    for (int64_t g = 0; g * 16 < M; ++g) {
      _tile_zero(0);
      for (int c = 0; c < D / 32; ++c) {
        _tile_loadd(1, kt + 32 * c, stride);
        _tile_loadd(2, qt + (g * (D / 32) + c) * 256, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, st, 64);
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(st + 16 * i);
      transpose16(r);  // r[j] lane i: query j's score at position l + i
      for (int64_t j = 0; j < 16 && g * 16 + j < M; ++j) store_scores(b, g * 16 + j, l, n, _mm512_castsi512_ps(r[j]), s);
    }
  }

  bool tile_visible(int64_t b, int64_t l, int64_t n) const {
    const __mmask16 real = (__mmask16)((1u << n) - 1);
    for (int64_t i = 0; i < bias.distinct(M); ++i) {
      const __m256i bm = _mm256_maskz_loadu_epi16(real, bias.at(b, bias.row(i), l));
      if (_mm256_mask_cmpneq_epi16_mask(real, bm, _mm256_set1_epi16(kBf16NegInf))) return true;
    }
    return false;
  }

  // The tile's bf16 V rows [l, l + 16) (n real) interleaved by position pairs, read row after row: for dims
  // [16k, 16k + 16), out[j * sj + k * sk] lane i = (V[2j][16k + i], V[2j + 1][16k + i]).
  void interleave_tile(int64_t b, int64_t h, int64_t l, int64_t n, __m512i* out, int64_t sj, int64_t sk) const {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    const uint16_t *v[kTile], *ahead[kTile];
    V.tile(b, h, l, v);
    V.tile(b, h, l + kPrefetch, ahead);
    for (int64_t j = 0; j < kTile / 2; ++j) {
      const uint16_t *va = v[2 * j], *vz = v[2 * j + 1];
      for (int c = 0; c < D / 32; ++c) {
        prefetch(ahead[2 * j] + 32 * c);
        prefetch(ahead[2 * j + 1] + 32 * c);
        const __m512i a = 2 * j < n ? _mm512_loadu_si512(va + 32 * c) : _mm512_setzero_si512();
        const __m512i z = 2 * j + 1 < n ? _mm512_loadu_si512(vz + 32 * c) : _mm512_setzero_si512();
        out[j * sj + 2 * c * sk] = _mm512_permutex2var_epi16(a, lo, z);
        out[j * sj + (2 * c + 1) * sk] = _mm512_permutex2var_epi16(a, hi, z);
      }
    }
  }

  // The tile's int8 V rows [l, l + 16) (n real) interleaved by position quads, for `vpdpbusd` (four positions' bytes a
  // dword) with in-lane unpacks alone: out[j * (D / 16) + 4c + r] dword 4L + i = V[4j .. 4j + 3][quad_dim(4c + r, 4L + i)].
  void quad_tile(int64_t b, int64_t h, int64_t l, int64_t n, __m512i* out) const {
    const int8_t *v[kTile], *ahead[kTile];
    V.tile(b, h, l, v);
    V.tile(b, h, l + kPrefetch, ahead);
    for (int64_t j = 0; j < kTile / 4; ++j)
      for (int c = 0; c < D / 64; ++c) {
        __m512i r[4];
        for (int i = 0; i < 4; ++i) {
          const int64_t p = 4 * j + i;
          prefetch(ahead[p] + 64 * c);
          r[i] = p < n ? _mm512_loadu_si512(v[p] + 64 * c) : _mm512_setzero_si512();
        }
        const __m512i ab_lo = _mm512_unpacklo_epi8(r[0], r[1]), ab_hi = _mm512_unpackhi_epi8(r[0], r[1]);
        const __m512i cd_lo = _mm512_unpacklo_epi8(r[2], r[3]), cd_hi = _mm512_unpackhi_epi8(r[2], r[3]);
        __m512i* o = out + j * (D / 16) + 4 * c;
        o[0] = _mm512_unpacklo_epi16(ab_lo, cd_lo);
        o[1] = _mm512_unpackhi_epi16(ab_lo, cd_lo);
        o[2] = _mm512_unpacklo_epi16(ab_hi, cd_hi);
        o[3] = _mm512_unpackhi_epi16(ab_hi, cd_hi);
      }
  }

  // The head dim that dword `lane` of quad_tile's vector k holds: 128-bit lane L of 64-dim slice c, word r of its bytes.
  static constexpr int quad_dim(int k, int lane) { return 64 * (k / 4) + 16 * (lane / 4) + 4 * (k % 4) + lane % 4; }

  // out [M, D] (int32 sums in quad_tile's dim order, in float's memory) += the tile's P @ V. Each probability (an int16
  // of at most kProbOne) is taken as its two bytes, p = 256 hi + lo, each multiplied into V's int8 by `vpdpbusd`: 64
  // byte products an instruction where `vpdpwssd` takes 32 word ones, and V needs no widening; the integer sums are
  // exactly p times V's.
  void values_int8_tile(const uint16_t* probs, const __m512i* vq, float* out) const {
    magicdec::for_each_row_block<4>(M, [&](int64_t m0, auto block) {
      constexpr int R = decltype(block)::value;
      alignas(16) uint32_t hi[R][4], lo[R][4];  // [r][j]: row m0 + r's digits of positions 4j .. 4j + 3
      for (int r = 0; r < R; ++r) {
        const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(probs + (m0 + r) * kTile));
        _mm_store_si128(reinterpret_cast<__m128i*>(hi[r]), _mm256_cvtepi16_epi8(_mm256_srli_epi16(p, 8)));
        _mm_store_si128(reinterpret_cast<__m128i*>(lo[r]),
                        _mm256_cvtepi16_epi8(_mm256_and_si256(p, _mm256_set1_epi16(0xFF))));
      }
      for (int k0 = 0; k0 < D / 16; k0 += 2) {
        __m512i acc_hi[R][2], acc_lo[R][2];
        for (int r = 0; r < R; ++r)
          for (int k = 0; k < 2; ++k) {
            acc_hi[r][k] = _mm512_setzero_si512();
            acc_lo[r][k] = _mm512_loadu_si512(out + (m0 + r) * D + 16 * (k0 + k));
          }
        for (int j = 0; j < kTile / 4; ++j) {
          __m512i ph[R], pl[R];
          for (int r = 0; r < R; ++r) {
            ph[r] = _mm512_set1_epi32(static_cast<int>(hi[r][j]));
            pl[r] = _mm512_set1_epi32(static_cast<int>(lo[r][j]));
          }
          for (int k = 0; k < 2; ++k) {
            const __m512i vk = vq[j * (D / 16) + k0 + k];
            for (int r = 0; r < R; ++r) {
              acc_hi[r][k] = _mm512_dpbusd_epi32(acc_hi[r][k], ph[r], vk);
              acc_lo[r][k] = _mm512_dpbusd_epi32(acc_lo[r][k], pl[r], vk);
            }
          }
        }
        for (int r = 0; r < R; ++r)
          for (int k = 0; k < 2; ++k)
            _mm512_storeu_si512(out + (m0 + r) * D + 16 * (k0 + k),
                                _mm512_add_epi32(acc_lo[r][k], _mm512_slli_epi32(acc_hi[r][k], 8)));
      }
    });
  }

  // P @ V on tiles. The chunk's V is interleaved once, each tile read row after row (`vt`, [tiles][D / 16][8 pairs]
  // as B operands); then for each group of 16 queries and 32 dims two output tiles accumulate over the chunk's tiles.
  void values_on_tiles(int64_t b, int64_t h, int64_t l0, int64_t l1, const uint16_t* probs, const char* visible,
                       std::vector<__m512i>& vt, float* out) const {
    const int64_t tiles = (l1 - l0 + kTile - 1) / kTile;
    constexpr int64_t kPerTile = D / 16 * (kTile / 2);
    vt.resize(tiles * kPerTile);
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t l = l0 + t * kTile;
      if (visible[t]) interleave_tile(b, h, l, std::min<int64_t>(kTile, l1 - l), vt.data() + t * kPerTile, 1, 8);
    }
    for (int64_t g = 0; g * 16 < M; ++g) {
      const int rows = static_cast<int>(std::min<int64_t>(16, M - g * 16));
      configure_tiles(rows);
      for (int c = 0; c < D / 32; ++c) {
        _tile_zero(5);
        _tile_zero(6);
        for (int64_t t = 0; t < tiles; ++t) {
          if (!visible[t]) continue;
          const __m512i* v = vt.data() + t * kPerTile + 16 * c;  // dims [32c, 32c + 16), then [32c + 16, 32c + 32)
          _tile_loadd(3, probs + (t * M + g * 16) * kTile, kTile * 2);
          _tile_loadd(4, v, 64);
          _tile_dpbf16ps(5, 3, 4);
          _tile_loadd(4, v + 8, 64);
          _tile_dpbf16ps(6, 3, 4);
        }
        _tile_stored(5, out + g * 16 * D + 32 * c, D * 4);
        _tile_stored(6, out + g * 16 * D + 32 * c + 16, D * 4);
      }
    }
    _tile_release();
  }

  // Chunk-local softmax numerators probs [tiles, M, 16] of scores [tiles, M, 16], rounded to bf16 as P @ V consumes
  // them; each row's maximum and the sum of its rounded numerators. Tile by tile, each row's maxima and sums kept lane
  // by lane: a prefill chunk's scores reach past L2, and walking one row across the tiles waited on each of them (an
  // eighth of a 512-token chunk's attention). A row's sums run over the tiles in order either way.
  // With int8 V, `v_scale` [tiles * 16]: P @ V takes each numerator e times its position's V scale as an int16,
  // round(e * scale / v_max[m] * kProbOne), v_max[m] the largest V scale row m sees in the chunk (so that a row's
  // bits depend on the positions it sees alone); the sums are of e unrounded.
  // The numerators the sums add (bf16-rounded, or e with int8 V) also go to the share rows' `share` buffers.
  void softmax(int64_t tiles, const float* scores, const char* visible, std::vector<__m512>& lanes, uint16_t* probs,
               float* row_max, float* row_sum, const float* v_scale = nullptr, float* v_max = nullptr) const {
    lanes.assign(M, _mm512_set1_ps(kNegInf));
    for (int64_t t = 0; t < tiles; ++t)
      if (visible[t])
        for (int64_t m = 0; m < M; ++m) lanes[m] = _mm512_max_ps(lanes[m], _mm512_loadu_ps(scores + (t * M + m) * kTile));
    for (int64_t m = 0; m < M; ++m) row_max[m] = _mm512_reduce_max_ps(lanes[m]);
    if (v_scale) {
      lanes.assign(M, _mm512_setzero_ps());
      for (int64_t t = 0; t < tiles; ++t)
        for (int64_t m = 0; visible[t] && m < M; ++m) {
          const __mmask16 seen = _mm512_cmp_ps_mask(_mm512_loadu_ps(scores + (t * M + m) * kTile),
                                                    _mm512_set1_ps(kNegInf), _CMP_NEQ_OQ);
          lanes[m] = _mm512_mask_max_ps(lanes[m], seen, lanes[m], _mm512_loadu_ps(v_scale + t * kTile));
        }
      for (int64_t m = 0; m < M; ++m) v_max[m] = _mm512_reduce_max_ps(lanes[m]);
    }
    lanes.assign(M, _mm512_setzero_ps());
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t m = 0; m < M; ++m) {
        __m256i pb = _mm256_setzero_si256();
        __m512 summed = _mm512_setzero_ps();  // the numerators the row's sum adds
        if (visible[t] && row_max[m] != kNegInf) {
          const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + (t * M + m) * kTile), _mm512_set1_ps(row_max[m])));
          if (v_scale) {
            const float unit = v_max[m] > 0.0f ? kProbOne / v_max[m] : 0.0f;
            const __m512 w = _mm512_mul_ps(e, _mm512_mul_ps(_mm512_loadu_ps(v_scale + t * kTile), _mm512_set1_ps(unit)));
            pb = _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(w));
            summed = e;
          } else {
            pb = (__m256i)_mm512_cvtneps_pbh(e);
            summed = bf16_to_fp32(pb);
          }
          lanes[m] = _mm512_add_ps(lanes[m], summed);
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + (t * M + m) * kTile), pb);
        if (float* numer = share.row(m)) _mm512_storeu_ps(numer + t * kTile, summed);
      }
    for (int64_t m = 0; m < M; ++m) row_sum[m] = _mm512_reduce_add_ps(lanes[m]);
  }

  // Positions [l0, l1) of (b, h): the chunk's maxima [M], softmax sums [M] and unnormalized out [M, D].
  void run(int64_t b, int64_t h, int64_t l0, int64_t l1, Buffers& buffers, float* row_max, float* row_sum,
           float* out) const {
    auto& [scores, probs, visible, qt, vt, lanes, v_scale, v_max, queries] = buffers;  // queries: a group's q
    const int64_t tiles = (l1 - l0 + kTile - 1) / kTile;
    scores.resize(tiles * M * kTile);
    probs.resize(M * tiles * kTile);
    visible.resize(tiles);
    if constexpr (kTiles) {
      tile_queries(qt);
      configure_tiles(16);
    }
    K.prefetch_rows(b, h, l0, l1);
    V.prefetch_rows(b, h, l0, l1);
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t l = l0 + t * kTile, n = std::min<int64_t>(kTile, l1 - l);
      visible[t] = tile_visible(b, l, n);
      if (!visible[t]) continue;
      if constexpr (kTiles) {
        score_tile_on_tiles(b, h, l, n, qt.data(), scores.data() + t * M * kTile);
      } else {
        score_tile(b, h, l, n, scores.data() + t * M * kTile);
      }
    }
    if constexpr (kInt8) {
      v_scale.assign(tiles * kTile, 0.0f);
      v_max.resize(M);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t l = l0 + t * kTile, n = std::min<int64_t>(kTile, l1 - l);
        if (!visible[t]) continue;
        const Elem* v[kTile];
        V.tile(b, h, l, v);
        for (int64_t i = 0; i < n; ++i) v_scale[t * kTile + i] = row_scale<D>(v[i]);
      }
    }
    softmax(tiles, scores.data(), visible.data(), lanes, probs.data(), row_max, row_sum,
            kInt8 ? v_scale.data() : nullptr, kInt8 ? v_max.data() : nullptr);
    if constexpr (kTiles) {
      values_on_tiles(b, h, l0, l1, probs.data(), visible.data(), vt, out);
    } else if constexpr (kInt8) {
      values_int8(b, h, l0, l1, probs.data(), visible.data(), v_max.data(), out);
    } else {
      values_bf16(b, h, l0, l1, probs.data(), visible.data(), out);
    }
  }

  // Unnormalized out [M, D] = P @ V over positions [l0, l1) on vector instructions, from a bf16 cache: two positions
  // per `vdpbf16ps`, V rows interleaved element-wise.
  void values_bf16(int64_t b, int64_t h, int64_t l0, int64_t l1, const uint16_t* probs, const char* visible,
                   float* out) const {
    const int64_t tiles = (l1 - l0 + kTile - 1) / kTile;
    std::fill(out, out + M * D, 0.0f);
    alignas(64) __m512i vp[kTile / 2][D / 16];  // vp[j][k] lane i: (V[2j][16k + i], V[2j + 1][16k + i])
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t l = l0 + t * kTile, n = std::min<int64_t>(kTile, l1 - l);
      if (!visible[t]) continue;
      interleave_tile(b, h, l, n, &vp[0][0], D / 16, 1);
      // Four rows by 64 dims at a time (16 accumulators): each interleaved V vector is loaded once for four rows.
      magicdec::for_each_row_block<4>(M, [&](int64_t m0, auto block) {
        constexpr int R = decltype(block)::value;
        const uint32_t* pairs[R];
        for (int r = 0; r < R; ++r)
          pairs[r] = reinterpret_cast<const uint32_t*>(probs + (t * M + m0 + r) * kTile);
        for (int k0 = 0; k0 < D / 16; k0 += 4) {
          __m512 acc[R][4];
          for (int r = 0; r < R; ++r)
            for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_loadu_ps(out + (m0 + r) * D + 16 * (k0 + k));
          for (int64_t j = 0; j < kTile / 2; ++j) {
            __m512i pj[R];
            for (int r = 0; r < R; ++r) pj[r] = _mm512_set1_epi32(pairs[r][j]);
            for (int k = 0; k < 4; ++k) {
              const __m512i vk = vp[j][k0 + k];
              for (int r = 0; r < R; ++r) acc[r][k] = _mm512_dpbf16_ps(acc[r][k], (__m512bh)pj[r], (__m512bh)vk);
            }
          }
          for (int r = 0; r < R; ++r)
            for (int k = 0; k < 4; ++k) _mm512_storeu_ps(out + (m0 + r) * D + 16 * (k0 + k), acc[r][k]);
        }
      });
    }
  }

  // out [M, D] = P @ V over positions [l0, l1) from an int8 cache, V's scales folded into the probabilities (softmax),
  // scaled by each row's v_max.
  void values_int8(int64_t b, int64_t h, int64_t l0, int64_t l1, const uint16_t* probs, const char* visible,
                   const float* v_max, float* out) const {
    const int64_t tiles = (l1 - l0 + kTile - 1) / kTile;
    std::fill(out, out + M * D, 0.0f);
    alignas(64) __m512i vq[kTile / 4 * (D / 16)];
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t l = l0 + t * kTile;
      if (!visible[t]) continue;
      quad_tile(b, h, l, std::min<int64_t>(kTile, l1 - l), vq);
      values_int8_tile(probs + t * M * kTile, vq, out);
    }
    scale_int8_sums(v_max, out);
  }

  // out [M, D]: each row's int32 sums (values_int8_tile), in units of v_max[m] / kProbOne and quad_tile's dim order,
  // as floats in head-dim order.
  void scale_int8_sums(const float* v_max, float* out) const {
    alignas(64) int32_t sums[D];
    for (int64_t m = 0; m < M; ++m) {
      std::memcpy(sums, out + m * D, sizeof(sums));
      const float unit = v_max[m] / kProbOne;
      for (int i = 0; i < D; ++i) out[m * D + quad_dim(i / 16, i % 16)] = static_cast<float>(sums[i]) * unit;
    }
  }
};

// Queries for the int8 kernel: each group of 32 dims of q [rows, D] (as fp32) quantized to int8 with its own scale
// max|q| / 127, as llama.cpp's q8_0 does (one scale per row lets a row's large dims drown its small ones: over 1500
// tokens of a book, SmolLM2's next-token argmax differed from fp32's at 3.0% of positions, with groups 2.2%, with a
// bf16 cache 1.3%), and the sum of its int8 values. A row's bytes depend on that row
// alone, as its outputs must.
struct Int8Queries {
  std::vector<int8_t> values;
  std::vector<float> scales;
  std::vector<int32_t> sums;

  Int8Queries(const float* q, int64_t rows, int64_t D) : values(rows * D), scales(rows * D / 32), sums(rows * D / 32) {
    at::parallel_for(0, rows * D / 32, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* x = q + r * 32;
        float amax = 0.0f;
        for (int64_t d = 0; d < 32; ++d) amax = std::max(amax, std::fabs(x[d]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int64_t d = 0; d < 32; ++d) {
          const int32_t v = static_cast<int32_t>(std::nearbyint(x[d] * inv));
          values[r * 32 + d] = static_cast<int8_t>(v);
          sum += v;
        }
        scales[r] = amax / 127.0f;
        sums[r] = sum;
      }
    });
  }
};

template <int D, bool kTiles, bool kInt8>
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
                  int64_t chunk, const std::optional<at::Tensor>& table, int64_t L, const magicdec::Shares& shares,
                  bool groups) {
  using Elem = typename Task<D, kTiles, kInt8>::Elem;
  const int64_t M = q.size(2);
  std::vector<int64_t> k_blocks, v_blocks;
  const auto K = magicdec::strided<Elem>(k, table, k_blocks), V = magicdec::strided<Elem>(v, table, v_blocks);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const auto bias_rows = magicdec::bias_of(bias, M, L);
  const auto opts = q.options().dtype(at::kFloat);
  if constexpr (kInt8) {
    const auto qf = q.to(at::kFloat).contiguous();
    const Int8Queries qi(qf.data_ptr<float>(), qf.numel() / D, D);
    const uint32_t* quads = reinterpret_cast<const uint32_t*>(qi.values.data());
    return magicdec::attend_in_chunks<D>(
        q.size(0), q.size(1), M, L, chunk, bias_rows, opts, shares,
        [&](int64_t bh, int64_t m0, int64_t rows, Bias block_bias) {
          const int64_t first = bh * M + m0;
          return Task<D, kTiles, kInt8>{quads + first * (D / 4), rows, K, V, block_bias, scale,
                                        qi.scales.data() + first * (D / 32), qi.sums.data() + first * (D / 32)};
        });
  } else {
    const auto qb = q.to(at::kBFloat16).contiguous();
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(qb.data_ptr<at::BFloat16>());
    const int64_t H = q.size(1);
    return magicdec::attend_in_chunks<D>(
        q.size(0), H, M, L, chunk, bias_rows, opts, shares,
        [&](int64_t bh, int64_t m0, int64_t rows, Bias block_bias) {
          return Task<D, kTiles, kInt8>{pairs + (bh * M + m0) * (D / 2), rows, K, V, block_bias, scale};
        },
        [&] {
          return table && groups ? magicdec::sharing_of(K, V, bias_rows, q.size(0), L, chunk) : magicdec::Sharing{};
        },
        [&](const int32_t* rows, int64_t n, int64_t h, Bias block_bias, auto& buffers) {
          const auto* queries = magicdec::gather_queries(pairs, rows, n, h, H, M * (D / 2), buffers.queries);
          return Task<D, kTiles, kInt8>{queries, n * M, K, V, block_bias, scale};
        });
  }
}

// kInt8: K/V rows of D int8 values and their fp32 scale ([..., D + 4] int8); else bf16 [..., D].
// shares [B, KV, L] (fp32): the attention shares of the query rows of bias row share_row (magicdec::Shares).
template <bool kTiles, bool kInt8>
at::Tensor attend_any(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
                      int64_t chunk, const std::optional<at::Tensor>& table, const std::optional<at::Tensor>& shares,
                      int64_t share_row, bool groups) {
  const auto kv_type = kInt8 ? at::kChar : at::kBFloat16;
  TORCH_CHECK(k.scalar_type() == kv_type && v.scalar_type() == kv_type && bias.scalar_type() == at::kBFloat16,
              "decode_attention: K and V must be ", kInt8 ? "int8" : "bf16", ", the bias bf16");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.size(3) == q.size(3) + (kInt8 ? 4 : 0) && v.size(3) == k.size(3),
              "decode_attention: K/V rows of ", kInt8 ? "head dim + 4 int8" : "head dim bf16", " expected, got q ",
              q.sizes(), ", K ", k.sizes(), ", V ", v.sizes());
  const int64_t L = magicdec::attended(q, k, v, bias, table);
  // Tiles start at multiples of 16: in blocks of 16 positions or more one lies in one block (Strided).
  TORCH_CHECK(chunk > 0 && chunk % kTile == 0, "decode_attention: chunk must be a positive multiple of 16");
  TORCH_CHECK(!kInt8 || chunk <= 1024, "decode_attention: int8 K/V take chunks of at most 1024 (kProbOne)");
  if constexpr (kTiles) {
    magicdec::require_tiles("decode_attention");
    TORCH_CHECK(!table || k.size(2) >= kTile, "decode_attention_tiles: K/V blocks of at least 16 positions expected "
                "(a tile's rows in one block), got blocks of ", k.size(2), "; decode_attention reads those");
  }
  const auto share = magicdec::shares_of(shares, share_row, q.size(0), q.size(1), q.size(2), bias.size(2), L, kTile);
  switch (q.size(3)) {
    case 64: return attend<64, kTiles, kInt8>(q, k, v, bias, chunk, table, L, share, groups);
    case 128: return attend<128, kTiles, kInt8>(q, k, v, bias, chunk, table, L, share, groups);
    case 256: return attend<256, kTiles, kInt8>(q, k, v, bias, chunk, table, L, share, groups);  // Gemma 3
    default: TORCH_CHECK(false, "decode_attention: head dim ", q.size(3), " is not 64, 128 or 256");
  }
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
                            int64_t chunk, const std::optional<at::Tensor>& block_table,
                            const std::optional<at::Tensor>& shares, int64_t share_row, bool groups) {
  return attend_any<false, false>(q, k, v, bias, chunk, block_table, shares, share_row, groups);
}

at::Tensor decode_attention_tiles(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& bias, int64_t chunk, const std::optional<at::Tensor>& block_table,
                                  const std::optional<at::Tensor>& shares, int64_t share_row, bool groups) {
  return attend_any<true, false>(q, k, v, bias, chunk, block_table, shares, share_row, groups);
}

at::Tensor decode_attention_int8(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
                                 int64_t chunk, const std::optional<at::Tensor>& block_table,
                                 const std::optional<at::Tensor>& shares, int64_t share_row, bool groups) {
  return attend_any<false, true>(q, k, v, bias, chunk, block_table, shares, share_row, groups);
}

// Decode/verification attention over a bf16 KV cache (AVX512-BF16; decode_attention_tiles: products on AMX tiles,
// call it only where tiles_ready(), blocks of 16 positions or more) or an int8 one (decode_attention_int8,
// AVX512-VNNI), contiguous or paged (a block table over blocks of any power of two positions: magicdec::strided);
// `shares`, where given, receives the attention shares of the query rows of bias row `share_row` (magicdec::Shares)
TORCH_LIBRARY_FRAGMENT(magicdec_avx512bf16, m) {
  m.def(MAGICDEC_ATTENTION_SCHEMA("decode_attention"), &decode_attention);
  m.def(MAGICDEC_ATTENTION_SCHEMA("decode_attention_tiles"), &decode_attention_tiles);
  m.def(MAGICDEC_ATTENTION_SCHEMA("decode_attention_int8"), &decode_attention_int8);
}
