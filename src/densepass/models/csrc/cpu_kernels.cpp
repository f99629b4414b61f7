// bf16 kernels of the fused BERT layers on x86 CPUs: self-attention over sequences packed without padding (alone, or
// with the query, key and value product before it), all that follows attention in a layer (output product,
// feed-forward, layer norms) as one kernel, the embeddings of packed tokens, and layer norm in place
// (densepass/models/cpu_kernels.py says what they compute and why; tests/test_cpu_kernels.py checks them against
// float64 and torch). One source, two builds, told apart by the compiler's flags: with -mamx-tile -mamx-bf16
// -mamx-int8 (Intel Sapphire Rapids and later) the products and attention's two products run on AMX tiles;
// without, on AVX-512 registers with vdpbf16ps (AVX512-BF16: AMD Zen 4 and 5, Intel Cooper Lake). Both read the
// weights in the same layout (`tile_layout`: pairs of bf16 along the depth, 16 output columns a 64-byte row, what
// a tile's right operand and vdpbf16ps's second operand both take) and share all the rest. Both also hold
// densepass_int8_linear, a linear layer through int8 products with a scale per token (AMX tiles' tdpbusd in the
// AMX build, AVX512-VNNI's vpdpbusd in the other), and, for training, dropout with counter-based masks and
// attention's softmax with its dropout, forward and backward (tests/test_dropout.py checks them against NumPy's
// masks and float64).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
#define DENSEPASS_TILES 1
#else
#define DENSEPASS_TILES 0
#endif

namespace {

#if DENSEPASS_TILES
struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Eight tiles of 16 rows x 64 bytes. Scores: accumulators 0 and 1, queries 4 (and 5: dims 32-63), keys 6 and 7.
// Context: accumulators 0-3 (16 dims each), probabilities 5, values 6 and 7.
void configure_tiles() {
  TileConfig config{};
  config.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

void release_tiles() { _tile_release(); }
#else
void configure_tiles() {}  // AVX512-BF16: registers only, nothing to configure or release
void release_tiles() {}
#endif

// A zero-filled scratch array aligned to a cache line (rows of 64 bytes never straddle two).
template <typename T>
struct Scratch {
  T* data;
  explicit Scratch(int64_t count) : data(static_cast<T*>(std::aligned_alloc(64, bytes(count)))) {
    std::memset(data, 0, bytes(count));
  }
  ~Scratch() { std::free(data); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  static size_t bytes(int64_t count) { return ((count > 0 ? count : 1) * sizeof(T) + 63) / 64 * 64; }
};

// 2^t for t <= 0, to 8e-5 relative (bf16 rounds to 4e-3): t = n + f with |f| <= 1/2, 2^f by a cubic (fitted to
// the relative error at Chebyshev nodes), times 2^n.
inline __m512 exp2_nonpositive(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(5.508868e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4260405e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9327624e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9992894e-1f));
  return _mm512_scalef_ps(p, n);
}

// 2^t for t <= 0 to float32's precision (float32 softmax in training): the same split, 2^f by its Taylor polynomial
// of degree 7 (relative error 7e-9 for |f| <= 1/2).
inline __m512 exp2_nonpositive_exact(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.525273380e-05f);
  for (const float c : {1.540353039e-04f, 1.333355815e-03f, 9.618129108e-03f, 5.550410866e-02f, 2.402265070e-01f,
                        6.931471806e-01f, 1.0f})
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// r[j] (16 rows of 16 dwords) transposed in place: afterwards lane i of r[j] is what lane j of r[i] was.
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int j = 0; j < 16; j += 2) {
    t[j] = _mm512_unpacklo_epi32(r[j], r[j + 1]);
    t[j + 1] = _mm512_unpackhi_epi32(r[j], r[j + 1]);
  }
  for (int j = 0; j < 16; j += 4) {  // r[4 g + m]: in each 128-bit lane L, dword 4 L + m of rows 4 g .. 4 g + 3
    r[j] = _mm512_unpacklo_epi64(t[j], t[j + 2]);
    r[j + 1] = _mm512_unpackhi_epi64(t[j], t[j + 2]);
    r[j + 2] = _mm512_unpacklo_epi64(t[j + 1], t[j + 3]);
    r[j + 3] = _mm512_unpackhi_epi64(t[j + 1], t[j + 3]);
  }
  for (int m = 0; m < 4; ++m) {  // gather lane L of the four groups into row 4 L + m
    const __m512i a = _mm512_shuffle_i32x4(r[m], r[4 + m], 0x88), b = _mm512_shuffle_i32x4(r[m], r[4 + m], 0xdd);
    const __m512i c = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0x88);
    const __m512i d = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0xdd);
    t[m] = _mm512_shuffle_i32x4(a, c, 0x88);
    t[4 + m] = _mm512_shuffle_i32x4(b, d, 0x88);
    t[8 + m] = _mm512_shuffle_i32x4(a, c, 0xdd);
    t[12 + m] = _mm512_shuffle_i32x4(b, d, 0xdd);
  }
  for (int j = 0; j < 16; ++j) r[j] = t[j];
}

// Lane i of the result: the 16 lanes of rows[i] folded by `combine` (a maximum or a sum), through one transpose.
template <typename Combine>
inline __m512 across(__m512 (&rows)[16], Combine combine) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_castps_si512(rows[i]);
  transpose16(r);
  __m512 folded = _mm512_castsi512_ps(r[0]);
  for (int j = 1; j < 16; ++j) folded = combine(folded, _mm512_castsi512_ps(r[j]));
  return folded;
}

inline __m512 load_bf16(const uint16_t* p) {  // 16 bf16 values widened to float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

inline void store_bf16(uint16_t* p, __m512 v) {  // rounded to nearest even
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}

inline __m512 load_bf16(const uint16_t* p, __mmask16 lanes) {  // the lanes given, widened; 0 in the others
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, p)), 16));
}

inline void store_bf16(uint16_t* p, __m512 v, __mmask16 lanes) {  // the lanes given, rounded to nearest even
  _mm256_mask_storeu_epi16(p, lanes, (__m256i)_mm512_cvtneps_pbh(v));
}

inline uint16_t block_mask(int64_t remaining) {
  return remaining >= 16 ? 0xffff : static_cast<uint16_t>((1u << remaining) - 1);
}

// Buffers a thread keeps from call to call, each grown where a call needs more (never shrunk): the large
// activations of densepass_after_attention, without mapping and faulting in fresh pages every layer.
class Workspace {
 public:
  static constexpr int kSlots = 5;
  ~Workspace() {
    for (void* buffer : buffers_) std::free(buffer);
  }
  float* floats(int slot, int64_t count) { return static_cast<float*>(get(slot, count * 4)); }
  uint16_t* halves(int slot, int64_t count) { return static_cast<uint16_t*>(get(slot, count * 2)); }

 private:
  void* get(int slot, int64_t bytes) {
    const size_t size = (static_cast<size_t>(bytes) + 63) / 64 * 64;
    if (size > sizes_[slot]) {
      std::free(buffers_[slot]);
      buffers_[slot] = std::aligned_alloc(64, size);
      sizes_[slot] = size;
    }
    return buffers_[slot];
  }
  void* buffers_[kSlots] = {};
  size_t sizes_[kSlots] = {};
};

constexpr int64_t kMaxWidth = 2048;  // the widest row the layer norms take
constexpr int64_t kBlockRows = 256;  // the rows densepass_after_attention's threads take at a time
constexpr int64_t kGroupRows = 256;  // the tokens densepass_qkv_attention's threads take at a time (whole sequences)

// Running sums of a row's values less a shift (its first value: the shifted-data algorithm, so that the variance
// is not lost where the mean is large against it), 16 lanes each, for a layer norm.
struct Moments {
  __m512 sum, squares;
  float shift;
  void add(__m512 v) {
    const __m512 d = _mm512_sub_ps(v, _mm512_set1_ps(shift));
    sum = _mm512_add_ps(sum, d);
    squares = _mm512_fmadd_ps(d, d, squares);
  }
};

