// What the native kernels of every instruction set share: strided 16-bit tensors, the split of attention into (row,
// KV head, context chunk, block of query rows) tasks and the merge of the chunks' partial results (and of the
// attention shares), and the walk of a linear layer's rows in register blocks. Only plain C++ here: each kernel
// source includes it and is compiled with its own instruction-set flags. The kernels register as operators
// (torch.ops.magicdec_<path>) rather than as a Python module: these headers compile in a fifth of the time
// torch/extension.h takes, which is most of a build.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

// The schema of an attention operator `name` of any path: queries, K, V, the bias, the chunk size, an optional block
// table, an optional shares output [B, KV, L] (fp32) for the query rows of bias row share_row (Shares), and whether
// rows that share blocks attend over them together (`groups`, Sharing).
#define MAGICDEC_ATTENTION_SCHEMA(name)                                                                           \
  name "(Tensor q, Tensor k, Tensor v, Tensor bias, int chunk, Tensor? block_table=None, Tensor(a!)? shares=None, " \
       "int share_row=0, bool groups=True) -> Tensor"

namespace magicdec {

// Query rows per task at most. A prefill chunk's hundreds of rows per KV head are split into blocks of this many:
// a block's scores and probabilities over a context chunk stay in L2 (2048 rows of Gemma 3 over 1024 positions were
// 12 MB), and a block skips the tiles none of its rows sees (the chunk's causal part, a sliding window's edges).
constexpr int64_t kBlockRows = 128;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// exp(x) as Cephes expf computes it: n = round(x log2 e), r = x - n ln 2 (ln 2 in two parts), then
// 1 + r + r^2 P(r) with P of degree 5 (kExpPoly, highest power first), times 2^n.
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                              4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// Rows of a [B, H, L, W] tensor of elements T (16-bit words, or the int8 rows of magicdec.kv.quant: D values and
// their scale) with a contiguous last dim, each row's positions in blocks of 2^shift: position l of (b, h) lies at
// data + blocks[b * nblk + l / 2^shift] + h * sh + (l % 2^shift) * sl. A contiguous tensor is one block per row; a
// paged pool [NB, H, BS, W] read through a block table, blocks of BS (any power of two: with BS = 1 each table entry
// names one position's row, a token table; or one block a row of any length, a row table naming rows of a larger
// [B', H, L', W] tensor). A kernel takes a tile of N = 16 (or 8) positions starting at a multiple of N: where the
// blocks hold N positions or more the tile lies in one block and its rows are at(b, h, l) + i * sl, else each row is
// looked up (`tile`).
template <class T>
struct StridedOf {
  const T* data;
  const int64_t* blocks;  // [B, nblk] element offsets of each row's blocks
  int64_t nblk, shift, sh, sl;
  int64_t H, W;  // heads, and elements a row
  const T* at(int64_t b, int64_t h, int64_t l) const {
    const int64_t j = std::min(l >> shift, nblk - 1);  // clamped: prefetches run past the end
    return data + blocks[b * nblk + j] + h * sh + (l - (j << shift)) * sl;
  }
  // Prefetches into L2, before a task's first tile, the rows of positions [l0, l1) of (b, h) that a draft reads
  // from all over a pool: a tile's own prefetches run only kPrefetch positions ahead, and no hardware prefetcher
  // follows a token table's single positions or short runs of scattered blocks, so a draft's few hundred positions
  // were mostly demand misses. Where the chunk's rows of every head fit in kPrefetchBytes, head 0's task prefetches
  // them all, and the row's other heads' tasks, which follow it on the same thread (attend_in_chunks orders tasks by
  // row, head, chunk), find theirs in L2; otherwise a token table's own rows are prefetched, and a longer chunk of
  // blocks (a verification's 1024 positions, which ran no faster) is left to the hardware. SmolLM2's 3 heads, 32
  // rows, 30 layers of the engine's head-major pool (Zen 4): 256 positions scattered over 8k 26.0 -> 18.2 ms (AVX2
  // path 28.2 -> 18.9), 16 blocks scattered over the pool 20.6 -> 14.3 ms, 32 such blocks 32.7 -> 25.9 ms, 16 blocks
  // in a run 9.2 -> 9.9 ms (AVX2 path 11.3 -> 10.9).
  void prefetch_rows(int64_t b, int64_t h, int64_t l0, int64_t l1) const {
    constexpr int64_t kPrefetchBytes = 192 << 10;  // K's or V's: both within a 512 KB L2
    const int64_t row = W * static_cast<int64_t>(sizeof(T));
    const bool together = H > 1 && (l1 - l0) * H * row <= kPrefetchBytes;
    if ((together && h != 0) || (!together && shift != 0)) return;
    for (int64_t l = l0; l < l1; ++l)
      for (int64_t g = together ? 0 : h; g < (together ? H : h + 1); ++g) {
        const char* p = reinterpret_cast<const char*>(at(b, g, l));
        for (int64_t c = 0; c < row; c += 64) __builtin_prefetch(p + c, 0, 1);
        __builtin_prefetch(p + row - 1, 0, 1);  // the last line, where the rows do not start a line
      }
  }

