// Restore's checked read without the GIL: module
// jaxworks.batched_transfer._checked_read.
//
// A checked read sums each step of a chunk right after reading it, while the
// CPU's cache still holds it. In Python every step hands the GIL over twice
// (the read, the sum), which the read threads wait on; here a whole chunk is
// read and summed in one call that releases the GIL once.
//
// Every entry point accepts arbitrary Python objects: bad input raises a
// Python TypeError, BufferError or ValueError (never a crash). The read never
// raises for the file: it stops where a read fails or the file ends and says
// how far it got; the caller reads the rest its own way (and so raises the
// error it names).
#include <errno.h>
#include <pybind11/pybind11.h>
#include <sys/uio.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "crc32c.h"

namespace py = pybind11;
namespace bt = jaxworks::batched_transfer;

namespace {

// The contiguous buffer of a Python object, held for the call (released with
// the GIL held, by the destructor).
class Held {
 public:
  Held(py::handle obj, bool writable) {
    int flags = writable ? PyBUF_WRITABLE : PyBUF_SIMPLE;
    if (PyObject_GetBuffer(obj.ptr(), &view_, flags) != 0) {
      throw py::error_already_set();
    }
  }
  Held(const Held&) = delete;
  Held& operator=(const Held&) = delete;
  ~Held() { PyBuffer_Release(&view_); }

  unsigned char* data() const { return static_cast<unsigned char*>(view_.buf); }
  size_t size() const { return static_cast<size_t>(view_.len); }

 private:
  Py_buffer view_;
};

struct Part {
  unsigned char* data;
  size_t size;
};

// Reads the bytes of `fd` from `offset` into `parts` (one after the other),
// `step` bytes a read, summing each read's bytes after it where `sum` says.
// Returns the bytes read and their sum continuing `crc`; fewer than the parts
// hold where the file ends or a read fails.
std::pair<size_t, uint32_t> ReadAndSum(int fd, const std::vector<Part>& parts,
                                       int64_t offset, size_t step,
                                       uint32_t crc, bool sum) {
  size_t total = 0;
  for (const Part& p : parts) total += p.size;
  size_t done = 0, part = 0, within = 0;  // `done` is byte `within` of `part`
  std::vector<iovec> iov;
  while (done < total) {
    iov.clear();
    size_t p = part, w = within;
    for (size_t left = std::min(step, total - done);
         left > 0 && iov.size() < IOV_MAX; ++p, w = 0) {
      size_t n = std::min(left, parts[p].size - w);
      if (n > 0) iov.push_back({parts[p].data + w, n});
      left -= n;
    }
    ssize_t got = preadv(fd, iov.data(), static_cast<int>(iov.size()),
                         static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    for (size_t left = static_cast<size_t>(got); left > 0;) {
      size_t n = std::min(left, parts[part].size - within);
      if (sum) crc = bt::Crc32c(crc, parts[part].data + within, n);
      left -= n;
      within += n;
      done += n;
      if (within == parts[part].size) {
        ++part;
        within = 0;
      }
    }
  }
  return {done, crc};
}

// Bytes from which a sum releases the GIL.
constexpr size_t kReleaseAt = 1 << 16;

// ReadAndSum of Python arguments, with the GIL released; (bytes read, sum).
// `name`: the function's, for its errors.
py::tuple Read(const char* name, int fd, py::sequence parts, int64_t offset,
               size_t step, uint32_t value, bool sum) {
  if (step == 0) {
    throw py::value_error(std::string(name) + ": step must be positive, not 0");
  }
  if (offset < 0) {
    throw py::value_error(std::string(name) + ": offset must be >= 0, not " +
                          std::to_string(offset));
  }
  std::vector<std::unique_ptr<Held>> held;
  std::vector<Part> spans;
  for (py::handle part : parts) {
    held.push_back(std::make_unique<Held>(part, true));
    spans.push_back({held.back()->data(), held.back()->size()});
  }
  std::pair<size_t, uint32_t> got;
  {
    py::gil_scoped_release release;
    got = ReadAndSum(fd, spans, offset, step, value, sum);
  }
  return py::make_tuple(got.first, got.second);
}

}  // namespace

PYBIND11_MODULE(_checked_read, m) {
  m.doc() = "Checked reads of jaxworks.batched_transfer's restore (C++).";
  m.attr("FAST") = bt::Crc32cFast();
  m.def(
      "crc32c",
      [](py::handle data, uint32_t value) {
        Held held(data, false);
        if (held.size() < kReleaseAt) {
          return bt::Crc32c(value, held.data(), held.size());
        }
        py::gil_scoped_release release;
        return bt::Crc32c(value, held.data(), held.size());
      },
      py::arg("data"), py::arg("value") = 0,
      "CRC-32C of a contiguous buffer, continuing `value` (0 to start): the "
      "values of fastcrc.crc32.iscsi.");
  m.def(
      "read_crc32c",
      [](int fd, py::sequence parts, int64_t offset, size_t step,
         uint32_t value) {
        return Read("read_crc32c", fd, parts, offset, step, value, true);
      },
      py::arg("fd"), py::arg("parts"), py::arg("offset"), py::arg("step"),
      py::arg("value") = 0,
      "Reads file `fd` from byte `offset` into the writable buffers `parts`, "
      "one after the other, `step` bytes a read, each summed (CRC-32C, "
      "continuing `value`) right after it is read. Returns (bytes read, their "
      "sum); fewer bytes than the parts hold where the file ends or a read "
      "fails (the caller reads the rest to raise the error).");
  m.def(
      "read_into",
      [](int fd, py::sequence parts, int64_t offset, size_t step) {
        py::tuple got = Read("read_into", fd, parts, offset, step, 0, false);
        return got[0].cast<size_t>();
      },
      py::arg("fd"), py::arg("parts"), py::arg("offset"), py::arg("step"),
      "Reads file `fd` from byte `offset` into the writable buffers `parts`, "
      "one after the other, `step` bytes a read, releasing the GIL once. "
      "Returns the bytes read: fewer than the parts hold where the file ends "
      "or a read fails (the caller reads the rest to raise the error).");
}
