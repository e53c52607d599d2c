// The emulator's instruments, read from Python (rollout_corr_testing/cuda_emulator/records.py):
//   record_start()                 start keeping a record of every launch (clears the previous ones)
//   record_stop()                  stop (the records stay readable)
//   launch_records(Tensor[] bufs)  the records as JSON: per launch the kernel, its shape, global traffic (bytes,
//                                  warp-level requests, sectors vs the ideal, per access site), how each of `bufs`
//                                  was read and written (bytes, distinct bytes, most accesses to one byte), the
//                                  barrier releases per __syncthreads statement and the racecheck hazards
//   set_racecheck(int mode) -> int 0 off, 1 record hazards, 2 record and fail the launch (default); returns the old one
//   racecheck_available() -> bool  false in the AddressSanitizer build (see cuda_emu.h)
//   skip_barrier(str site) -> str   the __syncthreads at "file.cuh:line" runs as if removed ("": none); returns the
//                                  old site
// Always compiled into the emulator extension (loader.py), whichever kernel families are built.
#include "cuda_emu.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <map>
#include <sstream>
#include <string>
#include <vector>

// RC_SHARED_STORE_AFTER_LOAD (cuda_emu.h): defined here, out of sight of the kernels' translation units.
extern "C" void rc_emu_opaque_call() {}

