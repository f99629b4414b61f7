// The training kernels of densepass/models/cpu_kernels.py for x86 CPUs without AVX512-BF16 (AMD Zen 2 and 3, Intel
// Skylake and Cascade Lake Xeons, Intel client parts): dropout with counter-based masks, and attention's softmax
// with its dropout (bf16 or float32 scores), forward and backward, with the same C interface, draws and results as
// csrc/cpu_kernels.cpp's (which holds them on AVX-512 beside the bf16 layers). Plain C++ loops that the compiler
// vectorises for the flags it is given (cpu_kernels.AVX2_FLAGS: AVX2, FMA, F16C): no intrinsics, so the build is as
// portable as those flags. tests/test_dropout.py checks it against NumPy's masks and float64, as it checks the
// AVX-512 builds.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr int64_t kDropoutChunk = 4096;  // elements a thread takes at a time

inline uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

inline float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

inline float widened(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

// float32 -> bf16, rounded to nearest even (NaN stays a quiet NaN), as torch and vcvtneps2bf16 round.
inline uint16_t rounded(float x) {
  const uint32_t b = bits_of(x);
  const uint32_t even = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((b & 0x7fffffffu) > 0x7f800000u ? (b >> 16) | 0x40u : even);
}

// Dropout's draws (densepass/models/dropout.py): element e of a call seeded by s is kept where the 16-bit part
// e % 4 of word e / 4 is below a threshold, word w being SplitMix64's output for the counter w + 1 under s.
inline uint64_t splitmix(uint64_t seed, uint64_t word) {
  uint64_t z = (word + 1) * kGolden + seed;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// draws[0 .. count) = the 16-bit draws of elements first .. first + count - 1, by way of words (count / 4 + 2
// writable): one loop over the words the elements fall in, then their 16-bit parts copied out.
inline void draws_of(uint64_t seed, int64_t first, int64_t count, uint64_t* words, uint16_t* draws) {
  const int64_t word = first / 4, skip = first % 4, n = (skip + count + 3) / 4;
  for (int64_t w = 0; w < n; ++w) words[w] = splitmix(seed, static_cast<uint64_t>(word + w));
  std::memcpy(draws, reinterpret_cast<const uint16_t*>(words) + skip, static_cast<size_t>(count) * 2);
}

// 2^t for t <= 0, to 8e-5 relative (bf16 rounds to 4e-3): t = n + f with |f| <= 1/2, 2^f by the cubic
// csrc/cpu_kernels.cpp uses, times 2^n (n >= -126: a normal float's exponent).
inline float exp2_nonpositive(float t) {
  t = t < -126.0f ? -126.0f : t;
  const float n = std::rint(t), f = t - n;
  const float p = ((5.508868e-2f * f + 2.4260405e-1f) * f + 6.9327624e-1f) * f + 9.9992894e-1f;
  return p * float_of(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
}

// 2^t for t <= 0 to float32's precision (the float32 path's softmax): the same split, 2^f by its Taylor polynomial
// of degree 7 (relative error 7e-9 for |f| <= 1/2).
inline float exp2_nonpositive_exact(float t) {
  t = t < -126.0f ? -126.0f : t;
  const float n = std::rint(t), f = t - n;
  float p = 1.525273380e-05f;
  p = p * f + 1.540353039e-04f;
  p = p * f + 1.333355815e-03f;
  p = p * f + 9.618129108e-03f;
  p = p * f + 5.550410866e-02f;
  p = p * f + 2.402265070e-01f;
  p = p * f + 6.931471806e-01f;
  p = p * f + 1.0f;
  return p * float_of(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
}

// Per-thread scratch rows, grown on demand and kept from call to call.
struct Workspace {
  std::vector<float> floats;
  std::vector<uint16_t> halves;
  std::vector<uint64_t> longs;
  std::vector<uint8_t> bytes;
  float* row(int64_t count) {
    if (static_cast<int64_t>(floats.size()) < count) floats.resize(static_cast<size_t>(count));
    return floats.data();
  }
  uint64_t* words(int64_t count) {
    if (static_cast<int64_t>(longs.size()) < count) longs.resize(static_cast<size_t>(count));
    return longs.data();
  }
  const uint8_t* ones(int64_t count) {
    if (static_cast<int64_t>(bytes.size()) < count) bytes.assign(static_cast<size_t>(count), 1);
    return bytes.data();
  }
  uint16_t* draws(int64_t count) {
    if (static_cast<int64_t>(halves.size()) < count) halves.resize(static_cast<size_t>(count));
    return halves.data();
  }
};

inline float to_float(uint16_t h) { return widened(h); }
inline float to_float(float x) { return x; }
template <typename T>
T from_float(float x);
template <>
inline uint16_t from_float<uint16_t>(float x) {
  return rounded(x);
}
template <>
inline float from_float<float>(float x) {
  return x;
}
// exp2 as softmax of T takes it: to bf16's precision for bf16 scores, to float32's for float32 ones.
template <typename T>
inline float exp2_of(float t) {
  return exp2_nonpositive(t);
}
template <>
inline float exp2_of<float>(float t) {
  return exp2_nonpositive_exact(t);
}

// densepass_softmax_dropout over scores, probs and out of type T (bf16 as uint16_t, or float).
template <typename T>
void softmax_dropout(const T* scores, const uint8_t* mask, int64_t mb, int64_t mh, int64_t mq, int64_t batch,
                     int64_t heads, int64_t queries, int64_t keys, float scale, uint64_t seed, uint32_t threshold,
                     float keep_scale, T* probs, T* out, int threads) {
  const int64_t rows = batch * heads * queries;
  const float factor = scale * 1.4426950408889634f;
#pragma omp parallel num_threads(threads)
  {
    static thread_local Workspace workspace;
    float* e = workspace.row(keys);
    uint64_t* words = workspace.words(keys / 4 + 2);
    uint16_t* draws = workspace.draws(keys);
    const uint8_t* every = workspace.ones(keys);  // the mask of a call without one
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t b = r / (heads * queries), h = (r / queries) % heads, i = r % queries;
      const T* row = scores + r * keys;
      const uint8_t* m = mask == nullptr ? every : mask + b * mb + h * mh + i * mq;
      float most = -INFINITY;
      int64_t live = 0;
#pragma omp simd reduction(max : most) reduction(+ : live)
      for (int64_t j = 0; j < keys; ++j) {
        const float v = m[j] != 0 ? to_float(row[j]) : -INFINITY;
        e[j] = v;
        most = v > most ? v : most;
        live += m[j] != 0;
      }
      draws_of(seed, r * keys, keys, words, draws);
      T* p_row = probs + r * keys;
      T* o_row = out + r * keys;
      if (live == 0) {  // uniform out, zero kept
        const T uniform = from_float<T>(keep_scale / static_cast<float>(keys));
        for (int64_t j = 0; j < keys; ++j) {
          p_row[j] = T(0);
          o_row[j] = draws[j] < threshold ? uniform : T(0);
        }
        continue;
      }
      float total = 0.0f;
#pragma omp simd reduction(+ : total)
      for (int64_t j = 0; j < keys; ++j) {  // exp(scale (s - max)); -inf (masked) gives 0
        const float x = exp2_of<T>((e[j] - most) * factor);  // -inf - most: 2^-126, selected away
        e[j] = e[j] == -INFINITY ? 0.0f : x;
        total += e[j];
      }
      const float inverse = 1.0f / total;
      for (int64_t j = 0; j < keys; ++j) {
        const float p = e[j] * inverse;
        p_row[j] = from_float<T>(p);
        const T kept = from_float<T>(p * keep_scale);
        o_row[j] = draws[j] < threshold ? kept : T(0);
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
    static thread_local Workspace workspace;
    float* d = workspace.row(keys);
    uint64_t* words = workspace.words(keys / 4 + 2);
    uint16_t* draws = workspace.draws(keys);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* g_row = grad + r * keys;
      const T* p_row = probs + r * keys;
      draws_of(seed, r * keys, keys, words, draws);
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < keys; ++j) {
        const float g = to_float(g_row[j]) * keep_scale;
        d[j] = draws[j] < threshold ? g : 0.0f;
        dot += d[j] * to_float(p_row[j]);
      }
      for (int64_t j = 0; j < keys; ++j)
        grad_scores[r * keys + j] = from_float<T>(to_float(p_row[j]) * (d[j] - dot) * scale);
    }
  }
}

}  // namespace

extern "C" {

// Which build this is: 3, the training kernels alone (cpu_kernels.py checks it is the one it built).
int densepass_kind() { return 3; }

// No AMX tiles here: nothing to ask Linux for.
int densepass_request_amx() { return 0; }

// out[e] = x[e] x scale where element e is kept, else 0, for e < n; x and out float32 (bf16: 0) or bf16 (1), the
// product in float32 rounded to bf16. The backward pass calls it on the gradient with the same seed. Returns 0.
int densepass_dropout(const void* x, void* out, int64_t n, int bf16, uint64_t seed, uint32_t threshold, float scale,
                      int threads) {
  const int64_t chunks = (n + kDropoutChunk - 1) / kDropoutChunk;
#pragma omp parallel num_threads(threads)
  {
    uint64_t words[kDropoutChunk / 4 + 2];
    uint16_t draws[kDropoutChunk];
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t first = c * kDropoutChunk, count = n - first < kDropoutChunk ? n - first : kDropoutChunk;
      draws_of(seed, first, count, words, draws);
      if (bf16) {
        const uint16_t* in = static_cast<const uint16_t*>(x) + first;
        uint16_t* o = static_cast<uint16_t*>(out) + first;
        for (int64_t i = 0; i < count; ++i) {
          const float v = widened(in[i]) * scale;  // computed whether kept or not: a select, not a branch
          o[i] = draws[i] < threshold ? rounded(v) : 0;
        }
      } else {
        const float* in = static_cast<const float*>(x) + first;
        float* o = static_cast<float*>(out) + first;
        for (int64_t i = 0; i < count; ++i) {
          const float v = in[i] * scale;
          o[i] = draws[i] < threshold ? v : 0.0f;
        }
      }
    }
  }
  return 0;
}

// Attention probabilities with dropout, a row of `keys` scores at a time (csrc/cpu_kernels.cpp's
// densepass_softmax_dropout says what each argument is), scores, probs and out bf16 (bf16: 1) or float32 (0):
// probs = softmax(scale x scores) over the keys `mask` keeps, in float32; out = probs x keep_scale where dropout's
// draws keep an element, else 0. A row without keys: uniform out, zero probs. Returns 0.
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

// densepass_softmax_dropout's backward pass over `rows` rows of `keys` (grad, probs and grad_scores bf16, or
// float32 where bf16 is 0): dP = grad x keep_scale where the same draws kept an element, else 0, and
// grad_scores = scale x P (dP - sum_j dP_j P_j), in float32. Returns 0.
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
  std::vector<uint64_t> words(static_cast<size_t>(count / 4 + 2));
  draws_of(seed, first, count, words.data(), out);
}

}  // extern "C"