  // rows[i] = at(b, h, l + i) for the N positions of the tile at l (a multiple of N): one block's rows sl apart where
  // a block holds the tile, else looked up one by one (blocks of fewer than N positions).
  template <int N>
  void tile(int64_t b, int64_t h, int64_t l, const T* (&rows)[N]) const {
    if (shift >= __builtin_ctz(N)) {
      const T* first = at(b, h, l);
      for (int i = 0; i < N; ++i) rows[i] = first + i * sl;
    } else {
      for (int i = 0; i < N; ++i) rows[i] = at(b, h, l + i);
    }
  }
};
using Strided = StridedOf<uint16_t>;

// K or V of an attention kernel as a StridedOf<T> whose block offsets `offsets` holds (the caller keeps it alive):
// without a table, t [B, H, L, W] itself, one block per row; with a block table [B, nblk] (int32), the pool
// t [NB, H, BS, W] it indexes, position l of row b at t[table[b, l / BS], :, l % BS].
template <class T = uint16_t>
StridedOf<T> strided(const at::Tensor& t, const std::optional<at::Tensor>& table, std::vector<int64_t>& offsets) {
  const auto data = reinterpret_cast<const T*>(t.data_ptr());
  if (!table) {
    offsets.resize(t.size(0));
    for (int64_t b = 0; b < t.size(0); ++b) offsets[b] = b * t.stride(0);
    return {data, offsets.data(), 1, 62, t.stride(1), t.stride(2), t.size(1), t.size(3)};
  }
  const auto ids = table->accessor<int32_t, 2>();
  const int64_t B = table->size(0), nblk = table->size(1), NB = t.size(0);
  offsets.resize(B * nblk);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < nblk; ++j) {
      TORCH_CHECK(ids[b][j] >= 0 && ids[b][j] < NB, "decode_attention: block id ", ids[b][j], " at [", b, ", ", j,
                  "] of the block table is not in [0, ", NB, ")");
      offsets[b * nblk + j] = ids[b][j] * t.stride(0);
    }
  const int64_t shift = nblk == 1 ? 62 : __builtin_ctzll(t.size(2));  // a row table: each row's whole length
  return {data, offsets.data(), nblk, shift, t.stride(1), t.stride(2), t.size(1), t.size(3)};
}

// The positions attended, L, after the checks of the operands' shapes: q [B, KV, M, D]; k, v [B, KV, L, D] or, with
// a block table [B, nblk] (int32), pools [NB, KV, BS, D] (BS a power of two, 1 included, or any with nblk = 1;
// nblk * BS >= L), where L is the bias's [B, 1, R, L].
inline int64_t attended(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
                        const std::optional<at::Tensor>& table) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && bias.dim() == 4, "decode_attention: 4-d tensors");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && bias.stride(3) == 1,
              "decode_attention: last dims must be contiguous");
  if (!table) return k.size(2);
  const int64_t BS = k.size(2), L = bias.size(3);
  TORCH_CHECK(table->scalar_type() == at::kInt && table->dim() == 2 && table->size(0) == q.size(0),
              "decode_attention: block table [B, nblk] int32 expected, got ", table->sizes(), " ",
              table->scalar_type(), " for ", q.size(0), " rows");
  TORCH_CHECK(BS >= 1 && ((BS & (BS - 1)) == 0 || table->size(1) == 1) && v.size(2) == BS,
              "decode_attention: K/V blocks of a power of two positions (or one block a row) expected, got ",
              k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.size(1) == q.size(1) && v.size(1) == q.size(1), "decode_attention: ", q.size(1),
              " KV heads expected in the pools, got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(table->size(1) * BS >= L, "decode_attention: a block table of ", table->size(1), " blocks of ", BS,
              " positions for ", L, " attended");
  return L;
}

