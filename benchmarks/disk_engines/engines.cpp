// The storage engine candidates for the disk tier (issue 32), measured the way the tier would
// use them: rows of fixed size keyed by int64 id, written and read in batches by a few threads.
//
//   engines ENGINE DIR ROWS ROW_BYTES BATCH BATCHES THREADS   (benchmarks/bench_disk_engines.py runs it)
//
// ENGINE: rocksdb (linked, as upstream's SSD tier: no WAL, direct reads and compaction I/O, a
// 32 MiB block cache, bloom filters, no compression), lmdb (a B+tree read through mmap, no
// sync), slots (a fixed-slot row file: a row lives at its slot, 4 KiB pages of whole rows, read
// and written in place with O_DIRECT; the id -> slot index in memory, as our id map would be).
// Phases: load ROWS rows in batches; drop the files' cached pages; read BATCHES batches of BATCH
// distinct ids, uniform then Zipf(1.05) over the rows; rewrite BATCHES batches of BATCH existing
// rows (a cache's write-back); each phase's wall time and the bytes the process wrote to
// storage (/proc/self/io), as one JSON line on stdout.
#include <fcntl.h>
#include <lmdb.h>
#include <omp.h>
#include <rocksdb/db.h>
#include <rocksdb/filter_policy.h>
#include <rocksdb/table.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

namespace fs = std::filesystem;

static void die(const std::string& what) {
  fprintf(stderr, "engines: %s\n", what.c_str());
  exit(1);
}

static long long io_write_bytes() {
  std::ifstream f("/proc/self/io");
  std::string key;
  long long value;
  while (f >> key >> value)
    if (key == "write_bytes:") return value;
  return -1;
}

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Drop the clean cached pages of every file under dir (after syncing them), so that reads
// reach the disk: no root needed, unlike /proc/sys/vm/drop_caches.
static void drop_cache(const std::string& dir) {
  sync();
  for (auto& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    int fd = open(e.path().c_str(), O_RDONLY);
    if (fd < 0) continue;
    fdatasync(fd);
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    close(fd);
  }
}

static long long dir_bytes(const std::string& dir) {
  long long total = 0;
  for (auto& e : fs::recursive_directory_iterator(dir)) {
    struct stat st;
    if (e.is_regular_file() && stat(e.path().c_str(), &st) == 0) total += (long long)st.st_blocks * 512;
  }
  return total;
}

struct Engine {
  virtual ~Engine() = default;
  virtual void put(const int64_t* ids, const uint8_t* rows, int n) = 0;
  virtual void get(const int64_t* ids, uint8_t* out, int n) = 0;  // every id present
  virtual void settle() {}  // finish background writes (flushes, compactions)
  virtual void reopen() {}  // drop what the engine holds mapped (so that its pages can be dropped)
};