// A float32 row of `blocks` x 16 values (in L1) normalised: (row - mean) / sqrt(variance + eps) x weight + bias
// (bf16 weight and bias, widened as they are read), written to dst in bf16; two passes, its Moments, then this.
inline void normalize(const float* row, int64_t blocks, const uint16_t* weight, const uint16_t* bias, float eps,
                      uint16_t* dst) {
  Moments m{_mm512_setzero_ps(), _mm512_setzero_ps(), row[0]};
  for (int64_t k = 0; k < blocks; ++k) m.add(_mm512_load_ps(row + 16 * k));
  const float width = static_cast<float>(blocks * 16);
  const float sum = _mm512_reduce_add_ps(m.sum) / width, squares = _mm512_reduce_add_ps(m.squares) / width;
  const float difference = squares - sum * sum, variance = difference < 0 ? 0 : difference;  // NaN stays NaN
  const __m512 mean = _mm512_set1_ps(m.shift + sum);
  const __m512 scale = _mm512_set1_ps(1.0f / __builtin_sqrtf(variance + eps));
  for (int64_t k = 0; k < blocks; ++k) {
    const __m512 normal = _mm512_mul_ps(_mm512_sub_ps(_mm512_load_ps(row + 16 * k), mean), scale);
    store_bf16(dst + 16 * k, _mm512_fmadd_ps(normal, load_bf16(weight + 16 * k), load_bf16(bias + 16 * k)));
  }
}

#if DENSEPASS_TILES
// a [32 x parts rows of `depth`, `stride` elements apart] W^T ([width, depth] in `tile_layout`), 32 rows x 32
// columns at a time, on AMX tiles (accumulators 0-3, rows of a 4 and 5, columns of W 6 and 7): columns outer (a
// slice of W read from memory once for all the rows), or with `rows_outer` each 32 rows finished one after the
// other. Each finished block is handed to epilogue(first row, first column, c [32 x 32 floats], rows from, rows to)
// a few rows at a time in between the tile instructions of the next block, and background() is called once a
// step: the core computes them while the tiles run. prepare(part) runs before a block of the part's rows.
template <typename Prepare, typename Epilogue, typename Background>
inline void product(const uint16_t* a, int64_t stride, int64_t parts, int64_t depth, const uint16_t* w,
                    int64_t width, bool rows_outer, Prepare prepare, Epilogue epilogue, Background background) {
  alignas(64) float c[32 * 32];
  const int64_t steps = depth / 32, slice = (32 + steps - 1) / steps;  // epilogue rows per step of the next block
  const int64_t columns = width / 32;
  bool pending = false;
  int64_t pending_row = 0, pending_column = 0;  // where the finished block in c goes
  const auto finish = [&](int64_t from, int64_t to) {
    if (pending && from < 32) epilogue(pending_row, pending_column, c, from, to < 32 ? to : 32);
  };
  for (int64_t outer = 0; outer < (rows_outer ? parts : columns); ++outer)
    for (int64_t inner = 0; inner < (rows_outer ? columns : parts); ++inner) {
      const int64_t part = rows_outer ? outer : inner, j = 32 * (rows_outer ? inner : outer);
      const uint16_t* rows = a + part * 32 * stride;
      const uint16_t* w0 = w + j * depth;
      const uint16_t* w1 = w0 + steps * 512;
      prepare(part);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t k = 0; k < steps; ++k) {
        _tile_loadd(4, rows + k * 32, stride * 2);
        _tile_loadd(6, w0 + k * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, w1 + k * 512, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, rows + 16 * stride + k * 32, stride * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        finish(k * slice, (k + 1) * slice);
        background();
      }
      finish(steps * slice, 32);  // the last block's epilogue done: c is free
      pending = true;
      pending_row = part * 32;
      pending_column = j;
      _tile_stored(0, c, 128);
      _tile_stored(1, c + 16, 128);
      _tile_stored(2, c + 512, 128);
      _tile_stored(3, c + 528, 128);
    }
  finish(0, 32);
}

#else
// One pair of bf16 values (along the depth) as the 32-bit lane vdpbf16ps multiplies with a pair of its other
// operand, in all 16 lanes.
inline __m512bh pair(const uint16_t* p) {
  int32_t bits;
  std::memcpy(&bits, p, 4);
  return (__m512bh)_mm512_set1_epi32(bits);
}

inline __m512bh load_pairs(const void* p) { return (__m512bh)_mm512_load_si512(p); }

// c[8 x 32 floats, 32 apart] = a [8 rows of `depth`, `stride` elements apart] x the 32 columns of W whose
// `tile_layout` panels (16 columns each) start at w0 and w1: 8 rows x 2 registers of accumulators, the depth a pair
// at a time (each row's pair broadcast, 16 vdpbf16ps per pair: two loads of W's pairs serve 8 rows).
inline void rows8x32(const uint16_t* a, int64_t stride, int64_t depth, const uint16_t* w0, const uint16_t* w1,
                     float* c) {
  __m512 acc[8][2];
#pragma GCC unroll 8
  for (int r = 0; r < 8; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < depth; k += 2) {
    const __m512bh b0 = load_pairs(w0 + 16 * k), b1 = load_pairs(w1 + 16 * k);
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) {
      const __m512bh x = pair(a + r * stride + k);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < 8; ++r) {
    _mm512_store_ps(c + r * 32, acc[r][0]);
    _mm512_store_ps(c + r * 32 + 16, acc[r][1]);
  }
}

// What the tile version above computes, with its callbacks called in the same order, on AVX512-BF16: each block of
// 32 rows x 32 columns as four blocks of 8 rows (rows8x32), its epilogue called once it is complete, background()
// `depth / 32` times after it (as often as the tile version calls it).
template <typename Prepare, typename Epilogue, typename Background>
inline void product(const uint16_t* a, int64_t stride, int64_t parts, int64_t depth, const uint16_t* w,
                    int64_t width, bool rows_outer, Prepare prepare, Epilogue epilogue, Background background) {
  alignas(64) float c[32 * 32];
  const int64_t columns = width / 32, steps = depth / 32;
  for (int64_t outer = 0; outer < (rows_outer ? parts : columns); ++outer)
    for (int64_t inner = 0; inner < (rows_outer ? columns : parts); ++inner) {
      const int64_t part = rows_outer ? outer : inner, j = 32 * (rows_outer ? inner : outer);
      const uint16_t* rows = a + part * 32 * stride;
      const uint16_t* w0 = w + j * depth;
      prepare(part);
      for (int64_t r = 0; r < 32; r += 8) rows8x32(rows + r * stride, stride, depth, w0, w0 + 16 * depth, c + r * 32);
      epilogue(part * 32, j, c, 0, 32);
      for (int64_t k = 0; k < steps; ++k) background();
    }
}
#endif

// int8 products on AVX512-VNNI (vpdpbusd: unsigned bytes x signed bytes, four pairs summed into each int32 lane).
// An input row is quantised with a scale and an offset of its own, over its range [lo, hi]: s = (hi - lo) / 255,
// q = round((x - lo) / s), in [0, 255] (unsigned bytes, all 256 levels used whatever the row's skew); the weights
// are int8 with a scale per output column, in `vnni_layout` (per 16 columns, the depth four at a time: each 64-byte
// row the 16 columns' four bytes). The offset is taken back through each column's sum of weights:
// sum_k x_k w_k ~ s sum_k q_k w_k + lo sum_k w_k.

// Quantises `rows` rows of `depth` bf16 values (`depth` a multiple of 16) into q (rows of `depth` bytes), scale
// and low (one each per row; a constant row has scale 0, its bytes all 0, and low its value; a row with a NaN or an
// infinity has scale and low NaN, so that its outputs are NaN, as a float product's would be).
inline void quantize_rows(const uint16_t* x, int64_t rows, int64_t depth, uint8_t* q, float* scale, float* low) {
  const __m512i zero = _mm512_setzero_si512(), top = _mm512_set1_epi32(255);
  for (int64_t i = 0; i < rows; ++i) {
    const uint16_t* row = x + i * depth;
    __m512 smallest = load_bf16(row), largest = smallest;
    __mmask16 unordered = _mm512_cmp_ps_mask(smallest, smallest, _CMP_UNORD_Q);
    for (int64_t k = 16; k < depth; k += 16) {
      const __m512 v = load_bf16(row + k);
      smallest = _mm512_min_ps(smallest, v);
      largest = _mm512_max_ps(largest, v);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);  // NaN: min and max would drop it
    }
    float lo = _mm512_reduce_min_ps(smallest), range = _mm512_reduce_max_ps(largest) - lo;
    if (unordered || !std::isfinite(lo) || !std::isfinite(range)) lo = range = std::nanf("");
    const float inverse = range > 0.0f ? 255.0f / range : 0.0f;
    scale[i] = range > 0.0f || std::isnan(range) ? range / 255.0f : 0.0f;
    low[i] = lo;
    const __m512 by = _mm512_set1_ps(inverse), offset = _mm512_set1_ps(lo);
    for (int64_t k = 0; k < depth; k += 16) {
      // to nearest, ties to even
      __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(load_bf16(row + k), offset), by));
      v = _mm512_min_epi32(_mm512_max_epi32(v, zero), top);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * depth + k), _mm512_cvtepi32_epi8(v));
    }
  }
}

