// bf16 kernels of the fused BERT layers on x86 CPUs with AMX: self-attention over sequences packed without padding
// on AMX tiles, and layer norm in place (densepass/models/cpu_kernels.py says what they compute and why;
// tests/test_cpu_kernels.py checks them against torch).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace {

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

inline uint16_t block_mask(int64_t remaining) {
  return remaining >= 16 ? 0xffff : static_cast<uint16_t>((1u << remaining) - 1);
}

}  // namespace

extern "C" {

// Asks Linux (5.16 and later) for the AMX tile state; 0 when granted.
int densepass_request_amx() {
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
  int64_t longest = 0;
  for (int64_t b = 0; b < sequences; ++b)
    if (offsets[b + 1] - offsets[b] > longest) longest = offsets[b + 1] - offsets[b];
  const int64_t padded = (longest + 31) / 32 * 32;
  const int steps = static_cast<int>(size / 32);    // 32-deep slices of a head (one tile's depth)
  const int columns = static_cast<int>(size / 16);  // 16-wide slices (one accumulator's width)
  const __m512 factor = _mm512_set1_ps(scale * 1.44269504088896341f);  // exp(x) = 2^(x log2 e)
  const __m512i interleave_low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                                  39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i interleave_high = _mm512_add_epi16(interleave_low, _mm512_set1_epi16(16));
  const auto larger = [](__m512 x, __m512 y) { return _mm512_max_ps(x, y); };
  const auto plus = [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); };

#pragma omp parallel num_threads(threads)
  {
    configure_tiles();
    Scratch<uint32_t> key_tiles(padded / 16 * steps * 256);   // key tiles, dims in pairs: 16 rows x 16 keys
    Scratch<uint16_t> value_tiles(padded / 32 * columns * 512);  // value tiles, keys in pairs: 16 rows x 16 dims
    Scratch<float> scores(16 * padded);
    Scratch<uint16_t> probs(16 * padded);
    Scratch<uint16_t> query(16 * size);
    Scratch<float> context(16 * size);

#pragma omp for schedule(dynamic, 4)
    for (int64_t item = 0; item < sequences * heads; ++item) {
      const int64_t b = item / heads, h = item % heads;
      const int64_t n = offsets[b + 1] - offsets[b];              // queries
      const int64_t m = keys[b] < n ? keys[b] : n;                 // keys: the first m of them
      if (n <= 0) continue;
      if (m <= 0) {
        for (int64_t i = 0; i < n; ++i) std::memset(out + (offsets[b] + i) * width + h * size, 0, size * 2);
        continue;
      }
      const int64_t blocks16 = (m + 15) / 16, blocks32 = (m + 31) / 32, pstride = blocks32 * 32;
      const uint16_t* base = qkv + offsets[b] * row + h * size;
      // keys, tile (kb, s): row r holds dims 32 s + 2 r and 32 s + 2 r + 1 of keys 16 kb .. 16 kb + 15
      for (int64_t kb = 0; kb < blocks16; ++kb)
        for (int s = 0; s < steps; ++s) {
          __m512i r[16];
          for (int j = 0; j < 16; ++j)
            r[j] = kb * 16 + j < m ? _mm512_loadu_si512(base + (kb * 16 + j) * row + width + s * 32)
                                   : _mm512_setzero_si512();
          transpose16(r);
          for (int j = 0; j < 16; ++j) _mm512_store_si512(key_tiles.data + (kb * steps + s) * 256 + j * 16, r[j]);
        }
      // values, tile (kb, c): row r holds keys 32 kb + 2 r and 32 kb + 2 r + 1 of dims 16 c .. 16 c + 15
      for (int64_t kb = 0; kb < blocks32; ++kb)
        for (int r = 0; r < 16; ++r) {
          const int64_t k0 = kb * 32 + 2 * r, k1 = k0 + 1;
          for (int s = 0; s < steps; ++s) {
            const uint16_t* values = base + 2 * width + s * 32;
            const __m512i a = k0 < m ? _mm512_loadu_si512(values + k0 * row) : _mm512_setzero_si512();
            const __m512i c = k1 < m ? _mm512_loadu_si512(values + k1 * row) : _mm512_setzero_si512();
            _mm512_store_si512(value_tiles.data + (kb * columns + 2 * s) * 512 + r * 32,
                               _mm512_permutex2var_epi16(a, interleave_low, c));
            _mm512_store_si512(value_tiles.data + (kb * columns + 2 * s + 1) * 512 + r * 32,
                               _mm512_permutex2var_epi16(a, interleave_high, c));
          }
        }
      for (int64_t qb = 0; qb * 16 < n; ++qb) {
        const int64_t rows = n - qb * 16 < 16 ? n - qb * 16 : 16;
        if (rows == 16) {  // queries straight from qkv, or a partial block copied and padded with zeros
          _tile_loadd(4, base + qb * 16 * row, row * 2);
          if (steps == 2) _tile_loadd(5, base + qb * 16 * row + 32, row * 2);
        } else {
          std::memset(query.data, 0, 16 * size * 2);
          for (int64_t i = 0; i < rows; ++i) std::memcpy(query.data + i * size, base + (qb * 16 + i) * row, size * 2);
          _tile_loadd(4, query.data, size * 2);
          if (steps == 2) _tile_loadd(5, query.data + 32, size * 2);
        }
        // scores, two key blocks at a time
        for (int64_t kb = 0; kb < blocks16; kb += 2) {
          const uint32_t* k = key_tiles.data + kb * steps * 256;
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
          _tile_stored(0, scores.data + kb * 16, padded * 4);
          if (pair) _tile_stored(1, scores.data + kb * 16 + 16, padded * 4);
        }
        // softmax rows: per-row maxima and sums come out of one transpose each instead of 16 reductions
        __m512 lanes[16];
        for (int i = 0; i < 16; ++i) {
          const float* s = scores.data + i * padded;
          __m512 top = _mm512_set1_ps(-3.0e38f);
          for (int64_t kb = 0; kb < blocks16; ++kb)
            top = _mm512_mask_max_ps(top, block_mask(m - kb * 16), top, _mm512_load_ps(s + kb * 16));
          lanes[i] = top;
        }
        alignas(64) float shifts[16];
        _mm512_store_ps(shifts, _mm512_mul_ps(across(lanes, larger), factor));
        for (int i = 0; i < 16; ++i) {
          const float* s = scores.data + i * padded;
          uint16_t* p = probs.data + i * pstride;
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
        // context = probabilities x values
        _tile_zero(0);
        _tile_zero(1);
        if (columns == 4) {
          _tile_zero(2);
          _tile_zero(3);
        }
        for (int64_t kb = 0; kb < blocks32; ++kb) {
          const uint16_t* v = value_tiles.data + kb * columns * 512;
          _tile_loadd(5, probs.data + kb * 32, pstride * 2);
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
        _tile_stored(0, context.data, size * 4);
        _tile_stored(1, context.data + 16, size * 4);
        if (columns == 4) {
          _tile_stored(2, context.data + 32, size * 4);
          _tile_stored(3, context.data + 48, size * 4);
        }
        for (int64_t i = 0; i < rows; ++i) {
          const __m512 inverse = _mm512_set1_ps(inverses[i]);
          uint16_t* dst = out + (offsets[b] + qb * 16 + i) * width + h * size;
          for (int c = 0; c < columns; ++c) {
            store_bf16(dst + c * 16, _mm512_mul_ps(_mm512_load_ps(context.data + i * size + c * 16), inverse));
          }
        }
      }
    }
    _tile_release();
  }
  return 0;
}

// x: [rows, width] bf16, replaced per row by LayerNorm(x + residual) = (y - mean) / sqrt(variance + eps) * weight
// + bias with y = x + residual (residual: [rows, width] bf16, or null for y = x), in float32, the row held in
// registers, on `threads` OpenMP threads. width: a multiple of 16, at most 2,048. Returns 0, or -1.
int densepass_layer_norm(uint16_t* x, const uint16_t* residual, const uint16_t* weight, const uint16_t* bias,
                         int64_t rows, int64_t width, float eps, int threads) {
  if (width % 16 != 0 || width <= 0 || width > 2048) return -1;
  const int64_t blocks = width / 16;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < rows; ++i) {
    uint16_t* row = x + i * width;
    __m512 v[128];
    __m512 total = _mm512_setzero_ps();
    for (int64_t k = 0; k < blocks; ++k) {
      v[k] = load_bf16(row + 16 * k);
      if (residual != nullptr) v[k] = _mm512_add_ps(v[k], load_bf16(residual + i * width + 16 * k));
      total = _mm512_add_ps(total, v[k]);
    }
    const __m512 mean = _mm512_set1_ps(_mm512_reduce_add_ps(total) / width);
    __m512 squares = _mm512_setzero_ps();
    for (int64_t k = 0; k < blocks; ++k) {
      v[k] = _mm512_sub_ps(v[k], mean);
      squares = _mm512_fmadd_ps(v[k], v[k], squares);
    }
    const __m512 scale = _mm512_set1_ps(1.0f / __builtin_sqrtf(_mm512_reduce_add_ps(squares) / width + eps));
    for (int64_t k = 0; k < blocks; ++k) {
      const __m512 normal = _mm512_mul_ps(v[k], scale);
      store_bf16(row + 16 * k, _mm512_fmadd_ps(normal, load_bf16(weight + 16 * k), load_bf16(bias + 16 * k)));
    }
  }
  return 0;
}

}  // extern "C"