// The additive bias (0 / -inf) [B, 1, R, L] of a head's M query rows, M a multiple of R: query row m takes bias row
// m % R. The model passes one row per new token (R = q) for the G x q rows of a KV head's grouped queries (ordered
// query head, then token), so a forward builds and reads the bias once per token rather than once per query head.
// `first` is the bias row of a task's first query row.
struct Bias {
  const uint16_t* data;
  int64_t sb, sr, R, first;
  const uint16_t* at(int64_t b, int64_t r, int64_t l) const { return data + b * sb + r * sr + l; }  // bias row r
  // bias row of the task's query row m (no division where one row serves all: a plain step's)
  int64_t row(int64_t m) const { return R == 1 ? 0 : (first + m) % R; }
  int64_t distinct(int64_t M) const { return std::min(M, R); }  // bias rows that M consecutive query rows take
};

// The checks and the Bias of a kernel's bias operand for M query rows over L positions.
inline Bias bias_of(const at::Tensor& bias, int64_t M, int64_t L) {
  TORCH_CHECK(bias.size(2) > 0 && M % bias.size(2) == 0 && bias.size(3) >= L,
              "decode_attention: bias [B, 1, R, L] with R dividing the query rows (", M, ") expected, got ",
              bias.sizes());
  return {reinterpret_cast<const uint16_t*>(bias.data_ptr()), bias.stride(0), bias.stride(2), bias.size(2), 0};
}

// Where a task writes the chunk-local softmax numerators exp(s - max_c) of its share rows, its query rows m of bias row
// `row` (see Shares): the k-th of them at data + k * stride, from its chunk's first position on; each tile of 16
// (or 8) positions whole, 0 where the bias hides a position or the tile was skipped. No data: none asked for.
struct ShareRows {
  float* data = nullptr;
  int64_t stride = 0, first = 0, R = 1;  // first: the task's first share row; R: the bias's rows, one share row in R
  float* row(int64_t m) const {  // the numerators of the task's query row m, or nullptr where it is no share row
    return data != nullptr && m >= first && (m - first) % R == 0 ? data + (m - first) / R * stride : nullptr;
  }
};

// Attention shares: out [B, H, L] (fp32), out[b, h, l] = the sum over the query rows m of head h whose bias row is
// `row` (m % R == row: with the model's layout the G query heads of new token `row`) of their softmax probability at l,
// exp(s_ml - max_m) / denom_m with the row's maximum and denominator over all its chunks. The tasks write those S =
// M / R rows' chunk-local numerators into `numer` [B * H, S, Lp] (Lp: L rounded up to whole tiles); once all of a
// head's chunks are done, `merge_head` weighs each chunk's by exp(max_c - max) / denom and sums them over the rows.
// The attention's own arithmetic is untouched: its output has the same bits with or without shares.
struct Shares {
  float* out = nullptr;  // nullptr: no shares asked for
  int64_t row = 0, R = 1, S = 0, L = 0, Lp = 0;
  at::Tensor numer_buffer;
  float* numer = nullptr;  // numer_buffer's

  // Where the task of rows [m0, m0 + rows) of head bh over the chunk from position l0 writes its numerators.
  ShareRows rows_of(int64_t bh, int64_t m0, int64_t rows, int64_t l0) const {
    const int64_t first = ((row - m0) % R + R) % R;  // the block's first query row of bias row `row`
    if (out == nullptr || first >= rows) return {};
    return {numer + (bh * S + (m0 + first) / R) * Lp + l0, Lp, first, R};
  }