// acc[8 x 32 int32, 32 apart] = the 8 byte rows at a (`stride` bytes apart) x the 32 columns of W whose
// `vnni_layout` panels (16 columns each) start at w0 and w1: 8 rows x 2 registers of accumulators, the depth four
// at a time (each row's four bytes broadcast, 16 vpdpbusd per step).
inline void rows8x32_int8(const uint8_t* a, int64_t stride, int64_t depth, const int8_t* w0, const int8_t* w1,
                          int32_t* acc_out) {
  __m512i acc[8][2];
#pragma GCC unroll 8
  for (int r = 0; r < 8; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  for (int64_t k = 0; k < depth; k += 4) {
    const __m512i b0 = _mm512_loadu_si512(w0 + 16 * k), b1 = _mm512_loadu_si512(w1 + 16 * k);
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) {
      int32_t bytes;
      std::memcpy(&bytes, a + r * stride + k, 4);
      const __m512i x = _mm512_set1_epi32(bytes);
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], x, b0);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], x, b1);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < 8; ++r) {
    _mm512_store_si512(acc_out + r * 32, acc[r][0]);
    _mm512_store_si512(acc_out + r * 32 + 16, acc[r][1]);
  }
}

// Layer norms of the rows of a float32 buffer, one row at a time as they become ready (their sums complete), so
// that they can run in between tile instructions.
struct RowNorms {
  float* sums = nullptr;
  uint16_t* out = nullptr;
  const uint16_t* weight = nullptr;
  const uint16_t* bias = nullptr;
  float eps = 0;
  int64_t width = 0, next = 0, ready = 0;  // rows normalised so far; rows whose sums are complete

  void add(int64_t row, int64_t column, __m512 v0, __m512 v1) {  // sums[row][column .. column + 31] = v0, v1
    _mm512_store_ps(sums + row * width + column, v0);
    _mm512_store_ps(sums + row * width + column + 16, v1);
  }
  bool one() {  // normalises the next row where it is ready; whether there was one
    if (next >= ready) return false;
    normalize(sums + next * width, width / 16, weight, bias, eps, out + next * width);
    ++next;
    return true;
  }
  void until(int64_t row) {  // every ready row before `row`
    while (next < row && one()) {
    }
  }
};

// GELU(x) = x Phi(x) (the exact GELU, Phi the normal distribution function) by a quartic on each of 32 intervals
// of [-6, 6] through its values at the interval's Chebyshev-Lobatto points (both ends among them: exact at 0),
// x itself above 6 and the quartic's value at -6 (about -6e-9) below: within 1.2e-6 of GELU everywhere, far below
// bf16's rounding. The coefficients are worked out once, in double precision.
struct GeluTable {
  static constexpr double kLow = -6.0, kHigh = 6.0;
  float c[5][32];  // coefficient of t^d (t in [0, 1] across the interval) for interval i: c[d][i]
  GeluTable() {
    const double step = (kHigh - kLow) / 32, pi = 3.14159265358979323846;
    for (int i = 0; i < 32; ++i) {
      double m[5][6];  // the Vandermonde system at the nodes, augmented with GELU's values
      for (int r = 0; r < 5; ++r) {
        const double t = 0.5 - 0.5 * std::cos(r * pi / 4), x = kLow + step * (i + t);
        for (int d = 0; d < 5; ++d) m[r][d] = std::pow(t, d);
        m[r][5] = 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
      }
      for (int col = 0; col < 5; ++col) {  // Gauss-Jordan elimination with partial pivoting
        int pivot = col;
        for (int r = col + 1; r < 5; ++r)
          if (std::fabs(m[r][col]) > std::fabs(m[pivot][col])) pivot = r;
        for (int d = 0; d < 6; ++d) std::swap(m[col][d], m[pivot][d]);
        for (int r = 0; r < 5; ++r) {
          if (r == col) continue;
          const double factor = m[r][col] / m[col][col];
          for (int d = 0; d < 6; ++d) m[r][d] -= factor * m[col][d];
        }
      }
      for (int d = 0; d < 5; ++d) c[d][i] = static_cast<float>(m[d][5] / m[d][d]);
    }
  }
};

const GeluTable& gelu_table() {
  static const GeluTable table;
  return table;
}

// GELU by the table's quartics, the coefficients held in registers (loaded once per batch of values).
struct Gelu {
  __m512 left[5], right[5];  // coefficient d of intervals 0-15 and 16-31
  Gelu() {
    const GeluTable& table = gelu_table();
    for (int d = 0; d < 5; ++d) {
      left[d] = _mm512_loadu_ps(table.c[d]);
      right[d] = _mm512_loadu_ps(table.c[d] + 16);
    }
  }
  __m512 operator()(__m512 x) const {
    const __m512 low = _mm512_set1_ps(static_cast<float>(GeluTable::kLow));
    const __m512 high = _mm512_set1_ps(static_cast<float>(GeluTable::kHigh));
    const __m512 per_unit = _mm512_set1_ps(static_cast<float>(32 / (GeluTable::kHigh - GeluTable::kLow)));
    const __m512 position = _mm512_mul_ps(_mm512_sub_ps(_mm512_min_ps(_mm512_max_ps(x, low), high), low), per_unit);
    const __m512 interval = _mm512_min_ps(_mm512_roundscale_ps(position, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC),
                                          _mm512_set1_ps(31.0f));
    const __m512 t = _mm512_sub_ps(position, interval);
    const __m512i index = _mm512_cvttps_epi32(interval);
    __m512 p = _mm512_permutex2var_ps(left[4], index, right[4]);
    for (int d = 3; d >= 0; --d) p = _mm512_fmadd_ps(p, t, _mm512_permutex2var_ps(left[d], index, right[d]));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, high, _CMP_NLE_UQ), p, x);  // x above 6, and NaN as NaN
  }
};

// Scaled dot-product attention of one sequence's n queries over its first m keys (m <= n), one head of `size`
// (32 or 64) on AMX tiles: `base` points at its first token's query, the keys `width` and the values 2 `width`
// elements after each query, tokens `row` elements apart; the context of query i goes to out + i * width (zero
// where m is 0). A thread keeps one for sequences of up to `longest` tokens (its scratch) and calls it with its
// tiles configured.
class HeadAttention {
 public:
  HeadAttention(int64_t longest, int64_t size, float scale)
      : size_(size),
        padded_((longest + 31) / 32 * 32),
        steps_(static_cast<int>(size / 32)),
        columns_(static_cast<int>(size / 16)),
        factor_(_mm512_set1_ps(scale * 1.44269504088896341f)),  // exp(x) = 2^(x log2 e)
        key_tiles_(padded_ / 16 * steps_ * 256),
        value_tiles_(padded_ / 32 * columns_ * 512),
        scores_(16 * padded_),
        probs_(16 * padded_),
        query_(16 * size),
        context_(16 * size) {}