// -- RocksDB -------------------------------------------------------------------------------------
struct Rocks : Engine {
  rocksdb::DB* db = nullptr;
  size_t row;
  static std::string key(int64_t id) {  // big-endian: ids sort as numbers
    uint64_t be = __builtin_bswap64((uint64_t)id);
    return std::string((const char*)&be, 8);
  }
  Rocks(const std::string& dir, size_t row_bytes) : row(row_bytes) {
    rocksdb::Options o;
    o.create_if_missing = true;
    o.use_direct_reads = true;
    o.use_direct_io_for_flush_and_compaction = true;
    o.compression = rocksdb::kNoCompression;
    o.max_background_jobs = 2;
    o.write_buffer_size = 64 << 20;
    rocksdb::BlockBasedTableOptions t;
    t.block_cache = rocksdb::NewLRUCache(32 << 20);
    t.filter_policy.reset(rocksdb::NewBloomFilterPolicy(10));
    t.block_size = 4096;
    o.table_factory.reset(rocksdb::NewBlockBasedTableFactory(t));
    auto s = rocksdb::DB::Open(o, dir, &db);
    if (!s.ok()) die(s.ToString());
  }
  ~Rocks() override { delete db; }
  void put(const int64_t* ids, const uint8_t* rows, int n) override {
    rocksdb::WriteBatch batch;
    for (int i = 0; i < n; ++i) batch.Put(key(ids[i]), rocksdb::Slice((const char*)rows + (size_t)i * row, row));
    rocksdb::WriteOptions w;
    w.disableWAL = true;  // the tier is a cache of training state, not a log
    auto s = db->Write(w, &batch);
    if (!s.ok()) die(s.ToString());
  }
  void get(const int64_t* ids, uint8_t* out, int n) override {
#pragma omp parallel
    {
      int T = omp_get_num_threads(), t = omp_get_thread_num();
      int lo = (int)((long long)n * t / T), hi = (int)((long long)n * (t + 1) / T), m = hi - lo;
      std::vector<std::string> keys(m);
      std::vector<rocksdb::Slice> slices(m);
      for (int i = 0; i < m; ++i) keys[i] = key(ids[lo + i]), slices[i] = keys[i];
      std::vector<rocksdb::PinnableSlice> values(m);
      std::vector<rocksdb::Status> status(m);
      db->MultiGet(rocksdb::ReadOptions(), db->DefaultColumnFamily(), m, slices.data(), values.data(),
                   status.data());
      for (int i = 0; i < m; ++i) {
        if (!status[i].ok()) die("rocksdb get: " + status[i].ToString());
        memcpy(out + (size_t)(lo + i) * row, values[i].data(), row);
      }
    }
  }
  void settle() override {
    db->Flush(rocksdb::FlushOptions());
    uint64_t running = 1, pending = 1;
    while (running || pending) {
      db->GetIntProperty("rocksdb.num-running-compactions", &running);
      db->GetIntProperty("rocksdb.compaction-pending", &pending);
      usleep(20000);
    }
  }
};

// -- LMDB ----------------------------------------------------------------------------------------
struct Lmdb : Engine {
  MDB_env* env = nullptr;
  MDB_dbi dbi;
  std::string dir;
  size_t row, rows;
  static void check(int rc, const char* what) {
    if (rc) die(std::string("lmdb ") + what + ": " + mdb_strerror(rc));
  }
  Lmdb(const std::string& dir, size_t row_bytes, size_t rows) : dir(dir), row(row_bytes), rows(rows) { open_env(); }
  void open_env() {
    check(mdb_env_create(&env), "env");
    check(mdb_env_set_mapsize(env, (size_t)(rows * (row + 64) * 2.5) + (1ull << 30)), "mapsize");
    check(mdb_env_set_maxreaders(env, 256), "readers");
    check(mdb_env_open(env, dir.c_str(), MDB_NOSYNC | MDB_NOMETASYNC | MDB_NORDAHEAD | MDB_NOTLS, 0644), "open");
    MDB_txn* txn;
    check(mdb_txn_begin(env, nullptr, 0, &txn), "txn");
    check(mdb_dbi_open(txn, nullptr, MDB_INTEGERKEY, &dbi), "dbi");
    check(mdb_txn_commit(txn), "commit");
  }
  void reopen() override {
    mdb_env_sync(env, 1);
    mdb_env_close(env);
    drop_cache(dir);
    open_env();
  }
  ~Lmdb() override { mdb_env_close(env); }
  void put(const int64_t* ids, const uint8_t* rows, int n) override {
    MDB_txn* txn;
    check(mdb_txn_begin(env, nullptr, 0, &txn), "txn");
    for (int i = 0; i < n; ++i) {
      MDB_val k{8, (void*)&ids[i]}, v{row, (void*)(rows + (size_t)i * row)};
      check(mdb_put(txn, dbi, &k, &v, 0), "put");
    }
    check(mdb_txn_commit(txn), "commit");
  }
  void get(const int64_t* ids, uint8_t* out, int n) override {
#pragma omp parallel
    {
      MDB_txn* txn;
      check(mdb_txn_begin(env, nullptr, MDB_RDONLY, &txn), "read txn");
#pragma omp for schedule(static)
      for (int i = 0; i < n; ++i) {
        MDB_val k{8, (void*)&ids[i]}, v;
        check(mdb_get(txn, dbi, &k, &v), "get");
        memcpy(out + (size_t)i * row, v.mv_data, row);
      }
      mdb_txn_abort(txn);
    }
  }
  void settle() override { mdb_env_sync(env, 1); }
};