  // out[bh, :] from the numerators and the chunks' maxima pm and sums ps ([BH, C, M], as attend_in_chunks keeps
  // them): each share row's maximum and denominator as merge_chunks takes them. w: a buffer of the caller's.
  void merge_head(int64_t bh, int64_t M, int64_t C, int64_t chunk, const float* pm, const float* ps,
                  std::vector<float>& w) const {
    w.resize(S * C);  // [S, C] each share row's weight of each chunk's numerators
    for (int64_t k = 0; k < S; ++k)
      row_weights(pm + bh * C * M + k * R + row, ps + bh * C * M + k * R + row, M, C, w.data() + k * C);
    float* o = out + bh * L;
    for (int64_t c = 0; c < C; ++c) {
      const int64_t l0 = c * chunk, l1 = std::min(L, l0 + chunk);
      for (int64_t k = 0; k < S; ++k) {
        const float* e = numer + (bh * S + k) * Lp;
        const float wk = w[k * C + c];
        if (k == 0) {
          for (int64_t l = l0; l < l1; ++l) o[l] = e[l] * wk;
        } else {
          for (int64_t l = l0; l < l1; ++l) o[l] += e[l] * wk;
        }
      }
    }
  }

  // merge_head of the heads of [0, BH) not `merged` yet.
  void merge(int64_t BH, int64_t M, int64_t C, int64_t chunk, const float* pm, const float* ps,
             const std::vector<char>& merged) const {
    if (out == nullptr) return;
    at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> w;
      for (int64_t bh = begin; bh < end; ++bh)
        if (!merged[bh]) merge_head(bh, M, C, chunk, pm, ps, w);
    });
  }

  // w[c] = exp(max_c - max) / denom for a query row whose chunk maxima and sums are pm[c * M], ps[c * M]; 0 for a
  // chunk the row sees nothing of.
  static void row_weights(const float* pm, const float* ps, int64_t M, int64_t C, float* w) {
    float mx = kNegInf, denom = 0.0f;
    for (int64_t c = 0; c < C; ++c) mx = std::max(mx, pm[c * M]);
    for (int64_t c = 0; c < C; ++c) {
      w[c] = 0.0f;
      if (pm[c * M] == kNegInf) continue;
      w[c] = std::exp(pm[c * M] - mx);
      denom += w[c] * ps[c * M];
    }
    for (int64_t c = 0; c < C; ++c) w[c] = denom > 0.0f ? w[c] / denom : 0.0f;
  }
};

// The checks and the Shares of an attention op's optional `shares` operand, [B, H, L] fp32 contiguous, for the query
// rows of bias row `row` of [0, R); M query rows a head, `tile` positions a kernel tile.
inline Shares shares_of(const std::optional<at::Tensor>& shares, int64_t row, int64_t B, int64_t H, int64_t M,
                        int64_t R, int64_t L, int64_t tile) {
  if (!shares) return {};
  TORCH_CHECK(shares->scalar_type() == at::kFloat && shares->is_contiguous() && shares->dim() == 3 &&
                  shares->size(0) == B && shares->size(1) == H && shares->size(2) == L,
              "decode_attention: shares must be a contiguous fp32 tensor [B, KV, L] = [", B, ", ", H, ", ", L,
              "], got ", shares->scalar_type(), " ", shares->sizes(),
              shares->is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(row >= 0 && row < R, "decode_attention: share_row ", row, " is not a bias row, in [0, ", R, ")");
  const int64_t S = M / R, Lp = (L + tile - 1) / tile * tile;
  auto numer = at::empty({B * H * S * Lp}, shares->options());
  return {shares->data_ptr<float>(), row, R, S, L, Lp, numer, numer.data_ptr<float>()};
}

// out[i] = the chunks' partial results of query row i merged by their maxima: sum_c w_c out_c / sum_c w_c sum_c,
// w_c = exp(max_c - max). A chunk the row sees nothing of (max -inf) is skipped.
template <int D>
void merge_chunks(int64_t rows, int64_t M, int64_t C, const float* pm, const float* ps, const float* po, float* op) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m = i % M, bh = i / M;
      float mx = kNegInf;
      for (int64_t c = 0; c < C; ++c) mx = std::max(mx, pm[(bh * C + c) * M + m]);
      float denom = 0.0f, acc[D] = {0.0f};
      for (int64_t c = 0; c < C; ++c) {
        const float cm = pm[(bh * C + c) * M + m];
        if (cm == kNegInf) continue;
        const float w = std::exp(cm - mx);
        denom += w * ps[(bh * C + c) * M + m];
        const float* o = po + ((bh * C + c) * M + m) * D;
        for (int d = 0; d < D; ++d) acc[d] += w * o[d];
      }
      for (int d = 0; d < D; ++d) op[i * D + d] = acc[d] / denom;
    }
  });
}