  void operator()(const uint16_t* base, int64_t row, int64_t width, int64_t n, int64_t m, uint16_t* out) {
    const int64_t size = size_, padded = padded_;
    if (m <= 0) {  // no keys: a zero context
      for (int64_t i = 0; i < n; ++i) std::memset(out + i * width, 0, size * 2);
      return;
    }
    const int steps = steps_, columns = columns_;
    const __m512 factor = factor_;
    const __m512i interleave_low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                                    39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i interleave_high = _mm512_add_epi16(interleave_low, _mm512_set1_epi16(16));
    const auto larger = [](__m512 x, __m512 y) { return _mm512_max_ps(x, y); };
    const auto plus = [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); };
    const int64_t blocks16 = (m + 15) / 16, blocks32 = (m + 31) / 32, pstride = blocks32 * 32;
    // keys, tile (kb, s): row r holds dims 32 s + 2 r and 32 s + 2 r + 1 of keys 16 kb .. 16 kb + 15
    for (int64_t kb = 0; kb < blocks16; ++kb)
      for (int s = 0; s < steps; ++s) {
        __m512i r[16];
        for (int j = 0; j < 16; ++j)
          r[j] = kb * 16 + j < m ? _mm512_loadu_si512(base + (kb * 16 + j) * row + width + s * 32)
                                 : _mm512_setzero_si512();
        transpose16(r);
        for (int j = 0; j < 16; ++j) _mm512_store_si512(key_tiles_.data + (kb * steps + s) * 256 + j * 16, r[j]);
      }
    // values, tile (kb, c): row r holds keys 32 kb + 2 r and 32 kb + 2 r + 1 of dims 16 c .. 16 c + 15
    for (int64_t kb = 0; kb < blocks32; ++kb)
      for (int r = 0; r < 16; ++r) {
        const int64_t k0 = kb * 32 + 2 * r, k1 = k0 + 1;
        for (int s = 0; s < steps; ++s) {
          const uint16_t* values = base + 2 * width + s * 32;
          const __m512i a = k0 < m ? _mm512_loadu_si512(values + k0 * row) : _mm512_setzero_si512();
          const __m512i c = k1 < m ? _mm512_loadu_si512(values + k1 * row) : _mm512_setzero_si512();
          _mm512_store_si512(value_tiles_.data + (kb * columns + 2 * s) * 512 + r * 32,
                             _mm512_permutex2var_epi16(a, interleave_low, c));
          _mm512_store_si512(value_tiles_.data + (kb * columns + 2 * s + 1) * 512 + r * 32,
                             _mm512_permutex2var_epi16(a, interleave_high, c));
        }
      }
    for (int64_t qb = 0; qb * 16 < n; ++qb) {
      const int64_t rows = n - qb * 16 < 16 ? n - qb * 16 : 16;
#if DENSEPASS_TILES
      if (rows == 16) {  // queries straight from qkv, or a partial block copied and padded with zeros
        _tile_loadd(4, base + qb * 16 * row, row * 2);
        if (steps == 2) _tile_loadd(5, base + qb * 16 * row + 32, row * 2);
      } else {
        std::memset(query_.data, 0, 16 * size * 2);
        for (int64_t i = 0; i < rows; ++i) std::memcpy(query_.data + i * size, base + (qb * 16 + i) * row, size * 2);
        _tile_loadd(4, query_.data, size * 2);
        if (steps == 2) _tile_loadd(5, query_.data + 32, size * 2);
      }
      // scores, two key blocks at a time
      for (int64_t kb = 0; kb < blocks16; kb += 2) {
        const uint32_t* k = key_tiles_.data + kb * steps * 256;
        const bool pair = kb + 1 < blocks16;
        _tile_zero(0);
        _tile_loadd(6, k, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (pair) {
          _tile_zero(1);
          _tile_loadd(7, k + steps * 256, 64);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (steps == 2) {
          _tile_loadd(6, k + 256, 64);
          _tile_dpbf16ps(0, 5, 6);
          if (pair) {
            _tile_loadd(7, k + 3 * 256, 64);
            _tile_dpbf16ps(1, 5, 7);
          }
        }
        _tile_stored(0, scores_.data + kb * 16, padded * 4);
        if (pair) _tile_stored(1, scores_.data + kb * 16 + 16, padded * 4);
      }
#else
      // scores, 8 queries x 32 keys at a time: each query's pair of dims broadcast against the keys' tiles (16 keys
      // x a pair of dims a row: vdpbf16ps's layout too); a partial block's missing queries repeat its first one
      // (their scores, never read, stay finite), and a last odd key block is paired with the zeros past it
      for (int64_t i0 = 0; i0 < rows; i0 += 8) {
        const uint16_t* q[8];
        for (int i = 0; i < 8; ++i) q[i] = base + (qb * 16 + (i0 + i < rows ? i0 + i : 0)) * row;
        for (int64_t kb = 0; kb < blocks16; kb += 2) {
          const uint32_t* k = key_tiles_.data + kb * steps * 256;
          __m512 acc[8][2];
#pragma GCC unroll 8
          for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
          for (int64_t d = 0; d < size / 2; ++d) {
            const uint32_t* kd = k + (d / 16) * 256 + (d % 16) * 16;
            const __m512bh k0 = load_pairs(kd), k1 = load_pairs(kd + steps * 256);
#pragma GCC unroll 8
            for (int i = 0; i < 8; ++i) {
              const __m512bh x = pair(q[i] + 2 * d);
              acc[i][0] = _mm512_dpbf16_ps(acc[i][0], x, k0);
              acc[i][1] = _mm512_dpbf16_ps(acc[i][1], x, k1);
            }
          }
#pragma GCC unroll 8
          for (int i = 0; i < 8; ++i) {
            _mm512_store_ps(scores_.data + (i0 + i) * padded + kb * 16, acc[i][0]);
            _mm512_store_ps(scores_.data + (i0 + i) * padded + kb * 16 + 16, acc[i][1]);
          }
        }
      }
#endif
      // softmax rows: per-row maxima and sums come out of one transpose each instead of 16 reductions
      __m512 lanes[16];
      for (int i = 0; i < 16; ++i) {
        const float* s = scores_.data + i * padded;
        __m512 top = _mm512_set1_ps(-3.0e38f);
        for (int64_t kb = 0; kb < blocks16; ++kb)
          top = _mm512_mask_max_ps(top, block_mask(m - kb * 16), top, _mm512_load_ps(s + kb * 16));
        lanes[i] = top;
      }
      alignas(64) float shifts[16];
      _mm512_store_ps(shifts, _mm512_mul_ps(across(lanes, larger), factor));
      for (int i = 0; i < 16; ++i) {
        const float* s = scores_.data + i * padded;
        uint16_t* p = probs_.data + i * pstride;
        const __m512 shift = _mm512_set1_ps(shifts[i]);
        __m512 total = _mm512_setzero_ps();
        for (int64_t kb = 0; kb < blocks16; ++kb) {
          __m512 e = exp2_nonpositive(_mm512_fmsub_ps(_mm512_load_ps(s + kb * 16), factor, shift));
          e = _mm512_maskz_mov_ps(block_mask(m - kb * 16), e);
          total = _mm512_add_ps(total, e);
          store_bf16(p + kb * 16, e);
        }
        if (blocks16 * 16 < pstride) std::memset(p + blocks16 * 16, 0, 32);
        lanes[i] = total;
      }
      alignas(64) float inverses[16];
      _mm512_store_ps(inverses, _mm512_div_ps(_mm512_set1_ps(1.0f), across(lanes, plus)));
#if DENSEPASS_TILES
      // context = probabilities x values
      _tile_zero(0);
      _tile_zero(1);
      if (columns == 4) {
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int64_t kb = 0; kb < blocks32; ++kb) {
        const uint16_t* v = value_tiles_.data + kb * columns * 512;
        _tile_loadd(5, probs_.data + kb * 32, pstride * 2);
        _tile_loadd(6, v, 64);
        _tile_dpbf16ps(0, 5, 6);
        _tile_loadd(7, v + 512, 64);
        _tile_dpbf16ps(1, 5, 7);
        if (columns == 4) {
          _tile_loadd(6, v + 1024, 64);
          _tile_dpbf16ps(2, 5, 6);
          _tile_loadd(7, v + 1536, 64);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, context_.data, size * 4);
      _tile_stored(1, context_.data + 16, size * 4);
      if (columns == 4) {
        _tile_stored(2, context_.data + 32, size * 4);
        _tile_stored(3, context_.data + 48, size * 4);
      }
#else
      // context = probabilities x values, 8 queries x 32 dims at a time: each query's probabilities of a pair of
      // keys broadcast against the values' tiles (16 dims x a pair of keys a row)
      for (int64_t i0 = 0; i0 < rows; i0 += 8)
        for (int c = 0; c < columns; c += 2) {
          __m512 acc[8][2];
#pragma GCC unroll 8
          for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
          for (int64_t kb = 0; kb < blocks32; ++kb) {
            const uint16_t* v = value_tiles_.data + (kb * columns + c) * 512;
            const uint16_t* p = probs_.data + i0 * pstride + kb * 32;
            for (int r = 0; r < 16; ++r) {
              const __m512bh v0 = load_pairs(v + r * 32), v1 = load_pairs(v + 512 + r * 32);
#pragma GCC unroll 8
              for (int i = 0; i < 8; ++i) {
                const __m512bh x = pair(p + i * pstride + 2 * r);
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], x, v0);
                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], x, v1);
              }
            }
          }
#pragma GCC unroll 8
          for (int i = 0; i < 8; ++i) {
            _mm512_store_ps(context_.data + (i0 + i) * size + c * 16, acc[i][0]);
            _mm512_store_ps(context_.data + (i0 + i) * size + c * 16 + 16, acc[i][1]);
          }
        }
#endif
      for (int64_t i = 0; i < rows; ++i) {
        const __m512 inverse = _mm512_set1_ps(inverses[i]);
        uint16_t* dst = out + (qb * 16 + i) * width;
        for (int c = 0; c < columns; ++c) {
          store_bf16(dst + c * 16, _mm512_mul_ps(_mm512_load_ps(context_.data + i * size + c * 16), inverse));
        }
      }
    }
  }

 private:
  int64_t size_, padded_;
  int steps_, columns_;
  __m512 factor_;
  Scratch<uint32_t> key_tiles_;    // key tiles, dims in pairs: 16 rows x 16 keys
  Scratch<uint16_t> value_tiles_;  // value tiles, keys in pairs: 16 rows x 16 dims
  Scratch<float> scores_;
  Scratch<uint16_t> probs_;
  Scratch<uint16_t> query_;
  Scratch<float> context_;
};

