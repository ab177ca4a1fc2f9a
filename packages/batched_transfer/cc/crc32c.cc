#include "crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define JAXWORKS_CRC32C_X86 1
#endif

namespace jaxworks::batched_transfer {
namespace {

// The polynomial in reflected order (bit i is the coefficient of x^(31-i),
// x^32 left out), as every CRC-32C implementation with the same values uses.
constexpr uint32_t kPoly = 0x82F63B78u;

// x^e mod P, reflected: multiplying by x shifts right, and the x^32 that
// falls off the end is replaced by P's lower terms.
constexpr uint32_t XPow(int e) {
  uint32_t r = 0x80000000u;  // x^0
  for (int i = 0; i < e; ++i) r = (r >> 1) ^ ((r & 1u) ? kPoly : 0u);
  return r;
}

constexpr std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> t{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t r = b;
    for (int i = 0; i < 8; ++i) r = (r >> 1) ^ ((r & 1u) ? kPoly : 0u);
    t[b] = r;
  }
  return t;
}
constexpr std::array<uint32_t, 256> kTable = MakeTable();

// The register form: no initial or final inversion.
uint32_t TableRegister(uint32_t s, const unsigned char* p, size_t n) {
  for (size_t i = 0; i < n; ++i) s = (s >> 8) ^ kTable[(s ^ p[i]) & 0xFFu];
  return s;
}

#ifdef JAXWORKS_CRC32C_X86

// Bytes one fold step covers: four 512-bit accumulators, each folded onto the
// data 256 bytes further on.
constexpr size_t kBlock = 256;

// A 128-bit lane loaded from 16 bytes holds H * x^64 + L, H its first 8 bytes
// and L its last (reflected). Moving it kBlock * 8 = D bits on multiplies it
// by x^D; it stays congruent mod P with H * (x^(D+64) mod P) + L * (x^D mod P),
// each product at most 95 bits. A carry-less multiply of two reflected 64-bit
// values yields their product times x in a reflected 128-bit lane, so the
// constants are one power lower; a 32-bit reflected remainder is the top half
// of its 64-bit reflected form.
constexpr int kFoldBits = static_cast<int>(kBlock) * 8;
constexpr uint64_t kFoldH = static_cast<uint64_t>(XPow(kFoldBits + 63)) << 32;
constexpr uint64_t kFoldL = static_cast<uint64_t>(XPow(kFoldBits - 1)) << 32;

__attribute__((target("sse4.2,crc32"))) uint32_t
InstructionRegister(uint32_t s, const unsigned char* p, size_t n) {
  uint64_t s64 = s;
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    s64 = _mm_crc32_u64(s64, word);
  }
  s = static_cast<uint32_t>(s64);
  for (; n > 0; ++p, --n) s = _mm_crc32_u8(s, *p);
  return s;
}

__attribute__((target("avx512f,vpclmulqdq,sse4.2,crc32"))) inline __m512i Fold(
    __m512i x, __m512i k, const unsigned char* next) {
  __m512i hi = _mm512_clmulepi64_epi128(x, k, 0x00);  // H * kFoldH
  __m512i lo = _mm512_clmulepi64_epi128(x, k, 0x11);  // L * kFoldL
  return _mm512_ternarylogic_epi64(hi, lo, _mm512_loadu_si512(next), 0x96);
}

__attribute__((target("avx512f,vpclmulqdq,sse4.2,crc32"))) uint32_t
VectorRegister(uint32_t s, const unsigned char* p, size_t n) {
  if (n < 2 * kBlock) return InstructionRegister(s, p, n);
  const __m512i k = _mm512_set_epi64(kFoldL, kFoldH, kFoldL, kFoldH, kFoldL,
                                     kFoldH, kFoldL, kFoldH);
  // The register is XORed into the first four bytes.
  __m512i x0 = _mm512_xor_si512(
      _mm512_loadu_si512(p), _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                              0, 0, 0, 0, static_cast<int>(s)));
  __m512i x1 = _mm512_loadu_si512(p + 64);
  __m512i x2 = _mm512_loadu_si512(p + 128);
  __m512i x3 = _mm512_loadu_si512(p + 192);
  for (p += kBlock, n -= kBlock; n >= kBlock; p += kBlock, n -= kBlock) {
    x0 = Fold(x0, k, p);
    x1 = Fold(x1, k, p + 64);
    x2 = Fold(x2, k, p + 128);
    x3 = Fold(x3, k, p + 192);
  }
  // The accumulators are 256 bytes congruent with everything summed so far:
  // their sum from a zero register is the register after it.
  alignas(64) unsigned char folded[kBlock];
  _mm512_store_si512(folded, x0);
  _mm512_store_si512(folded + 64, x1);
  _mm512_store_si512(folded + 128, x2);
  _mm512_store_si512(folded + 192, x3);
  s = InstructionRegister(0, folded, kBlock);
  return InstructionRegister(s, p, n);
}

bool DetectFast() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("vpclmulqdq") &&
         __builtin_cpu_supports("sse4.2");
}

#else

bool DetectFast() { return false; }

#endif  // JAXWORKS_CRC32C_X86

}  // namespace

bool Crc32cFast() {
  static const bool fast = DetectFast();
  return fast;
}

uint32_t Crc32c(uint32_t crc, const unsigned char* data, size_t n) {
#ifdef JAXWORKS_CRC32C_X86
  if (Crc32cFast()) return ~VectorRegister(~crc, data, n);
#endif
  return ~TableRegister(~crc, data, n);
}

}  // namespace jaxworks::batched_transfer