// -- fixed-slot row file -------------------------------------------------------------------------
struct Slots : Engine {
  static constexpr size_t kPage = 4096;
  int fd;
  size_t row, per_page;
  std::unordered_map<int64_t, int64_t> slot;  // (our id map, in the tier)
  Slots(const std::string& dir, size_t row_bytes) : row(row_bytes), per_page(kPage / row_bytes) {
    fd = open((dir + "/rows").c_str(), O_RDWR | O_CREAT | O_DIRECT, 0644);
    if (fd < 0) die("open rows: " + std::string(strerror(errno)));
  }
  ~Slots() override { close(fd); }
  off_t page_of(int64_t s) const { return (off_t)(s / per_page) * kPage; }
  size_t at(int64_t s) const { return (size_t)(s % per_page) * row; }
  void put(const int64_t* ids, const uint8_t* rows, int n) override {
    // Each row's page: read it (unless every row of it is written here), patch, write it back.
    std::vector<std::pair<int64_t, int>> order(n);
    for (int i = 0; i < n; ++i) {
      auto it = slot.find(ids[i]);
      int64_t s = it != slot.end() ? it->second : (int64_t)slot.size();
      if (it == slot.end()) slot.emplace(ids[i], s);
      order[i] = {s, i};
    }
    std::sort(order.begin(), order.end());
    std::vector<std::pair<size_t, size_t>> pages;  // [begin, end) of order per page
    for (size_t b = 0; b < order.size();) {
      size_t e = b + 1;
      while (e < order.size() && order[e].first / (int64_t)per_page == order[b].first / (int64_t)per_page) ++e;
      pages.push_back({b, e});
      b = e;
    }
    int64_t end_slot = (int64_t)slot.size();
    // Runs of consecutive pages (new rows appended: the whole batch) go out in one write each.
    std::vector<std::pair<size_t, size_t>> runs;  // [begin, end) of pages
    for (size_t p = 0; p < pages.size();) {
      size_t q = p + 1;
      while (q < pages.size() && q - p < 256 &&
             order[pages[q].first].first / (int64_t)per_page == order[pages[q - 1].first].first / (int64_t)per_page + 1)
        ++q;
      runs.push_back({p, q});
      p = q;
    }
#pragma omp parallel
    {
      uint8_t* buf = (uint8_t*)aligned_alloc(kPage, 256 * kPage);
#pragma omp for schedule(dynamic, 16)
      for (size_t r = 0; r < runs.size(); ++r) {
        auto [p0, p1] = runs[r];
        off_t off = page_of(order[pages[p0].first].first);
        for (size_t p = p0; p < p1; ++p) {
          auto [b, e] = pages[p];
          uint8_t* page = buf + (p - p0) * kPage;
          int64_t first = order[b].first - order[b].first % (int64_t)per_page;
          bool whole = (int64_t)(e - b) == std::min<int64_t>((int64_t)per_page, end_slot - first);
          if (whole) memset(page, 0, kPage);
          else if (pread(fd, page, kPage, page_of(order[b].first)) < 0) die("pread");
          for (size_t j = b; j < e; ++j) memcpy(page + at(order[j].first), rows + (size_t)order[j].second * row, row);
        }
        size_t len = (p1 - p0) * kPage;
        if (pwrite(fd, buf, len, off) != (ssize_t)len) die("pwrite");
      }
      free(buf);
    }
  }
  void get(const int64_t* ids, uint8_t* out, int n) override {
#pragma omp parallel
    {
      uint8_t* buf = (uint8_t*)aligned_alloc(kPage, kPage);
#pragma omp for schedule(dynamic, 64)
      for (int i = 0; i < n; ++i) {
        int64_t s = slot.at(ids[i]);
        if (pread(fd, buf, kPage, page_of(s)) != (ssize_t)kPage) die("pread");
        memcpy(out + (size_t)i * row, buf + at(s), row);
      }
      free(buf);
    }
  }
};