// `valid` rows of `width` at a, read by the products 32 at a time: a itself where its whole parts of 32 rows lie
// within the `readable` rows there, else its rows copied into `padded` (room for the whole parts), the rest zero.
inline const uint16_t* in_whole_parts(const uint16_t* a, int64_t valid, int64_t readable, int64_t width,
                                      uint16_t* padded) {
  const int64_t rows = (valid + 31) / 32 * 32;
  if (rows <= readable) return a;
  std::memcpy(padded, a, valid * width * 2);
  std::memset(padded + valid * width, 0, (rows - valid) * width * 2);
  return padded;
}

// The longest of `sequences` sequences packed by `offsets`.
inline int64_t longest_of(const int64_t* offsets, int64_t sequences) {
  int64_t longest = 0;
  for (int64_t b = 0; b < sequences; ++b)
    if (offsets[b + 1] - offsets[b] > longest) longest = offsets[b + 1] - offsets[b];
  return longest;
}

}  // namespace

// A BERT layer's weights after its attention, bf16, for densepass_after_attention (cpu_kernels._LayerWeights):
// the products' weights in `tile_layout`, [width, width], [inner, width] and [width, inner].
// Dropout's draws (densepass/models/dropout.py): element e of a call seeded by s is kept where the 16-bit part
// e % 4 of word e / 4 is below a threshold, word w being SplitMix64's output for the counter w + 1 under s
// (s + (w + 1) golden, then SplitMix64's finaliser). Any element's draw is computed from its index alone, so a
// backward pass draws its forward pass's mask again instead of keeping it, and every thread draws its own part.
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

inline __m512i splitmix8(uint64_t seed, int64_t word) {  // the draws of words word .. word + 7
  const __m512i counters = _mm512_add_epi64(_mm512_set1_epi64(static_cast<long long>(word + 1)),
                                            _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0));
  __m512i z = _mm512_add_epi64(_mm512_mullo_epi64(counters, _mm512_set1_epi64(static_cast<long long>(kGolden))),
                               _mm512_set1_epi64(static_cast<long long>(seed)));
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)),
                         _mm512_set1_epi64(static_cast<long long>(0xBF58476D1CE4E5B9ull)));
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)),
                         _mm512_set1_epi64(static_cast<long long>(0x94D049BB133111EBull)));
  return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}

// draws[0 .. count) = the 16-bit draws of elements first .. first + count - 1 (draws: count + 32 writable).
inline void draws_of(uint64_t seed, int64_t first, int64_t count, uint16_t* draws) {
  const int64_t word = first / 4, skip = first % 4;
  alignas(64) uint16_t block[32];
  int64_t done = 0;
  for (int64_t w = word; done < count; w += 8) {
    _mm512_store_si512(block, splitmix8(seed, w));
    const int64_t from = w == word ? skip : 0, take = 32 - from;
    std::memcpy(draws + done, block + from, static_cast<size_t>(take) * 2);
    done += take;
  }
}

// Which of 16 elements are kept: lane i where draws[i] < threshold (all of them from a threshold of 2^16).
inline __mmask16 kept16(const uint16_t* draws, uint32_t threshold) {
  if (threshold >= 65536u) return 0xffff;
  return _mm256_cmplt_epu16_mask(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(draws)),
                                 _mm256_set1_epi16(static_cast<short>(threshold)));
}

constexpr int64_t kDropoutChunk = 4096;  // elements a thread takes at a time

struct LayerWeights {
  const uint16_t *out, *out_bias, *norm1_weight, *norm1_bias;
  const uint16_t *inner, *inner_bias, *ffn, *ffn_bias, *norm2_weight, *norm2_bias;
  float eps1, eps2;
  int64_t width, inner_width;
};

namespace {

// A block's lanes of bf16 (uint16_t) or float32 values, widened to float32; and stored back, rounded to bf16.
inline __m512 load_lanes(const uint16_t* p, __mmask16 lanes) { return load_bf16(p, lanes); }
inline __m512 load_lanes(const float* p, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, p); }
inline void store_lanes(uint16_t* p, __m512 v, __mmask16 lanes) { store_bf16(p, v, lanes); }
inline void store_lanes(float* p, __m512 v, __mmask16 lanes) { _mm512_mask_storeu_ps(p, lanes, v); }
// exp2 as softmax of T takes it: to bf16's precision for bf16 scores, to float32's for float32 ones.
inline __m512 exp2_lanes(const uint16_t*, __m512 t) { return exp2_nonpositive(t); }
inline __m512 exp2_lanes(const float*, __m512 t) { return exp2_nonpositive_exact(t); }

// densepass_softmax_dropout over scores, probs and out of type T (bf16 as uint16_t, or float).
template <typename T>
void softmax_dropout(const T* scores, const uint8_t* mask, int64_t mb, int64_t mh, int64_t mq, int64_t batch,
                     int64_t heads, int64_t queries, int64_t keys, float scale, uint64_t seed, uint32_t threshold,
                     float keep_scale, T* probs, T* out, int threads) {
  const int64_t rows = batch * heads * queries;
  const float log2e = 1.4426950408889634f;
#pragma omp parallel num_threads(threads)
  {
    static thread_local Workspace workspace;  // a row's values and draws, kept from call to call
    float* e = workspace.floats(0, keys + 16);
    uint16_t* draws = workspace.halves(1, keys + 48);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t b = r / (heads * queries), h = (r / queries) % heads, i = r % queries;
      const T* row = scores + r * keys;
      const uint8_t* m = mask == nullptr ? nullptr : mask + b * mb + h * mh + i * mq;
      __m512 most = _mm512_set1_ps(-INFINITY);
      bool any = false;
      for (int64_t j = 0; j < keys; j += 16) {
        __mmask16 valid = block_mask(keys - j);
        if (m != nullptr) valid &= _mm_test_epi8_mask(_mm_maskz_loadu_epi8(valid, m + j), _mm_set1_epi8(-1));
        any |= valid != 0;
        const __m512 v = load_lanes(row + j, valid);
        most = _mm512_mask_max_ps(most, valid, most, v);
        _mm512_storeu_ps(e + j, _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), v));
      }
      draws_of(seed, r * keys, keys, draws);
      T* p_row = probs + r * keys;
      T* o_row = out + r * keys;
      if (!any) {  // uniform out, zero kept
        const __m512 u = _mm512_set1_ps(keep_scale / static_cast<float>(keys));
        for (int64_t j = 0; j < keys; j += 16) {
          const __mmask16 valid = block_mask(keys - j), keep = kept16(draws + j, threshold) & valid;
          store_lanes(p_row + j, _mm512_setzero_ps(), valid);
          store_lanes(o_row + j, _mm512_maskz_mov_ps(keep, u), valid);
        }
        continue;
      }
      const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(most));
      const __m512 factor = _mm512_set1_ps(scale * log2e);
      __m512 total = _mm512_setzero_ps();
      for (int64_t j = 0; j < keys; j += 16) {  // exp(scale (s - max)); -inf (masked) gives 0
        const __mmask16 valid = block_mask(keys - j);
        const __m512 v = _mm512_maskz_loadu_ps(valid, e + j);
        const __mmask16 live = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ) & valid;
        const __m512 x = _mm512_maskz_mov_ps(live, exp2_lanes(scores, _mm512_mul_ps(_mm512_sub_ps(v, shift), factor)));
        total = _mm512_add_ps(total, x);
        _mm512_storeu_ps(e + j, x);
      }
      const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
      const __m512 kept_scale = _mm512_set1_ps(keep_scale);
      for (int64_t j = 0; j < keys; j += 16) {
        const __mmask16 valid = block_mask(keys - j), keep = kept16(draws + j, threshold) & valid;
        const __m512 p = _mm512_mul_ps(_mm512_loadu_ps(e + j), inverse);
        store_lanes(p_row + j, p, valid);
        store_lanes(o_row + j, _mm512_maskz_mul_ps(keep, p, kept_scale), valid);
      }
    }
  }
}