namespace rollout_corr {
namespace {

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// How the accesses of one direction cover [lo, hi): bytes (lane-level), distinct bytes, most accesses to one byte.
struct Coverage {
  uint64_t bytes = 0, unique = 0, max_per_byte = 0;
};

Coverage coverage(const std::vector<std::pair<uintptr_t, uintptr_t>>& sorted_ranges, uintptr_t lo, uintptr_t hi) {
  Coverage c;
  std::vector<std::pair<uintptr_t, int>> events;
  for (const auto& r : sorted_ranges) {
    if (r.first >= hi) break;
    const uintptr_t b = std::max(r.first, lo), e = std::min(r.second, hi);
    if (e <= b) continue;
    c.bytes += e - b;
    events.emplace_back(b, 1);
    events.emplace_back(e, -1);
  }
  std::sort(events.begin(), events.end(), [](const auto& x, const auto& y) {
    return x.first != y.first ? x.first < y.first : x.second < y.second;  // ends before starts at one address
  });
  int64_t depth = 0;
  uintptr_t prev = 0;
  for (const auto& ev : events) {
    if (depth > 0) c.unique += ev.first - prev;
    depth += ev.second;
    prev = ev.first;
    c.max_per_byte = std::max<uint64_t>(c.max_per_byte, static_cast<uint64_t>(std::max<int64_t>(depth, 0)));
  }
  return c;
}

uint64_t distinct_sectors(const std::vector<std::pair<uintptr_t, uintptr_t>>& ranges) {
  std::vector<uintptr_t> s;
  for (const auto& r : ranges)
    for (uintptr_t k = r.first / emu::kSectorBytes; k <= (r.second - 1) / emu::kSectorBytes; ++k) s.push_back(k);
  std::sort(s.begin(), s.end());
  return static_cast<uint64_t>(std::unique(s.begin(), s.end()) - s.begin());
}

void record_start() { emu::record_start(); }
void record_stop() { emu::record_stop(); }

// Sector statistics of a set of warp-level requests.
struct Sectors {
  uint64_t requests = 0, accesses = 0, bytes = 0, sectors = 0, ideal = 0, minimum = 0;
  void add(const emu::RequestSectors& r) {
    requests += 1;
    accesses += r.lanes;
    bytes += r.bytes;
    sectors += r.sectors;
    ideal += r.ideal;
    minimum += r.minimum;
  }
  std::string json() const {
    std::ostringstream os;
    os << "\"requests\":" << requests << ",\"sectors\":" << sectors << ",\"ideal_sectors\":" << ideal
       << ",\"min_sectors\":" << minimum;
    return os.str();
  }
};

std::string launch_records(const std::vector<at::Tensor>& buffers) {
  std::vector<std::pair<uintptr_t, uintptr_t>> bufs;
  for (const auto& t : buffers) {
    const uintptr_t lo = reinterpret_cast<uintptr_t>(t.data_ptr());
    bufs.emplace_back(lo, lo + static_cast<uintptr_t>(t.numel() * t.element_size()));
  }
  std::ostringstream os;
  os << "[";
  bool first_launch = true;
  for (const emu::LaunchRecord& r : emu::recorder().launches) {
    os << (first_launch ? "" : ",") << "\n{\"kernel\":" << json_string(r.kernel) << ",\"grid\":[" << r.grid.x << ","
       << r.grid.y << "," << r.grid.z << "],\"block\":[" << r.block.x << "," << r.block.y << "," << r.block.z << "]";
    first_launch = false;
    // Requests, each split by buffer (a request normally lies in one), and the byte ranges of each direction.
    const size_t nreq = r.request_site.size();
    std::vector<std::vector<std::pair<uintptr_t, uint32_t>>> requests(nreq);
    std::vector<std::pair<uintptr_t, uintptr_t>> ranges[2];  // loads, stores
    std::vector<char> is_store(nreq);
    for (size_t q = 0; q < nreq; ++q) is_store[q] = emu::site_info(r.request_site[q]).store;
    for (const auto& a : r.log) {
      requests[a.request].emplace_back(a.addr, a.size);
      ranges[static_cast<int>(is_store[a.request])].emplace_back(a.addr, a.addr + a.size);
    }
    for (auto& v : ranges) std::sort(v.begin(), v.end());
    std::map<int, Sectors> per_site;
    Sectors per_dir[2];
    std::vector<Sectors> per_buf[2];
    per_buf[0].resize(bufs.size());
    per_buf[1].resize(bufs.size());
    std::vector<std::pair<uintptr_t, uint32_t>> part;
    for (size_t q = 0; q < nreq; ++q) {
      if (requests[q].empty()) continue;
      const int d = is_store[q];
      for (size_t b = 0; b < bufs.size(); ++b) {
        part.clear();
        for (const auto& a : requests[q])
          if (a.first >= bufs[b].first && a.first < bufs[b].second) part.push_back(a);
        if (!part.empty()) per_buf[d][b].add(emu::request_sectors(part));
      }
      const emu::RequestSectors all = emu::request_sectors(requests[q]);
      per_site[r.request_site[q]].add(all);
      per_dir[d].add(all);
    }
    for (int d = 0; d < 2; ++d) {
      const Coverage all = coverage(ranges[d], 0, ~uintptr_t(0));
      os << ",\"" << (d ? "write" : "read") << "\":{\"accesses\":" << per_dir[d].accesses << ",\"bytes\":" << all.bytes
         << ",\"unique_bytes\":" << all.unique << "," << per_dir[d].json()
         << ",\"unique_sectors\":" << distinct_sectors(ranges[d]) << "}";
    }
    os << ",\"sites\":[";
    bool first = true;
    for (const auto& kv : per_site) {
      const emu::SiteInfo s = emu::site_info(kv.first);
      os << (first ? "" : ",") << "{\"file\":" << json_string(emu::base_name(s.file)) << ",\"line\":" << s.line
         << ",\"store\":" << (s.store ? "true" : "false") << ",\"accesses\":" << kv.second.accesses
         << ",\"bytes\":" << kv.second.bytes << "," << kv.second.json() << "}";
      first = false;
    }
    os << "],\"buffers\":[";
    for (size_t b = 0; b < bufs.size(); ++b) {
      const Coverage rd = coverage(ranges[0], bufs[b].first, bufs[b].second);
      const Coverage wr = coverage(ranges[1], bufs[b].first, bufs[b].second);
      os << (b ? "," : "") << "{\"read_bytes\":" << rd.bytes << ",\"read_unique\":" << rd.unique
         << ",\"read_max\":" << rd.max_per_byte << ",\"write_bytes\":" << wr.bytes << ",\"write_unique\":" << wr.unique
         << ",\"write_max\":" << wr.max_per_byte << ",\"read_sectors\":{" << per_buf[0][b].json()
         << "},\"write_sectors\":{" << per_buf[1][b].json() << "}}";
    }
    // Accesses outside every given buffer (scratch, row records the op keeps to itself).
    uint64_t other[2] = {0, 0};
    for (const auto& a : r.log) {
      bool inside = false;
      for (const auto& b : bufs) inside |= a.addr >= b.first && a.addr < b.second;
      if (!inside) other[static_cast<int>(is_store[a.request])] += a.size;
    }
    os << "],\"other\":{\"read_bytes\":" << other[0] << ",\"write_bytes\":" << other[1] << "},\"barriers\":{";
    first = true;
    for (const auto& kv : r.barriers) {
      os << (first ? "" : ",") << json_string(kv.first) << ":" << kv.second;
      first = false;
    }
    os << "},\"hazard_count\":" << r.hazard_count << ",\"hazards\":[";
    first = true;
    for (const auto& h : r.hazards) {
      os << (first ? "" : ",") << json_string(h);
      first = false;
    }
    os << "]}";
  }
  os << "\n]";
  return os.str();
}

int64_t set_racecheck(int64_t mode) {
  TORCH_CHECK(mode >= 0 && mode <= 2, "racecheck mode must be 0 (off), 1 (record) or 2 (record and fail), got ",
              mode);
  const int64_t old = emu::racecheck_mode();
  emu::racecheck_mode() = static_cast<int>(mode);
  return old;
}

bool racecheck_available() { return emu::racecheck_available(); }

std::string skip_barrier(const std::string& site) {
  std::string old = emu::skipped_barrier();
  emu::skipped_barrier() = site;
  return old;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rollout_corr_emu, m) {
  m.def("record_start() -> ()", &record_start);
  m.def("record_stop() -> ()", &record_stop);
  m.def("launch_records(Tensor[] buffers) -> str", &launch_records);
  m.def("set_racecheck(int mode) -> int", &set_racecheck);
  m.def("racecheck_available() -> bool", &racecheck_available);
  m.def("skip_barrier(str site) -> str", &skip_barrier);
}

}  // namespace rollout_corr