// Rows that attend over the same chunk of context (the same blocks of a pool, behind the same bias: a prompt prefix the
// prefix cache shares among requests, or among the samples of one prompt) are one group per chunk, which one task
// attends for all its rows, their query rows gathered (cascade attention): each K/V tile is read, and transposed or
// interleaved, once for the group, and on AMX tiles up to 16 query rows cost about what one does. A row's arithmetic
// does not depend on the other rows of its task, so each gets the bits of its own task.
struct Sharing {
  std::vector<int32_t> members;  // the rows of each group, group after group, each in increasing order
  std::vector<int32_t> first;    // [C, B]: where the group row b leads (its lowest row) starts in `members`; -1: none
  std::vector<int32_t> count;    // [C, B]: the rows of the group row b leads (1: b alone)
  bool any = false;              // whether some group holds more than one row
};

// The groups of rows over chunks of `chunk` positions of L: rows whose K and V blocks (the offsets `K.blocks` and
// `V.blocks` name) over the chunk are the same and whose bias rows agree over it. Called for pools read through a
// block table; those of blocks of fewer than 16 positions (a draft's token tables) are not looked at: their rows
// select positions of their own.
template <class T>
Sharing sharing_of(const StridedOf<T>& K, const StridedOf<T>& V, const Bias& bias, int64_t B, int64_t L,
                   int64_t chunk) {
  Sharing sharing;
  if (K.shift < 4 || B < 2) return sharing;
  const int64_t C = (L + chunk - 1) / chunk;
  sharing.first.assign(C * B, -1);
  sharing.count.assign(C * B, 0);
  std::vector<int32_t> group(B), leaders;
  for (int64_t c = 0; c < C; ++c) {
    const int64_t l0 = c * chunk, l1 = std::min(L, l0 + chunk), j0 = l0 >> K.shift, nj = ((l1 - 1) >> K.shift) - j0 + 1;
    const auto same = [&](int64_t a, int64_t b) {
      if (K.blocks[a * K.nblk + j0] != K.blocks[b * K.nblk + j0]) return false;  // most rows, at once
      if (std::memcmp(K.blocks + a * K.nblk + j0, K.blocks + b * K.nblk + j0, nj * sizeof(int64_t)) != 0 ||
          std::memcmp(V.blocks + a * V.nblk + j0, V.blocks + b * V.nblk + j0, nj * sizeof(int64_t)) != 0)
        return false;
      for (int64_t r = 0; r < bias.R; ++r)
        if (std::memcmp(bias.at(a, r, l0), bias.at(b, r, l0), (l1 - l0) * sizeof(uint16_t)) != 0) return false;
      return true;
    };
    leaders.clear();
    for (int64_t b = 0; b < B; ++b) {
      const auto found = std::find_if(leaders.begin(), leaders.end(), [&](int32_t a) { return same(a, b); });
      group[b] = found == leaders.end() ? static_cast<int32_t>(b) : *found;
      if (found == leaders.end()) leaders.push_back(static_cast<int32_t>(b));
    }
    for (const int32_t a : leaders) {
      sharing.first[c * B + a] = static_cast<int32_t>(sharing.members.size());
      for (int64_t b = a; b < B; ++b)
        if (group[b] == a) sharing.members.push_back(static_cast<int32_t>(b));
      sharing.count[c * B + a] = static_cast<int32_t>(sharing.members.size()) - sharing.first[c * B + a];
      sharing.any |= sharing.count[c * B + a] > 1;
    }
  }
  return sharing;
}