// densepass_softmax_dropout_backward over grad, probs and grad_scores of type T.
template <typename T>
void softmax_dropout_backward(const T* grad, const T* probs, int64_t rows, int64_t keys, float scale, uint64_t seed,
                              uint32_t threshold, float keep_scale, T* grad_scores, int threads) {
#pragma omp parallel num_threads(threads)
  {
    static thread_local Workspace workspace;  // a row's values and draws, kept from call to call
    float* d = workspace.floats(0, keys + 16);
    uint16_t* draws = workspace.halves(1, keys + 48);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* g_row = grad + r * keys;
      const T* p_row = probs + r * keys;
      draws_of(seed, r * keys, keys, draws);
      __m512 dot = _mm512_setzero_ps();
      const __m512 kept_scale = _mm512_set1_ps(keep_scale);
      for (int64_t j = 0; j < keys; j += 16) {
        const __mmask16 valid = block_mask(keys - j), keep = kept16(draws + j, threshold) & valid;
        const __m512 g = load_lanes(g_row + j, keep), p = load_lanes(p_row + j, valid);
        const __m512 dp = _mm512_mul_ps(g, kept_scale);
        dot = _mm512_fmadd_ps(dp, p, dot);
        _mm512_storeu_ps(d + j, dp);
      }
      const __m512 c = _mm512_set1_ps(_mm512_reduce_add_ps(dot)), s = _mm512_set1_ps(scale);
      for (int64_t j = 0; j < keys; j += 16) {
        const __mmask16 valid = block_mask(keys - j);
        const __m512 p = load_lanes(p_row + j, valid);
        const __m512 ds = _mm512_mul_ps(_mm512_mul_ps(p, _mm512_sub_ps(_mm512_loadu_ps(d + j), c)), s);
        store_lanes(grad_scores + r * keys + j, ds, valid);
      }
    }
  }
}

}  // namespace

extern "C" {

// Which build this is: 1 on AMX tiles, 2 on AVX512-BF16 registers (cpu_kernels.py checks it is the one it built).
int densepass_kind() { return DENSEPASS_TILES ? 1 : 2; }

// Asks Linux (5.16 and later) for the AMX tile state; 0 when granted (and where the build uses no tiles).
int densepass_request_amx() {
  if (!DENSEPASS_TILES) return 0;
  return static_cast<int>(syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */));
}

// qkv: [tokens, 3, heads, size] bf16, the tokens of `sequences` sequences one after the other, sequence b from
// offsets[b] to offsets[b + 1], its first keys[b] tokens its keys; out: [tokens, heads, size] bf16, per sequence
// and head softmax(q k^T scale) v over its keys (zero where it has none). size: 32 or 64; `threads` OpenMP
// threads (torch's). Returns 0, or -1 for a size it does not take.
int densepass_attention(const uint16_t* qkv, const int64_t* offsets, const int64_t* keys, uint16_t* out,
                        int64_t sequences, int64_t heads, int64_t size, float scale, int threads) {
  if (size != 32 && size != 64) return -1;
  const int64_t row = 3 * heads * size;  // elements from one token of qkv to the next
  const int64_t width = heads * size;
  const int64_t longest = longest_of(offsets, sequences);
#pragma omp parallel num_threads(threads)
  {
    configure_tiles();
    HeadAttention attend(longest, size, scale);
#pragma omp for schedule(dynamic, 4)
    for (int64_t item = 0; item < sequences * heads; ++item) {
      const int64_t b = item / heads, h = item % heads;
      const int64_t n = offsets[b + 1] - offsets[b];  // queries
      const int64_t m = keys[b] < n ? keys[b] : n;     // keys: the first m of them
      attend(qkv + offsets[b] * row + h * size, row, width, n, m, out + offsets[b] * width + h * size);
    }
    release_tiles();
  }
  return 0;
}

// The query, key and value product of a BERT layer and its attention as one kernel: x [tokens, width] bf16, the
// tokens of `sequences` sequences packed as densepass_attention takes them; weight: [3 width, width] (the query's,
// key's and value's rows in turn) in `tile_layout`, bias [3 width], both bf16; out [tokens, width] bf16, what
// densepass_attention computes from qkv = x weight^T + bias. A thread takes whole sequences of up to kGroupRows
// tokens at a time (a longer sequence alone), computes their qkv on AMX tiles into a buffer of its own (rounded to
// bf16 as a product's output is) and their attention from there, while it is in its cache. size: 32 or 64.
// Returns 0, or -1 for a size it does not take.
int densepass_qkv_attention(const uint16_t* x, const int64_t* offsets, const int64_t* keys, int64_t sequences,
                            const uint16_t* weight, const uint16_t* bias, int64_t heads, int64_t size, float scale,
                            uint16_t* out, int threads) {
  if (size != 32 && size != 64) return -1;
  const int64_t width = heads * size, row = 3 * width, tokens = offsets[sequences];
  const int64_t longest = longest_of(offsets, sequences);
  const int64_t most = ((longest > kGroupRows ? longest : kGroupRows) + 31) / 32 * 32;  // rows of a group
  std::vector<int64_t> groups{0};  // each group's first sequence, then the end
  for (int64_t b = 1; b < sequences; ++b)
    if (offsets[b + 1] - offsets[groups.back()] > kGroupRows) groups.push_back(b);
  groups.push_back(sequences);
  const int64_t count = static_cast<int64_t>(groups.size()) - 1;
#pragma omp parallel num_threads(threads)
  {
    configure_tiles();
    HeadAttention attend(longest, size, scale);
    static thread_local Workspace workspace;  // kept from call to call
    uint16_t* qkv = workspace.halves(0, most * row);
    uint16_t* padded = workspace.halves(1, most * width);  // a group at the end whose last 32 rows run past it
#pragma omp for schedule(dynamic, 1)
    for (int64_t g = 0; g < count; ++g) {
      const int64_t first = groups[g], last = groups[g + 1], r0 = offsets[first], valid = offsets[last] - r0;
      const int64_t parts = (valid + 31) / 32;
      const uint16_t* a = in_whole_parts(x + r0 * width, valid, tokens - r0, width, padded);
      product(a, width, parts, width, weight, row, false, [](int64_t) {},
              [&](int64_t i0, int64_t j0, const float* c, int64_t from, int64_t until) {
                const __m512 b0 = load_bf16(bias + j0), b1 = load_bf16(bias + j0 + 16);
                for (int64_t i = i0 + from; i < i0 + until && i < valid; ++i) {
                  const float* block = c + (i - i0) * 32;
                  store_bf16(qkv + i * row + j0, _mm512_add_ps(_mm512_load_ps(block), b0));
                  store_bf16(qkv + i * row + j0 + 16, _mm512_add_ps(_mm512_load_ps(block + 16), b1));
                }
              },
              [] {});
      for (int64_t b = first; b < last; ++b) {
        const int64_t n = offsets[b + 1] - offsets[b], m = keys[b] < n ? keys[b] : n;
        for (int64_t h = 0; h < heads; ++h)
          attend(qkv + (offsets[b] - r0) * row + h * size, row, width, n, m, out + offsets[b] * width + h * size);
      }
    }
    release_tiles();
  }
  return 0;
}

// x: [rows, width] bf16, replaced per row by LayerNorm(x + residual) (residual: [rows, width] bf16, or null for
// LayerNorm(x)), as `normalize` computes it, on `threads` OpenMP threads. width: a multiple of 16, at most 2,048.
// Returns 0, or -1.
int densepass_layer_norm(uint16_t* x, const uint16_t* residual, const uint16_t* weight, const uint16_t* bias,
                         int64_t rows, int64_t width, float eps, int threads) {
  if (width % 16 != 0 || width <= 0 || width > kMaxWidth) return -1;
#pragma omp parallel num_threads(threads)
  {
    alignas(64) float row[kMaxWidth];
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t k = 0; k < width; k += 16) {
        __m512 v = load_bf16(x + i * width + k);
        if (residual != nullptr) v = _mm512_add_ps(v, load_bf16(residual + i * width + k));
        _mm512_store_ps(row + k, v);
      }
      normalize(row, width / 16, weight, bias, eps, x + i * width);
    }
  }
  return 0;
}

