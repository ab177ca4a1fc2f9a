// CRC-32C (Castagnoli), the checksum of jaxworks checkpoints, for the checked
// read loop of restore (checked_read.h), which runs without the GIL and so
// cannot call a Python implementation.
//
// On x86-64 CPUs with AVX-512 and VPCLMULQDQ (Ice Lake and later, Zen 4 and
// later) the bulk of the data is folded 256 bytes at a time with carry-less
// multiplies, four independent 512-bit accumulators deep, and the folded
// remainder and the tail are summed with the SSE4.2 CRC32 instruction: tens
// of GB/s a core on data in cache. Elsewhere a table, one byte at a time
// (correct, slow: Python then sums with fastcrc instead, see Crc32cFast).
//
// The values are those of fastcrc.crc32.iscsi and crc32c.crc32c: a result
// passed back as `crc` continues the sum over the next bytes.
#ifndef JAXWORKS_BATCHED_TRANSFER_CC_CRC32C_H_
#define JAXWORKS_BATCHED_TRANSFER_CC_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace jaxworks::batched_transfer {

// CRC-32C of `n` bytes at `data`, continuing `crc` (0 to start).
uint32_t Crc32c(uint32_t crc, const unsigned char* data, size_t n);

// Whether Crc32c runs the vector path on this CPU (decided once).
bool Crc32cFast();

}  // namespace jaxworks::batched_transfer

#endif  // JAXWORKS_BATCHED_TRANSFER_CC_CRC32C_H_