// The query rows of head h of the n rows `rows` of a group, one row's `width` words after another, gathered from
// queries [B, H, width] into `out`; returns its data.
template <class T>
const T* gather_queries(const T* queries, const int32_t* rows, int64_t n, int64_t h, int64_t H, int64_t width,
                        std::vector<T>& out) {
  out.resize(n * width);
  for (int64_t j = 0; j < n; ++j) std::copy_n(queries + (rows[j] * H + h) * width, width, out.data() + j * width);
  return out.data();
}

// attend_in_chunks's tasks where rows share chunks (Sharing): for each (row, head, chunk) in that order, the task of
// the row's group where the row leads it, none where another row does. The threads take the tasks one by one as
// they finish the last (a group's task costs more than a row's, and the rows that lead groups are the first ones).
// A group's share rows write their numerators into the thread's buffer (`chunk` floats a share row), copied to each
// row's place as its partial results are; the heads' shares are merged after all tasks.
template <int D, class MakeTask, class MakeGroup>
void attend_groups(int64_t B, int64_t H, int64_t M, int64_t L, int64_t chunk, const Bias& bias, const Sharing& sharing,
                   const Shares& shares, float* pm, float* ps, float* po, MakeTask& make_task, MakeGroup& make_group) {
  const int64_t C = (L + chunk - 1) / chunk;
  std::vector<int64_t> tasks;  // b * H * C + h * C + c: the (row, head, chunk) whose task runs
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t c = 0; c < C; ++c)
        if (sharing.first[c * B + b] >= 0) tasks.push_back((b * H + h) * C + c);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    typename std::invoke_result_t<MakeTask, int64_t, int64_t, int64_t, Bias>::Buffers buffers;
    std::vector<float> gm, gs, go, ge;  // a group's partial results and share numerators, its rows one after another
    for (int64_t i = next++; i < static_cast<int64_t>(tasks.size()); i = next++) {
      const int64_t bhc = tasks[i], c = bhc % C, bh = bhc / C, h = bh % H, b = bh / H;
      const int64_t l0 = c * chunk, l1 = std::min(L, l0 + chunk), n = sharing.count[c * B + b];
      if (n == 1) {
        auto work = make_task(bh, 0, M, bias);
        work.share = shares.rows_of(bh, 0, M, l0);
        work.run(b, h, l0, l1, buffers, pm + bhc * M, ps + bhc * M, po + bhc * M * D);
        continue;
      }
      const int32_t* rows = sharing.members.data() + sharing.first[c * B + b];
      auto work = make_group(rows, n, h, bias, buffers);
      gm.resize(n * M);
      gs.resize(n * M);
      go.resize(n * M * D);
      if (shares.out != nullptr) {
        ge.resize(n * shares.S * chunk);
        work.share = {ge.data(), chunk, shares.row, shares.R};  // row j's k-th share row: j * S + k
      }
      work.run(b, h, l0, l1, buffers, gm.data(), gs.data(), go.data());
      const int64_t width = std::min(chunk, shares.Lp - l0);  // whole tiles, as the task wrote them
      for (int64_t j = 0; j < n; ++j) {
        const int64_t at = ((rows[j] * H + h) * C + c) * M;
        std::copy_n(gm.data() + j * M, M, pm + at);
        std::copy_n(gs.data() + j * M, M, ps + at);
        std::copy_n(go.data() + j * M * D, M * D, po + at * D);
        for (int64_t k = 0; shares.out != nullptr && k < shares.S; ++k)
          std::copy_n(ge.data() + (j * shares.S + k) * chunk, width,
                      shares.numer + ((rows[j] * H + h) * shares.S + k) * shares.Lp + l0);
      }
    }
  });
  if (shares.out != nullptr) shares.merge(B * H, M, C, chunk, pm, ps, std::vector<char>(B * H, 0));
}