// A BERT layer's input from token ids: out[t] = LayerNorm(word[ids[t]] + position[positions[t]] + type[types[t]])
// for t < tokens (tables [*, width] bf16, out [tokens, width] bf16), the sum in float32, as `normalize` computes
// it, on `threads` OpenMP threads. width: a multiple of 16, at most 2,048 (the indices are the caller's to check).
// Returns 0, or -1.
int densepass_embed(const int64_t* ids, const int64_t* positions, const int64_t* types, int64_t tokens,
                    const uint16_t* word, const uint16_t* position, const uint16_t* type, const uint16_t* weight,
                    const uint16_t* bias, float eps, int64_t width, uint16_t* out, int threads) {
  if (width % 16 != 0 || width <= 0 || width > kMaxWidth) return -1;
#pragma omp parallel num_threads(threads)
  {
    alignas(64) float row[kMaxWidth];
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const uint16_t *w = word + ids[t] * width, *p = position + positions[t] * width, *y = type + types[t] * width;
      for (int64_t k = 0; k < width; k += 16)
        _mm512_store_ps(row + k, _mm512_add_ps(_mm512_add_ps(load_bf16(w + k), load_bf16(y + k)), load_bf16(p + k)));
      normalize(row, width / 16, weight, bias, eps, out + t * width);
    }
  }
  return 0;
}

// What follows the attention in a BERT layer, over `rows` tokens (rows of `context` and `x`, [rows, width] bf16),
// into `out` ([rows, width] bf16):
//     h   = LayerNorm(x + context Wo^T + bo)
//     out = LayerNorm(h + GELU(h Wi^T + bi) Wf^T + bf)
// a thread taking kBlockRows rows at a time through all of it, h and GELU's output held in its caches, the
// products on AMX tiles (weights in `tile_layout`), the biases, residuals, GELU and layer norms applied to each
// product's float32 result as it comes off the tiles. Returns 0, or -1 for a width or inner width it does not take
// (multiples of 32, width at most 2,048).
int densepass_after_attention(const uint16_t* context, const uint16_t* x, int64_t rows, const LayerWeights* layer,
                              uint16_t* out, int threads) {
  const int64_t width = layer->width, inner = layer->inner_width;
  if (width % 32 != 0 || width <= 0 || width > kMaxWidth || inner % 32 != 0 || inner <= 0) return -1;
#pragma omp parallel num_threads(threads)
  {
    configure_tiles();
    // the thread's buffers, kept from call to call (no pages mapped anew for each layer)
    static thread_local Workspace workspace;
    // the output product and the feed-forward's, their biases and residuals added, before their norms
    float* sums = workspace.floats(0, kBlockRows * width);
    float* ffn_sums = workspace.floats(1, kBlockRows * width);
    uint16_t* padded = workspace.halves(2, kBlockRows * width);  // a last block's context rows, fewer than kBlockRows
    uint16_t* h = workspace.halves(3, kBlockRows * width);
    uint16_t* f = workspace.halves(4, kBlockRows * inner);
    // the output norm of a block is computed while the next block's output product runs (its sums kept apart)
    RowNorms output_norm{ffn_sums, nullptr, layer->norm2_weight, layer->norm2_bias, layer->eps2, width};
    bool alternate = false;
#pragma omp for schedule(dynamic, 1)
    for (int64_t r0 = 0; r0 < rows; r0 += kBlockRows) {
      const int64_t valid = rows - r0 < kBlockRows ? rows - r0 : kBlockRows, parts = (valid + 31) / 32;
      const uint16_t* a = in_whole_parts(context + r0 * width, valid, rows - r0, width, padded);
      const auto add = [&](const uint16_t* bias, const uint16_t* residual, RowNorms* norm) {
        // the norm's sums = c + bias + residual; the rows whose last columns these are become ready
        return [=, &valid](int64_t i0, int64_t j0, const float* c, int64_t from, int64_t until) {
          const __m512 b0 = load_bf16(bias + j0), b1 = load_bf16(bias + j0 + 16);
          for (int64_t i = i0 + from; i < i0 + until && i < valid; ++i) {
            const uint16_t* r = residual + i * width + j0;
            const float* block = c + (i - i0) * 32;
            norm->add(i, j0, _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(block), b0), load_bf16(r)),
                      _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(block + 16), b1), load_bf16(r + 16)));
          }
          if (j0 + 32 == width) norm->ready = i0 + until < valid ? i0 + until : valid;
        };
      };
      const auto nothing = [](int64_t) {};
      // h = LayerNorm(x + context Wo^T + bo): 32 rows finished at a time, normalised while the next go through
      // the tiles, alongside the last block's output norm (a row every other step)
      RowNorms attention_norm{sums, h, layer->norm1_weight, layer->norm1_bias, layer->eps1, width};
      product(a, width, parts, width, layer->out, width, true, nothing,
              add(layer->out_bias, x + r0 * width, &attention_norm), [&] {
                alternate = !alternate;
                if (alternate && !attention_norm.one()) output_norm.one();
              });
      output_norm.until(kBlockRows);  // ffn_sums is free again
      // f = GELU(h Wi^T + bi), the attention norm's last rows finished before the first block that reads them
      product(h, width, parts, width, layer->inner, inner, false,
              [&](int64_t part) { attention_norm.until((part + 1) * 32); },
              [&](int64_t i0, int64_t j0, const float* c, int64_t from, int64_t until) {
                const __m512 b0 = load_bf16(layer->inner_bias + j0), b1 = load_bf16(layer->inner_bias + j0 + 16);
                const Gelu gelu;
                for (int64_t i = from; i < until; ++i) {
                  uint16_t* dst = f + (i0 + i) * inner + j0;
                  store_bf16(dst, gelu(_mm512_add_ps(_mm512_load_ps(c + i * 32), b0)));
                  store_bf16(dst + 16, gelu(_mm512_add_ps(_mm512_load_ps(c + i * 32 + 16), b1)));
                }
              },
              [&] { attention_norm.one(); });
      // ffn_sums = f Wf^T + bf + h, normalised into out during the next block (or after the last)
      output_norm.out = out + r0 * width;
      output_norm.next = 0;
      product(f, inner, parts, inner, layer->ffn, width, false, nothing,
              add(layer->ffn_bias, h, &output_norm), [] {});
    }
    output_norm.until(kBlockRows);
    release_tiles();
  }
  return 0;
}