// -- the phases ----------------------------------------------------------------------------------
int main(int argc, char** argv) {
  if (argc != 8) die("usage: engines ENGINE DIR ROWS ROW_BYTES BATCH BATCHES THREADS");
  std::string name = argv[1], dir = argv[2];
  long long rows = atoll(argv[3]);
  size_t row = (size_t)atoll(argv[4]);
  int batch = atoi(argv[5]), batches = atoi(argv[6]);
  omp_set_num_threads(atoi(argv[7]));
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::unique_ptr<Engine> e;
  if (name == "rocksdb") e = std::make_unique<Rocks>(dir, row);
  else if (name == "lmdb") e = std::make_unique<Lmdb>(dir, row, rows);
  else if (name == "slots") e = std::make_unique<Slots>(dir, row);
  else die("unknown engine " + name);

  std::mt19937_64 rng(1);
  std::vector<int64_t> ids(rows);
  for (auto& id : ids) id = (int64_t)(rng() >> 1);
  std::vector<uint8_t> data((size_t)batch * row);
  for (auto& b : data) b = (uint8_t)rng();

  // load
  long long w0 = io_write_bytes();
  double t0 = now();
  for (long long at = 0; at < rows; at += batch) {
    int n = (int)std::min<long long>(batch, rows - at);
    e->put(ids.data() + at, data.data(), n);
  }
  e->settle();
  double load_s = now() - t0;
  long long load_written = io_write_bytes() - w0;
  long long disk = dir_bytes(dir);

  // reads, cold: uniform, then Zipf(1.05) over the rows' ranks (a random rank -> row map)
  std::vector<double> cdf(rows);
  double acc = 0;
  for (long long r = 0; r < rows; ++r) cdf[r] = (acc += 1.0 / std::pow((double)(r + 1), 1.05));
  std::vector<int64_t> rank_row(rows);
  for (long long r = 0; r < rows; ++r) rank_row[r] = r;
  std::shuffle(rank_row.begin(), rank_row.end(), rng);
  auto draw = [&](bool zipf) {  // BATCH distinct rows (a cache's misses are distinct)
    std::vector<int64_t> out;
    std::unordered_map<int64_t, char> seen;
    std::uniform_real_distribution<double> u(0, acc);
    while ((int)out.size() < batch) {
      long long r = zipf ? std::lower_bound(cdf.begin(), cdf.end(), u(rng)) - cdf.begin() : (long long)(rng() % rows);
      int64_t id = ids[zipf ? rank_row[r] : r];
      if (seen.emplace(id, 0).second) out.push_back(id);
    }
    return out;
  };
  std::vector<uint8_t> out((size_t)batch * row);
  auto read_phase = [&](bool zipf) {
    std::vector<std::vector<int64_t>> work(batches);
    for (auto& w : work) w = draw(zipf);
    e->reopen();
    drop_cache(dir);
    double t = now();
    for (auto& w : work) e->get(w.data(), out.data(), batch);
    return now() - t;
  };
  double uniform_s = read_phase(false), zipf_s = read_phase(true);

  // rewrites of existing rows (uniform), settled
  std::vector<std::vector<int64_t>> work(batches);
  for (auto& w : work) w = draw(false);
  e->reopen();
  drop_cache(dir);
  w0 = io_write_bytes();
  t0 = now();
  for (auto& w : work) e->put(w.data(), data.data(), batch);
  e->settle();
  double update_s = now() - t0;
  long long update_written = io_write_bytes() - w0;
  double moved = (double)batch * batches * row;
  printf("{\"engine\": \"%s\", \"rows\": %lld, \"row_bytes\": %zu, \"batch\": %d, \"batches\": %d, "
         "\"threads\": %d, \"load_rows_per_s\": %.0f, \"load_written_over_raw\": %.3f, "
         "\"disk_over_raw\": %.3f, \"read_uniform_rows_per_s\": %.0f, \"read_zipf_rows_per_s\": %.0f, "
         "\"update_rows_per_s\": %.0f, \"update_written_over_raw\": %.3f}\n",
         name.c_str(), rows, row, batch, batches, omp_get_max_threads(), rows / load_s,
         load_written / ((double)rows * row), disk / ((double)rows * row), batch * batches / uniform_s,
         batch * batches / zipf_s, batch * batches / update_s, update_written / moved);
  return 0;
}