// Attention of M query rows per (row, KV head) over L positions in chunks of `chunk`, returning [B, H, M, D] fp32,
// and the attention shares where `shares` holds an output (Shares).
// make_task(bh, m0, rows, bias) builds the task of rows [m0, m0 + rows) of head bh (with the bias from its row m0);
// its run(b, h, l0, l1, buffers, max, sum, out) writes the chunk's maxima, sums and unnormalized outputs, and the
// numerators of its rows that its member `share` (ShareRows) names.
// A prefill chunk's many query rows are split into blocks of at most kBlockRows. A row's arithmetic does not depend
// on the block it is in: a tile hidden from all of a block's rows adds nothing to them whether skipped or not.
// Where a task takes one block of query rows, find_sharing() gives the groups of rows over chunks (Sharing); where
// some group holds more than one row, make_group(rows, n, h, bias, buffers) builds the task of head h of the n rows of
// a group over a chunk (their queries gathered into the thread's Buffers, gather_queries), and its partial results
// and share numerators go to each row's place.
template <int D, class MakeTask, class FindSharing = std::nullptr_t, class MakeGroup = std::nullptr_t>
at::Tensor attend_in_chunks(int64_t B, int64_t H, int64_t M, int64_t L, int64_t chunk, const Bias& bias,
                            const at::TensorOptions& opts, const Shares& shares, MakeTask make_task,
                            FindSharing find_sharing = nullptr, MakeGroup make_group = nullptr) {
  const int64_t C = (L + chunk - 1) / chunk, BHC = B * H * C;
  auto part_out = at::empty({BHC, M, D}, opts), part_max = at::empty({BHC, M}, opts);
  auto part_sum = at::empty({BHC, M}, opts);
  float *po = part_out.data_ptr<float>(), *pm = part_max.data_ptr<float>(), *ps = part_sum.data_ptr<float>();
  const int64_t blocks = (M + kBlockRows - 1) / kBlockRows;
  if constexpr (!std::is_same_v<MakeGroup, std::nullptr_t>) {
    const Sharing sharing = blocks == 1 ? find_sharing() : Sharing{};
    if (sharing.any) {
      attend_groups<D>(B, H, M, L, chunk, bias, sharing, shares, pm, ps, po, make_task, make_group);
      auto out = at::empty({B, H, M, D}, opts);
      merge_chunks<D>(B * H * M, M, C, pm, ps, po, out.data_ptr<float>());
      return out;
    }
  }
  const int64_t rows = (M + blocks - 1) / blocks, per_head = C * blocks;  // a head's tasks, one after another
  std::vector<char> merged(shares.out != nullptr ? B * H : 0, 0);  // the heads whose shares are done
  at::parallel_for(0, BHC * blocks, 1, [&](int64_t begin, int64_t end) {
    typename std::invoke_result_t<MakeTask, int64_t, int64_t, int64_t, Bias>::Buffers buffers;
    std::vector<float> weights;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t m0 = task % blocks * rows, bhc = task / blocks, c = bhc % C, bh = bhc / C, h = bh % H, b = bh / H;
      if (m0 < M) {
        Bias block_bias = bias;
        block_bias.first = m0 % bias.R;
        auto work = make_task(bh, m0, std::min(rows, M - m0), block_bias);
        work.share = shares.rows_of(bh, m0, std::min(rows, M - m0), c * chunk);
        const int64_t first = bhc * M + m0;  // the block's first row among the partial results
        work.run(b, h, c * chunk, std::min(L, (c + 1) * chunk), buffers, pm + first, ps + first, po + first * D);
      }
      // A head's shares are merged by the thread that ran all its tasks, after the last, while its numerators are
      // still in cache; the others' after the loop.
      if (!merged.empty() && (task + 1) % per_head == 0 && task + 1 - per_head >= begin) {
        shares.merge_head(bh, M, C, chunk, pm, ps, weights);
        merged[bh] = 1;
      }
    }
  });
  auto out = at::empty({B, H, M, D}, opts);
  merge_chunks<D>(B * H * M, M, C, pm, ps, po, out.data_ptr<float>());
  shares.merge(B * H, M, C, chunk, pm, ps, merged);
  return out;
}

// Runs block(i, std::integral_constant<int, r>) over rows [0, M) in blocks of kRows rows, the last block shorter:
// every row meets the same arithmetic whichever block it falls in.
template <int kRows, class Block>
void for_each_row_block(int64_t M, Block block) {
  int64_t i = 0;
  for (; i + kRows <= M; i += kRows) block(i, std::integral_constant<int, kRows>{});
  if constexpr (kRows > 1) {
    if (M - i > 0) for_each_row_block<kRows - 1>(M - i, [&](int64_t j, auto r) { block(i + j, r); });
  }
}

}  // namespace magicdec