// out = x W^T + bias through int8 products (the helpers above), then GELU where `gelu` is nonzero: x [rows,
// depth] bf16, W in `vnni_layout` int8 with w_scale and w_sum (its columns' sums, as float32) per output column,
// bias [width] bf16 (or null), out [rows, width] bf16; depth a multiple of 16, width of 32. Each thread quantises
// and multiplies 32 rows at a time through all the columns (the weights stay in its caches). Returns 0, or -1 for
// shapes it does not take. In the AMX build, where `depth` is a multiple of 64, the products run on AMX tiles
// (tdpbusd: the same unsigned x signed bytes, 64 along the depth a step; a 64-deep slice of a `vnni_layout` panel
// is 16 of its 64-byte rows, a tile's right operand as it is), each 32 x 32 block's epilogue (rescaling, bias,
// GELU, bf16) computed a few rows at a time in between the next block's tile instructions, as `product` does;
// elsewhere on vpdpbusd. The sums are exact integers either way, so both write the same output.
int densepass_int8_linear(const uint16_t* x, int64_t rows, int64_t depth, const int8_t* w, const float* w_scale,
                          const float* w_sum, const uint16_t* bias, int64_t width, int gelu, uint16_t* out,
                          int threads) {
  if (depth % 16 != 0 || depth <= 0 || width % 32 != 0 || width <= 0) return -1;
  const Gelu activation;
#pragma omp parallel num_threads(threads)
  {
    std::vector<uint8_t> q_buffer(32 * depth + 64);
    uint8_t* q = q_buffer.data();
    alignas(64) float scale[32], low[32];
    alignas(64) int32_t acc[32 * 32];
    const bool tiles = DENSEPASS_TILES && depth % 64 == 0;
    if (tiles) configure_tiles();
#pragma omp for schedule(dynamic, 1)
    for (int64_t r0 = 0; r0 < rows; r0 += 32) {
      const int64_t valid = rows - r0 < 32 ? rows - r0 : 32, whole = tiles ? 32 : (valid + 7) / 8 * 8;
      quantize_rows(x + r0 * depth, valid, depth, q, scale, low);
      std::memset(q + valid * depth, 0, (whole - valid) * depth);  // rows beyond the last: computed, not stored
      // rows [from, to) of the block of columns j .. j + 31 in acc, rescaled, biased (and GELU) into out
      const auto epilogue = [&](int64_t j, int64_t from, int64_t to) {
        const __m512 sum0 = _mm512_loadu_ps(w_sum + j), sum1 = _mm512_loadu_ps(w_sum + j + 16);
        const __m512 ws0 = _mm512_loadu_ps(w_scale + j), ws1 = _mm512_loadu_ps(w_scale + j + 16);
        const __m512 b0 = bias ? load_bf16(bias + j) : _mm512_setzero_ps();
        const __m512 b1 = bias ? load_bf16(bias + j + 16) : _mm512_setzero_ps();
        for (int64_t i = from; i < (to < valid ? to : valid); ++i) {
          const __m512 s = _mm512_set1_ps(scale[i]), lo = _mm512_set1_ps(low[i]);
          const __m512 v0 = _mm512_cvtepi32_ps(_mm512_load_si512(acc + i * 32));
          const __m512 v1 = _mm512_cvtepi32_ps(_mm512_load_si512(acc + i * 32 + 16));
          __m512 y0 = _mm512_fmadd_ps(_mm512_fmadd_ps(v0, s, _mm512_mul_ps(lo, sum0)), ws0, b0);
          __m512 y1 = _mm512_fmadd_ps(_mm512_fmadd_ps(v1, s, _mm512_mul_ps(lo, sum1)), ws1, b1);
          if (gelu) {
            y0 = activation(y0);
            y1 = activation(y1);
          }
          uint16_t* dst = out + (r0 + i) * width + j;
          store_bf16(dst, y0);
          store_bf16(dst + 16, y1);
        }
      };
#if DENSEPASS_TILES
      if (tiles) {
        const int64_t steps = depth / 64, slice = (32 + steps - 1) / steps;  // epilogue rows a step
        int64_t pending = -1;  // the columns whose block acc holds, its epilogue not yet done (-1: none)
        for (int64_t j = 0; j < width; j += 32) {
          const int8_t* w0 = w + j * depth;
          const int8_t* w1 = w0 + 16 * depth;
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t k = 0; k < steps; ++k) {
            _tile_loadd(4, q + 64 * k, depth);
            _tile_loadd(6, w0 + 1024 * k, 64);
            _tile_dpbusd(0, 4, 6);
            _tile_loadd(7, w1 + 1024 * k, 64);
            _tile_dpbusd(1, 4, 7);
            _tile_loadd(5, q + 16 * depth + 64 * k, depth);
            _tile_dpbusd(2, 5, 6);
            _tile_dpbusd(3, 5, 7);
            if (pending >= 0) epilogue(pending, k * slice, (k + 1) * slice);
          }
          if (pending >= 0) epilogue(pending, steps * slice, 32);  // acc is free
          _tile_stored(0, acc, 128);
          _tile_stored(1, acc + 16, 128);
          _tile_stored(2, acc + 512, 128);
          _tile_stored(3, acc + 528, 128);
          pending = j;
        }
        epilogue(pending, 0, 32);
        continue;
      }
#endif
      for (int64_t j = 0; j < width; j += 32) {
        for (int64_t r = 0; r < whole; r += 8)
          rows8x32_int8(q + r * depth, depth, depth, w + j * depth, w + (j + 16) * depth, acc + r * 32);
        epilogue(j, 0, 32);
      }
    }
    if (tiles) release_tiles();
  }
  return 0;
}

// out[e] = x[e] x scale where element e is kept (dropout's draws under `seed`, threshold: see above), else 0, for
// e < n; x and out float32 (bf16: 0) or bf16 (1), the product in float32 rounded to bf16 (as torch rounds it).
// Forward and backward pass alike: the backward pass calls it on the gradient with the same seed. Returns 0.
int densepass_dropout(const void* x, void* out, int64_t n, int bf16, uint64_t seed, uint32_t threshold, float scale,
                      int threads) {
  const int64_t chunks = (n + kDropoutChunk - 1) / kDropoutChunk;
  const __m512 s = _mm512_set1_ps(scale);
#pragma omp parallel num_threads(threads)
  {
    alignas(64) uint16_t draws[kDropoutChunk + 32];
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t first = c * kDropoutChunk, count = n - first < kDropoutChunk ? n - first : kDropoutChunk;
      draws_of(seed, first, count, draws);
      for (int64_t i = 0; i < count; i += 16) {
        const __mmask16 valid = block_mask(count - i), keep = kept16(draws + i, threshold) & valid;
        const int64_t e = first + i;
        if (bf16) {
          const __m512 v = load_bf16(static_cast<const uint16_t*>(x) + e, valid);
          store_bf16(static_cast<uint16_t*>(out) + e, _mm512_maskz_mul_ps(keep, v, s), valid);
        } else {
          const __m512 v = _mm512_maskz_loadu_ps(valid, static_cast<const float*>(x) + e);
          _mm512_mask_storeu_ps(static_cast<float*>(out) + e, valid, _mm512_maskz_mul_ps(keep, v, s));
        }
      }
    }
  }
  return 0;
}

// Attention probabilities with dropout, a row of `keys` scores at a time (rows = batch x heads x queries, row r
// at scores + r keys): P = softmax(scale x scores) over the keys `mask` keeps, computed in float32 and kept
// (probs) for the backward pass, and out = P x keep_scale where dropout's draws keep an element (element r keys + j
// of the call, as densepass_dropout numbers them), else 0; scores, probs and out bf16 (bf16: 1, rounded to nearest
// even) or float32 (0). mask: bytes (nonzero: a key that is attended to), key j of row r = b heads queries +
// h queries + i at mask[b mb + h mh + i mq + j], or null for every key. A row without keys gets uniform
// probabilities out and zeros in probs (so that its gradient is zero, as masked_fill's is). Returns 0.
int densepass_softmax_dropout(const void* scores, const uint8_t* mask, int64_t mb, int64_t mh, int64_t mq,
                              int64_t batch, int64_t heads, int64_t queries, int64_t keys, float scale,
                              uint64_t seed, uint32_t threshold, float keep_scale, void* probs, void* out, int bf16,
                              int threads) {
  if (bf16)
    softmax_dropout(static_cast<const uint16_t*>(scores), mask, mb, mh, mq, batch, heads, queries, keys, scale, seed,
                    threshold, keep_scale, static_cast<uint16_t*>(probs), static_cast<uint16_t*>(out), threads);
  else
    softmax_dropout(static_cast<const float*>(scores), mask, mb, mh, mq, batch, heads, queries, keys, scale, seed,
                    threshold, keep_scale, static_cast<float*>(probs), static_cast<float*>(out), threads);
  return 0;
}

// densepass_softmax_dropout's backward pass over `rows` rows of `keys`: grad (the gradient of its out) ->
// grad_scores, both of probs' type (bf16: 1, or float32): dP = grad x keep_scale where the same draws kept an
// element, else 0, and grad_scores = scale x P (dP - sum_j dP_j P_j), in float32 (rounded to bf16). Returns 0.
int densepass_softmax_dropout_backward(const void* grad, const void* probs, int64_t rows, int64_t keys, float scale,
                                       uint64_t seed, uint32_t threshold, float keep_scale, void* grad_scores,
                                       int bf16, int threads) {
  if (bf16)
    softmax_dropout_backward(static_cast<const uint16_t*>(grad), static_cast<const uint16_t*>(probs), rows, keys,
                             scale, seed, threshold, keep_scale, static_cast<uint16_t*>(grad_scores), threads);
  else
    softmax_dropout_backward(static_cast<const float*>(grad), static_cast<const float*>(probs), rows, keys, scale,
                             seed, threshold, keep_scale, static_cast<float*>(grad_scores), threads);
  return 0;
}

// The dropout draws of elements first .. first + count - 1 under `seed` (for tests: the NumPy draws must equal them).
void densepass_dropout_draws(uint64_t seed, int64_t first, int64_t count, uint16_t* out) {
  std::vector<uint16_t> draws(static_cast<size_t>(count + 32));
  draws_of(seed, first, count, draws.data());
  std::memcpy(out, draws.data(), static_cast<size_t>(count) * 2);
}

// out[i] = GELU(x[i]) for i < n (a multiple of 16), as densepass_after_attention computes it (for tests).
void densepass_gelu(const float* x, float* out, int64_t n) {
  const Gelu gelu;
  for (int64_t i = 0; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, gelu(_mm512_loadu_ps(x + i)));
}

}  // extern "C"
