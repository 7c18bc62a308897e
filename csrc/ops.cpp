// fastgate._C: CPU hot paths (docs/ARCHITECTURE.md, Ops): the gates' AIS and word alignment (ops 3 and 4) and
// eigenscore (op 2), the engine's layer ops over bf16 and float32 (ops 6 to 8: decode and prefill attention, norm,
// rotary) and its quantized products (op 9), their rows split over one pool of threads (WorkerPool).
//
// Every function here has a reference that must give the same result: the CPU ops a pure-Python twin in
// fastgate/ops/_python.py (tests/test_ops_parity.py), the tensor ops a torch one in fastgate/ops/reference.py
// (tests/test_decode_attention.py, test_layer_ops.py, test_prefill_attention.py).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

constexpr uint32_t kReplacement = 0xFFFD;

// Same predicate as Python's str.isalnum() on one character, so both backends agree on every code point.
inline bool is_alnum(uint32_t cp) { return Py_UNICODE_ISALNUM(static_cast<Py_UCS4>(cp)); }

inline bool in_range(uint8_t b, uint8_t lo, uint8_t hi) { return b >= lo && b <= hi; }

// Decodes UTF-8 with "maximal subpart" replacement (Unicode §3.9, as CPython's errors="replace"), recording for
// each character the index of the piece that holds its first byte.
void decode_utf8(const std::vector<uint8_t>& bytes, const std::vector<int>& byte_owner, std::vector<uint32_t>& cps,
                 std::vector<int>& owner) {
  size_t i = 0, n = bytes.size();
  while (i < n) {
    uint8_t b = bytes[i];
    int start_owner = byte_owner[i];
    if (b < 0x80) {
      cps.push_back(b);
      owner.push_back(start_owner);
      ++i;
      continue;
    }
    int need;
    uint8_t lo = 0x80, hi = 0xBF;
    uint32_t cp;
    if (in_range(b, 0xC2, 0xDF)) {
      need = 1; cp = b & 0x1F;
    } else if (b == 0xE0) {
      need = 2; cp = b & 0x0F; lo = 0xA0;
    } else if (in_range(b, 0xE1, 0xEC) || in_range(b, 0xEE, 0xEF)) {
      need = 2; cp = b & 0x0F;
    } else if (b == 0xED) {
      need = 2; cp = b & 0x0F; hi = 0x9F;
    } else if (b == 0xF0) {
      need = 3; cp = b & 0x07; lo = 0x90;
    } else if (in_range(b, 0xF1, 0xF3)) {
      need = 3; cp = b & 0x07;
    } else if (b == 0xF4) {
      need = 3; cp = b & 0x07; hi = 0x8F;
    } else {
      cps.push_back(kReplacement);
      owner.push_back(start_owner);
      ++i;
      continue;
    }
    size_t j = i + 1;
    bool ok = true;
    for (int k = 0; k < need; ++k, ++j) {
      uint8_t lo_k = k == 0 ? lo : 0x80, hi_k = k == 0 ? hi : 0xBF;
      if (j >= n || !in_range(bytes[j], lo_k, hi_k)) {
        ok = false;
        break;
      }
      cp = (cp << 6) | (bytes[j] & 0x3F);
    }
    cps.push_back(ok ? cp : kReplacement);
    owner.push_back(start_owner);
    i = j;  // on failure j points at the offending byte, which starts the next character
  }
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

struct Alignment {
  std::vector<std::string> words;
  std::vector<int> word_ids;
};

// Core of align_words over decoded characters: `owner[c]` is the piece holding character c.
Alignment align_codepoints(const std::vector<uint32_t>& cps, const std::vector<int>& owner, size_t n_pieces) {
  const size_t n = cps.size();
  std::vector<uint8_t> alnum(n);
  for (size_t i = 0; i < n; ++i) alnum[i] = is_alnum(cps[i]);
  std::vector<int> word_of(n, -1);
  Alignment out;
  out.word_ids.assign(n_pieces, -1);
  int current = -1;
  bool in_word = false;
  for (size_t i = 0; i < n; ++i) {
    bool joiner = (cps[i] == '\'' || cps[i] == '-') && i > 0 && i + 1 < n && alnum[i - 1] && alnum[i + 1];
    bool word_char = alnum[i] || joiner;
    if (!word_char) {
      in_word = false;
      continue;
    }
    if (!in_word) {
      out.words.emplace_back();
      current = static_cast<int>(out.words.size()) - 1;
      in_word = true;
    }
    append_utf8(out.words.back(), cps[i]);
    word_of[i] = current;
    int t = owner[i];
    if (out.word_ids[t] < 0) out.word_ids[t] = current;
  }
  return out;
}

// Decode one sequence's pieces (all str or all bytes) into code points and the piece owning each. Needs the GIL.
void collect_pieces(const py::list& pieces, std::vector<uint32_t>& cps, std::vector<int>& owner) {
  const size_t n_pieces = pieces.size();
  bool any_bytes = false, any_str = false;
  for (auto item : pieces) {
    if (PyBytes_Check(item.ptr())) any_bytes = true;
    else if (PyUnicode_Check(item.ptr())) any_str = true;
    else throw py::type_error("align_words: pieces must all be str or all be bytes, got " +
                              std::string(py::str(py::type::of(item).attr("__name__"))));
  }
  if (any_bytes && any_str) throw py::type_error("align_words: pieces must all be str or all be bytes, not a mix");
  if (any_bytes) {
    std::vector<uint8_t> bytes;
    std::vector<int> byte_owner;
    for (size_t t = 0; t < n_pieces; ++t) {
      char* buf;
      Py_ssize_t len;
      PyBytes_AsStringAndSize(pieces[t].ptr(), &buf, &len);
      for (Py_ssize_t k = 0; k < len; ++k) {
        bytes.push_back(static_cast<uint8_t>(buf[k]));
        byte_owner.push_back(static_cast<int>(t));
      }
    }
    decode_utf8(bytes, byte_owner, cps, owner);
  } else {
    for (size_t t = 0; t < n_pieces; ++t) {
      PyObject* s = pieces[t].ptr();
      Py_ssize_t len = PyUnicode_GET_LENGTH(s);
      int kind = PyUnicode_KIND(s);
      const void* data = PyUnicode_DATA(s);
      for (Py_ssize_t k = 0; k < len; ++k) {
        cps.push_back(PyUnicode_READ(kind, data, k));
        owner.push_back(static_cast<int>(t));
      }
    }
  }
}

py::tuple align_words(const py::list& pieces) {
  std::vector<uint32_t> cps;
  std::vector<int> owner;
  collect_pieces(pieces, cps, owner);
  Alignment a = align_codepoints(cps, owner, pieces.size());
  py::list words;
  for (auto& w : a.words) words.append(py::str(w));
  return py::make_tuple(words, py::cast(a.word_ids));
}

// Mean log-prob of each word's tokens; a word that owns no token gets 0 (the rule of word_logprobs).
std::vector<float> mean_per_word(const std::vector<double>& lp, const std::vector<int>& ids, size_t n_words) {
  std::vector<double> sum(n_words, 0.0);
  std::vector<int64_t> cnt(n_words, 0);
  for (size_t t = 0; t < ids.size(); ++t) {
    if (ids[t] < 0) continue;
    sum[ids[t]] += lp[t];
    cnt[ids[t]] += 1;
  }
  std::vector<float> out(n_words);
  for (size_t w = 0; w < n_words; ++w) out[w] = cnt[w] ? static_cast<float>(sum[w] / cnt[w]) : 0.0f;
  return out;
}

// align_words + word_logprobs for many sequences in one call; the work between reading the inputs and building the
// results runs without the GIL.
py::list align_word_logprobs_batch(const py::list& batch_pieces, const py::list& batch_logprobs) {
  const size_t B = batch_pieces.size();
  if (batch_logprobs.size() != B)
    throw std::invalid_argument("align_word_logprobs_batch: " + std::to_string(B) + " piece lists but " +
                                std::to_string(batch_logprobs.size()) + " log-prob arrays");
  std::vector<std::vector<uint32_t>> cps(B);
  std::vector<std::vector<int>> owner(B);
  std::vector<std::vector<double>> lps(B);
  std::vector<size_t> n_pieces(B);
  for (size_t b = 0; b < B; ++b) {
    py::list pieces = batch_pieces[b].cast<py::list>();
    n_pieces[b] = pieces.size();
    collect_pieces(pieces, cps[b], owner[b]);
    auto arr = py::array_t<double, py::array::c_style | py::array::forcecast>::ensure(batch_logprobs[b]);
    if (!arr || arr.ndim() != 1)
      throw std::invalid_argument("align_word_logprobs_batch: log-probs of sequence " + std::to_string(b) +
                                  " must be a 1-D array");
    if (static_cast<size_t>(arr.shape(0)) != n_pieces[b])
      throw std::invalid_argument("align_word_logprobs_batch: sequence " + std::to_string(b) + " has " +
                                  std::to_string(n_pieces[b]) + " pieces but " + std::to_string(arr.shape(0)) +
                                  " log-probs");
    lps[b].assign(arr.data(), arr.data() + arr.shape(0));
  }
  std::vector<Alignment> al(B);
  std::vector<std::vector<float>> wlp(B);
  {
    py::gil_scoped_release release;
    for (size_t b = 0; b < B; ++b) {
      al[b] = align_codepoints(cps[b], owner[b], n_pieces[b]);
      wlp[b] = mean_per_word(lps[b], al[b].word_ids, al[b].words.size());
    }
  }
  py::list out;
  for (size_t b = 0; b < B; ++b) {
    py::list words;
    for (auto& w : al[b].words) words.append(py::str(w));
    py::array_t<float> lp(static_cast<py::ssize_t>(wlp[b].size()));
    std::copy(wlp[b].begin(), wlp[b].end(), lp.mutable_data());
    out.append(py::make_tuple(words, py::cast(al[b].word_ids), lp));
  }
  return out;
}

py::array_t<float> word_logprobs(py::array_t<double, py::array::c_style | py::array::forcecast> logprobs,
                                 py::array_t<int64_t, py::array::c_style | py::array::forcecast> word_ids,
                                 int64_t n_words) {
  if (logprobs.ndim() != 1 || word_ids.ndim() != 1)
    throw std::invalid_argument("word_logprobs: token_logprobs and word_ids must be 1-D");
  if (logprobs.shape(0) != word_ids.shape(0))
    throw std::invalid_argument("word_logprobs: token_logprobs has " + std::to_string(logprobs.shape(0)) +
                                " entries but word_ids has " + std::to_string(word_ids.shape(0)));
  const auto T = logprobs.shape(0);
  const double* lp = logprobs.data();
  const int64_t* ids = word_ids.data();
  int64_t W = n_words;
  if (W < 0) {
    W = 0;
    for (ssize_t t = 0; t < T; ++t) W = std::max(W, ids[t] + 1);
  }
  std::vector<double> sum(W, 0.0);
  std::vector<int64_t> cnt(W, 0);
  for (ssize_t t = 0; t < T; ++t) {
    if (ids[t] < 0) continue;
    if (ids[t] >= W) throw std::invalid_argument("word_logprobs: word id " + std::to_string(ids[t]) + " >= n_words " +
                                                 std::to_string(W));
    sum[ids[t]] += lp[t];
    cnt[ids[t]] += 1;
  }
  py::array_t<float> out(W);
  auto o = out.mutable_unchecked<1>();
  for (int64_t w = 0; w < W; ++w) o(w) = cnt[w] ? static_cast<float>(sum[w] / cnt[w]) : 0.0f;
  return out;
}

// The threads split_rows hands work to: started once (one per core but the caller's), kept, and woken per call. A
// thread started per call cost ~30 us (start and join), so a product of a batch-1 decode step (10-150 us of work)
// stayed on one thread, though two threads read ~1.7x one's bandwidth on the EPYCs here. A waiting worker spins for
// kSpinMicros, then polls yielding its core for kYieldMicros, before it sleeps on a condition variable: the products
// of a decode step come ~10-30 us apart, a step's Python part between them takes ~1 ms. Why not torch's pool
// (at::parallel_for): the extension does not link against torch. One caller at a time: a second (another Python
// thread, the GIL released) starts threads of its own as before. A fork's child gets a pool of its own (a forked
// process has only the forking thread).
class WorkerPool {
 public:
  typedef void (*Task)(void* ctx, int64_t t);

  // The process's pool (never destroyed: detached workers may still be waiting at exit); nullptr on a one-core
  // machine.
  static WorkerPool* get() {
    static std::atomic<WorkerPool*> pool{nullptr};
    static std::mutex made;
    WorkerPool* p = pool.load(std::memory_order_acquire);
    if (p != nullptr && p->pid_ == getpid()) return p;
    std::lock_guard<std::mutex> lock(made);
    p = pool.load(std::memory_order_acquire);
    if (p == nullptr || p->pid_ != getpid()) {  // the first call, or the first in a fork's child (the old one leaks)
      const int64_t cores = static_cast<int64_t>(std::thread::hardware_concurrency());
      p = cores > 1 ? new WorkerPool(cores - 1) : nullptr;
      pool.store(p, std::memory_order_release);
    }
    return p;
  }

  // task(ctx, t) for t = 0 .. n - 1, t = 0 on the caller's thread, each other t on a worker; false (nothing run) when
  // another caller holds the pool or n - 1 exceeds its workers.
  bool run(int64_t n, Task task, void* ctx) {
    if (n - 1 > workers_ || busy_.exchange(true, std::memory_order_acquire)) return false;
    task_ = task;
    ctx_ = ctx;
    remaining_.store(n - 1, std::memory_order_relaxed);
    // a ticket to each worker taking part (the task's fields are written first; a worker reads them after its
    // ticket moves, and no field changes until every such worker is done, so none runs a task twice or late)
    for (int64_t i = 1; i < n; ++i) slots_[i].ticket.fetch_add(1, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      { std::lock_guard<std::mutex> lock(mutex_); }
      wake_.notify_all();
    }
    task(ctx, 0);
    while (remaining_.load(std::memory_order_acquire) > 0) pause();
    busy_.store(false, std::memory_order_release);
    return true;
  }

  // Idle workers sleep at once instead of spinning, from now until spin(): the caller runs torch's own threads
  // between its calls (a prompt chunk's oneDNN products, copies, SwiGLU), which a spinning worker would take a core
  // from for up to kSpinMicros after each of its calls (norm, rotary embedding, attention).
  void rest() { resting_.store(true, std::memory_order_release); }
  // Idle workers spin again (the decode path: its calls come ~10-30 us apart, with no torch threads between).
  void spin() {
    if (resting_.load(std::memory_order_relaxed)) resting_.store(false, std::memory_order_relaxed);
  }

 private:
  // a decode step's C++ calls come ~10-30 us apart (50 us was no better at batch 1 on an AVX2-only EPYC, within its
  // noise; the spin takes a core from torch's own threads meanwhile: MKL's products right after a pooled call)
  static constexpr int64_t kSpinMicros = 200;
  // then it polls for kYieldMicros more, yielding its core between polls (sched_yield: another runnable thread, a
  // torch op's second thread, takes the core at once): a decode step's Python part between its C++ calls, ~0.7-1 ms
  // for SmolLM2 at batch 1, outlasted the spin, and the worker asleep woke 0.1-0.5 ms late each step (a futex on a
  // 2-core VM): 9.4 -> 7.8 ms a step with a 2 ms spin (an AVX2-only EPYC; rdtsc-instrumented worker pool)
  static constexpr int64_t kYieldMicros = 3000;

  explicit WorkerPool(int64_t workers) : workers_(workers), pid_(getpid()), slots_(new Slot[workers + 1]) {
    for (int64_t i = 1; i <= workers; ++i) std::thread([this, i] { loop(i); }).detach();
  }

  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  void loop(int64_t index) {
    std::atomic<uint64_t>& ticket = slots_[index].ticket;
    uint64_t seen = 0;  // the tickets' start: a first call may come before this thread runs
    for (;;) {
      // spin a while, then poll yielding the core a while longer, then sleep until the next ticket
      const auto start = std::chrono::steady_clock::now();
      const auto spun = start + std::chrono::microseconds(kSpinMicros);
      const auto until = start + std::chrono::microseconds(kYieldMicros);
      bool yielding = false;
      for (int i = 0; ticket.load(std::memory_order_acquire) == seen; ++i) {
        if (resting_.load(std::memory_order_relaxed)) break;  // rest(): sleep now
        if (!yielding) {
          pause();
          if ((i & 255) == 255 && std::chrono::steady_clock::now() > spun) yielding = true;
        } else {
          if (std::chrono::steady_clock::now() > until) break;
          std::this_thread::yield();
        }
      }
      if (ticket.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleeping_.fetch_add(1, std::memory_order_seq_cst);
        while (ticket.load(std::memory_order_seq_cst) == seen) wake_.wait(lock);
        sleeping_.fetch_sub(1, std::memory_order_relaxed);
      }
      seen = ticket.load(std::memory_order_acquire);
      task_(ctx_, index);
      remaining_.fetch_sub(1, std::memory_order_release);
    }
  }

  struct alignas(64) Slot {  // a cache line each: a worker spins on its own
    std::atomic<uint64_t> ticket{0};
  };

  const int64_t workers_;
  const pid_t pid_;
  std::unique_ptr<Slot[]> slots_;  // [1 .. workers]
  std::atomic<bool> busy_{false};
  std::atomic<int64_t> remaining_{0};
  std::atomic<int64_t> sleeping_{0};
  std::atomic<bool> resting_{false};  // rest() .. spin(): idle workers sleep instead of spinning
  Task task_ = nullptr;
  void* ctx_ = nullptr;
  std::mutex mutex_;
  std::condition_variable wake_;
};

// The threads split_rows may use for a call allowed max_threads (0: one per core).
inline int64_t usable_threads(int64_t max_threads) {
  // read once: hardware_concurrency() parses /sys on every call (~5 us, more than a batch-1 op's own work)
  static const int64_t cores = std::max<int64_t>(1, static_cast<int64_t>(std::thread::hardware_concurrency()));
  return max_threads > 0 ? std::min(cores, max_threads) : cores;
}

// Runs worker(first, step) on up to one thread per core, the caller's thread included: thread t takes the rows
// t, t + step, ... of B independent rows. Threads join only when `work` (a rough count of multiply-adds) pays for
// them, one per `grain`, and at most `max_threads` (0: one per core); they come from the WorkerPool (threads started
// for the call where another caller holds it). Returns whether every worker returned true. Call with the GIL
// released.
template <class Worker>
bool split_rows(int64_t B, int64_t work, int64_t grain, Worker worker, int64_t max_threads = 0) {
  const int64_t hw = usable_threads(max_threads);
  const int64_t n_threads = std::max<int64_t>(1, std::min<int64_t>({hw, B, work / grain}));
  if (n_threads == 1) return worker(0, 1);
  std::vector<char> ok(n_threads, 1);
  auto run = [&](int64_t t) { ok[t] = worker(t, n_threads) ? 1 : 0; };
  WorkerPool* pool = WorkerPool::get();
  const WorkerPool::Task task = [](void* ctx, int64_t t) { (*static_cast<decltype(run)*>(ctx))(t); };
  if (pool == nullptr || !pool->run(n_threads, task, &run)) {
    std::vector<std::thread> threads;
    for (int64_t t = 1; t < n_threads; ++t) threads.emplace_back(run, t);
    run(0);
    for (auto& th : threads) th.join();
  }
  return std::all_of(ok.begin(), ok.end(), [](char v) { return v != 0; });
}

// The worker pool's idle workers sleep at once until pool_spin() (WorkerPool::rest): called before a product on
// torch's own threads. pool_spin: they spin again, called by the decode path's products and layer stacks.
void pool_rest() {
  if (WorkerPool* pool = WorkerPool::get()) pool->rest();
}
void pool_spin() {
  if (WorkerPool* pool = WorkerPool::get()) pool->spin();
}

enum class AisMode { kAngle, kSum, kAdaptive };

AisMode parse_mode(const std::string& mode) {
  if (mode == "angle") return AisMode::kAngle;
  if (mode == "sum") return AisMode::kSum;
  if (mode == "adaptive") return AisMode::kAdaptive;
  throw std::invalid_argument("ais_scores: mode must be 'angle', 'sum' or 'adaptive', got '" + mode + "'");
}

// DTR's released reranker (agent/reranker.py, consider_adaptive=True): alpha = slope * arccos(q·p) + intercept
constexpr double kAdaptiveSlope = 0.05848, kAdaptiveIntercept = 0.45520;

inline double clip1(double x) { return x < -1.0 ? -1.0 : (x > 1.0 ? 1.0 : x); }

// On x86-64 glibc, GCC builds the functions marked FASTGATE_CLONES twice, for AVX2+FMA (x86-64-v3) and for the
// baseline, and an ifunc picks one when the module loads: the build stays portable while a modern CPU gets 8-wide
// FMAs. Elsewhere only the baseline.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__GLIBC__)
#define FASTGATE_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define FASTGATE_CLONES
#endif

typedef float f32x8 __attribute__((vector_size(32)));

inline f32x8 load8(const float* src) {
  f32x8 v;
  __builtin_memcpy(&v, src, sizeof v);  // unaligned: rows start anywhere in the caller's array
  return v;
}

typedef double f64x4 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));

inline f64x4 widen4(const float* src) {
  f32x4 v;
  __builtin_memcpy(&v, src, sizeof v);  // unaligned: rows start anywhere in the caller's array
  return __builtin_convertvector(v, f64x4);
}

// s1 = x·q and s2 = x·p over d features, in double as the reference computes them: a product of two floats is exact
// in double, and the sums then round ~1e-16 apart. In float32 (8-wide, as before) they were ~1e-7 apart, which the
// angle's sqrt(1 − s²) turns into 1.7e-4 for nearly parallel vectors. AIS scores a question's few candidates, so the
// halved width costs nothing that shows. Two independent 4-double accumulators per dot product: a single one would
// chain every add on the previous one.
FASTGATE_CLONES
void dot2(const float* x, const float* q, const float* p, int64_t d, double* s1, double* s2) {
  f64x4 a1 = {}, a2 = {}, b1 = {}, b2 = {};
  int64_t k = 0;
  for (; k + 8 <= d; k += 8) {
    const f64x4 x0 = widen4(x + k), x1 = widen4(x + k + 4);
    a1 += x0 * widen4(q + k);
    a2 += x0 * widen4(p + k);
    b1 += x1 * widen4(q + k + 4);
    b2 += x1 * widen4(p + k + 4);
  }
  const f64x4 c1 = a1 + b1, c2 = a2 + b2;
  double t1 = (c1[0] + c1[1]) + (c1[2] + c1[3]), t2 = (c2[0] + c2[1]) + (c2[2] + c2[3]);
  for (; k < d; ++k) {
    t1 += static_cast<double>(x[k]) * static_cast<double>(q[k]);
    t2 += static_cast<double>(x[k]) * static_cast<double>(p[k]);
  }
  *s1 = t1;
  *s2 = t2;
}

// out[j] = AIS(docs[j]; q, p) for n documents of dimension d. Returns false if an input is NaN or inf: q and p are
// checked up front, and a non-finite document element makes s1 NaN or inf (inf·0 is NaN), so checking s1 covers docs.
bool ais_block(const float* q, const float* p, const float* docs, int64_t n, int64_t d, AisMode mode, float* out) {
  double qsum = 0.0, psum = 0.0;
  for (int64_t k = 0; k < d; ++k) {
    qsum += q[k] * 0.0;
    psum += p[k] * 0.0;
  }
  if (!std::isfinite(qsum) || !std::isfinite(psum)) return false;
  double alpha = 0.0;  // adaptive: the weight of the angle to q, from the angle between q and p (float64, once)
  if (mode == AisMode::kAdaptive) {
    double s0 = 0.0;
    for (int64_t k = 0; k < d; ++k) s0 += static_cast<double>(q[k]) * static_cast<double>(p[k]);
    alpha = kAdaptiveSlope * std::acos(clip1(s0)) + kAdaptiveIntercept;
  }
  for (int64_t j = 0; j < n; ++j) {
    double s1, s2;
    dot2(docs + j * d, q, p, d, &s1, &s2);
    if (!std::isfinite(s1) || !std::isfinite(s2)) return false;
    s1 = clip1(s1);
    s2 = clip1(s2);
    double v;
    switch (mode) {
      case AisMode::kAngle:
        v = s1 * s2 - std::sqrt(1.0 - s1 * s1) * std::sqrt(1.0 - s2 * s2);
        break;
      case AisMode::kAdaptive:
        v = -(alpha * std::acos(s1) + (1.0 - alpha) * std::acos(s2));
        break;
      default:
        v = s1 + s2;
    }
    out[j] = static_cast<float>(v);
  }
  return true;
}

using FArray = py::array_t<float, py::array::c_style | py::array::forcecast>;

py::array_t<float> ais_scores(FArray q, FArray p, FArray docs, const std::string& mode) {
  AisMode m = parse_mode(mode);
  if (q.ndim() != 1 || p.ndim() != 1 || docs.ndim() != 2)
    throw std::invalid_argument("ais_scores: expected q [d], p [d], docs [n, d]");
  const int64_t d = q.shape(0), n = docs.shape(0);
  if (p.shape(0) != d || docs.shape(1) != d)
    throw std::invalid_argument("ais_scores: dimension mismatch: q has d=" + std::to_string(d) + ", p has d=" +
                                std::to_string(p.shape(0)) + ", docs has d=" + std::to_string(docs.shape(1)));
  py::array_t<float> out(n);
  float* o = out.mutable_data();
  const float *qd = q.data(), *pd = p.data(), *dd = docs.data();
  bool ok;
  {
    py::gil_scoped_release release;
    ok = ais_block(qd, pd, dd, n, d, m, o);
  }
  if (!ok) throw std::invalid_argument("ais_scores: inputs contain NaN or inf");
  return out;
}

py::array_t<float> ais_scores_batch(FArray Q, FArray P, FArray D, const std::string& mode) {
  AisMode m = parse_mode(mode);
  if (Q.ndim() != 2 || P.ndim() != 2 || D.ndim() != 3)
    throw std::invalid_argument("ais_scores_batch: expected Q [B, d], P [B, d], D [B, n, d]");
  const int64_t B = Q.shape(0), d = Q.shape(1), n = D.shape(1);
  if (P.shape(0) != B || D.shape(0) != B)
    throw std::invalid_argument("ais_scores_batch: batch mismatch: Q has B=" + std::to_string(B) + ", P has " +
                                std::to_string(P.shape(0)) + ", D has " + std::to_string(D.shape(0)));
  if (P.shape(1) != d || D.shape(2) != d)
    throw std::invalid_argument("ais_scores_batch: dimension mismatch: Q has d=" + std::to_string(d) + ", P has " +
                                std::to_string(P.shape(1)) + ", D has " + std::to_string(D.shape(2)));
  py::array_t<float> out({B, n});
  float* o = out.mutable_data();
  const float *qd = Q.data(), *pd = P.data(), *dd = D.data();
  bool ok = true;
  {
    py::gil_scoped_release release;
    // rows are independent: split them over threads when there is enough work to pay for starting them
    ok = split_rows(B, B * n * d, 1 << 18, [&](int64_t first, int64_t step) {
      for (int64_t b = first; b < B; b += step)
        if (!ais_block(qd + b * d, pd + b * d, dd + b * n * d, n, d, m, o + b * n)) return false;
      return true;
    });
  }
  if (!ok) throw std::invalid_argument("ais_scores_batch: inputs contain NaN or inf");
  return out;
}

// AIS scores and the top-k documents of each row, best first (ties: the lower index first).
py::tuple ais_topk_batch(FArray Q, FArray P, FArray D, int64_t k, const std::string& mode) {
  if (k < 1) throw std::invalid_argument("ais_topk_batch: k must be >= 1, got " + std::to_string(k));
  py::array_t<float> scores = ais_scores_batch(Q, P, D, mode);
  const int64_t B = scores.shape(0), n = scores.shape(1), kk = std::min(k, n);
  py::array_t<float> top_s({B, kk});
  py::array_t<int64_t> top_i({B, kk});
  const float* s = scores.data();
  float* os = top_s.mutable_data();
  int64_t* oi = top_i.mutable_data();
  {
    py::gil_scoped_release release;
    std::vector<int64_t> order(n);
    for (int64_t b = 0; b < B; ++b) {
      const float* row = s + b * n;
      for (int64_t j = 0; j < n; ++j) order[j] = j;
      std::partial_sort(order.begin(), order.begin() + kk, order.end(), [row](int64_t x, int64_t y) {
        return row[x] > row[y] || (row[x] == row[y] && x < y);
      });
      for (int64_t j = 0; j < kk; ++j) {
        os[b * kk + j] = row[order[j]];
        oi[b * kk + j] = order[j];
      }
    }
  }
  return py::make_tuple(top_s, top_i);
}

// ------------------------------------------------------------------------------------------------ eigenscore
// features per block: the k rows of one block, widened to double, stay in L1/L2 while every pair is formed
constexpr int64_t kGramChunk = 256;

inline f64x4 load4d(const double* src) {
  f64x4 v;
  __builtin_memcpy(&v, src, sizeof v);
  return v;
}

inline double hsum(f64x4 a) { return (a[0] + a[1]) + (a[2] + a[3]); }

// G[i, j] += rows[i] · rows[j] for j >= i, over k rows of n doubles (n a multiple of 4, `stride` apart). Two rows i
// are paired with four rows j at a time: six loads feed eight independent accumulators, so neither the loads nor the
// add latency of one long chain limit the FMAs. Entries below the diagonal that a block touches are left over and
// never read.
FASTGATE_CLONES
void gram_upper(const double* rows, int64_t k, int64_t n, int64_t stride, double* G) {
  for (int64_t i = 0; i < k; i += 2) {
    const bool two = i + 1 < k;
    const double* y0 = rows + i * stride;
    const double* y1 = two ? y0 + stride : y0;  // a lone last row is paired with itself and stored once
    int64_t j = i;
    for (; j + 4 <= k; j += 4) {
      const double* x0 = rows + j * stride;
      const double* x1 = x0 + stride;
      const double* x2 = x1 + stride;
      const double* x3 = x2 + stride;
      f64x4 a00 = {}, a01 = {}, a02 = {}, a03 = {}, a10 = {}, a11 = {}, a12 = {}, a13 = {};
      for (int64_t t = 0; t < n; t += 4) {
        const f64x4 u = load4d(y0 + t), v = load4d(y1 + t);
        const f64x4 w0 = load4d(x0 + t), w1 = load4d(x1 + t), w2 = load4d(x2 + t), w3 = load4d(x3 + t);
        a00 += u * w0;
        a01 += u * w1;
        a02 += u * w2;
        a03 += u * w3;
        a10 += v * w0;
        a11 += v * w1;
        a12 += v * w2;
        a13 += v * w3;
      }
      double* g0 = G + i * k + j;
      g0[0] += hsum(a00);
      g0[1] += hsum(a01);
      g0[2] += hsum(a02);
      g0[3] += hsum(a03);
      if (two) {
        double* g1 = g0 + k;
        g1[0] += hsum(a10);
        g1[1] += hsum(a11);
        g1[2] += hsum(a12);
        g1[3] += hsum(a13);
      }
    }
    for (; j < k; ++j) {
      const double* x = rows + j * stride;
      f64x4 a0 = {}, a1 = {};
      for (int64_t t = 0; t < n; t += 4) {
        const f64x4 w = load4d(x + t);
        a0 += load4d(y0 + t) * w;
        a1 += load4d(y1 + t) * w;
      }
      G[i * k + j] += hsum(a0);
      if (two) G[(i + 1) * k + j] += hsum(a1);
    }
  }
}

// dst[0:n] = src[0:n] widened to double, zeros up to `padded`; returns their sum. Four lanes and two accumulators:
// a single running sum would make every add wait for the previous one.
FASTGATE_CLONES
double widen_row(const float* src, int64_t n, int64_t padded, double* dst) {
  f64x4 a0 = {}, a1 = {};
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const f64x4 dlo = widen4(src + t), dhi = widen4(src + t + 4);
    __builtin_memcpy(dst + t, &dlo, sizeof dlo);
    __builtin_memcpy(dst + t + 4, &dhi, sizeof dhi);
    a0 += dlo;
    a1 += dhi;
  }
  const f64x4 a = a0 + a1;
  double sum = (a[0] + a[1]) + (a[2] + a[3]);
  for (; t < n; ++t) {
    dst[t] = src[t];
    sum += dst[t];
  }
  for (; t < padded; ++t) dst[t] = 0.0;
  return sum;
}

// One request of SeaKR's eigenscore: logdet(Zc Zcᵀ·scale + αI) / k' over the k' valid rows of z [k, d] (float32),
// each row centred over its d features. Each row's mean is taken first (in double); rows are then widened to double
// a block of features at a time, centred as they are widened, and the Gram matrix of the centred rows accumulated in
// double, as the reference computes it. (The rank-one correction Z Zᵀ - s sᵀ / d subtracted two numbers of size
// d·|z|²: with a large offset shared by the rows, 1e6 + noise, its rounding outgrew the ridge α and the Cholesky
// met a negative pivot: NaN.) Returns false if the Gram matrix is not finite (a NaN or inf anywhere in z, dropped
// rows included).
// `buf` holds k × kGramChunk doubles; G k × k; s k.
bool eigenscore_one(const float* z, const uint8_t* valid, int64_t k, int64_t d, double alpha, double scale,
                    std::vector<double>& buf, std::vector<double>& G, std::vector<double>& s, float* out) {
  std::fill(G.begin(), G.end(), 0.0);
  for (int64_t i = 0; i < k; ++i) {  // s: each row's mean, in double
    double sum = 0.0;
    for (int64_t t = 0; t < d; ++t) sum += z[i * d + t];
    s[i] = d > 0 ? sum / static_cast<double>(d) : 0.0;
  }
  for (int64_t start = 0; start < d; start += kGramChunk) {
    const int64_t n = std::min<int64_t>(kGramChunk, d - start);
    const int64_t padded = (n + 3) / 4 * 4;
    for (int64_t i = 0; i < k; ++i) {
      double* row = buf.data() + i * kGramChunk;
      widen_row(z + i * d + start, n, padded, row);
      for (int64_t t = 0; t < n; ++t) row[t] -= s[i];  // centred; the padding stays 0
    }
    gram_upper(buf.data(), k, padded, kGramChunk, G.data());
  }
  for (int64_t i = 0; i < k; ++i)
    for (int64_t j = i; j < k; ++j) {
      const double g = G[i * k + j];
      if (!std::isfinite(g)) return false;
      G[i * k + j] = G[j * k + i] = g;
    }
  // dropped rows become identity rows/columns: they add log(1) = 0
  int64_t n_valid = 0;
  for (int64_t i = 0; i < k; ++i) {
    n_valid += valid[i] != 0;
    for (int64_t j = 0; j < k; ++j) {
      const bool both = valid[i] && valid[j];
      double a = both ? G[i * k + j] * scale : 0.0;
      if (i == j) a += valid[i] ? alpha : 1.0;
      G[i * k + j] = a;
    }
  }
  if (n_valid == 0) {
    *out = std::numeric_limits<float>::infinity();
    return true;
  }
  // Cholesky in place (lower triangle): logdet = Σ log(pivot); the matrix is a PSD Gram plus a positive diagonal
  double logdet = 0.0;
  for (int64_t j = 0; j < k; ++j) {
    double pivot = G[j * k + j];
    for (int64_t p = 0; p < j; ++p) pivot -= G[j * k + p] * G[j * k + p];
    logdet += std::log(pivot);  // a non-positive pivot (impossible in exact arithmetic) gives NaN, not a crash
    const double root = std::sqrt(pivot);
    for (int64_t i = j + 1; i < k; ++i) {
      double v = G[i * k + j];
      for (int64_t p = 0; p < j; ++p) v -= G[i * k + p] * G[j * k + p];
      G[i * k + j] = v / root;
    }
    G[j * k + j] = root;
  }
  *out = static_cast<float>(logdet / static_cast<double>(n_valid));
  return true;
}

using U8Array = py::array_t<uint8_t, py::array::c_style | py::array::forcecast>;

py::array_t<float> eigenscore(FArray z, U8Array valid, double alpha, bool cov) {
  if (z.ndim() != 3) throw std::invalid_argument("eigenscore: z must be [B, k, d]");
  const int64_t B = z.shape(0), k = z.shape(1), d = z.shape(2);
  if (k < 1 || d < 2)
    throw std::invalid_argument("eigenscore: need k >= 1 samples of d >= 2 features, got k=" + std::to_string(k) +
                                ", d=" + std::to_string(d));
  if (!(alpha > 0)) throw std::invalid_argument("eigenscore: alpha must be > 0");
  if (valid.ndim() != 2 || valid.shape(0) != B || valid.shape(1) != k)
    throw std::invalid_argument("eigenscore: valid must be [" + std::to_string(B) + ", " + std::to_string(k) + "]");
  const double scale = cov ? 1.0 / static_cast<double>(d - 1) : 1.0;  // INSIDE's covariance form, or SeaKR's Gram
  py::array_t<float> out(B);
  float* o = out.mutable_data();
  const float* zd = z.data();
  const uint8_t* vd = valid.data();
  bool ok = true;
  {
    py::gil_scoped_release release;
    ok = split_rows(B, B * k * k * d / 2, 1 << 20, [&](int64_t first, int64_t step) {
      std::vector<double> buf(k * kGramChunk), G(k * k), s(k);  // per thread
      for (int64_t b = first; b < B; b += step)
        if (!eigenscore_one(zd + b * k * d, vd + b * k, k, d, alpha, scale, buf, G, s, o + b)) return false;
      return true;
    });
  }
  if (!ok) throw std::invalid_argument("eigenscore: z contains NaN or inf (or values whose squares overflow float64)");
  return out;
}

// ---------------------------------------------------------------------------------------------- decode attention
// The packed pass's decode rows attend over a bf16 key / value store on a CPU. torch has no kernel that reads bf16
// and accumulates in float32 fast on a CPU without AMX (its bf16 SDPA runs ~6x slower than float32 there), so the
// engine used to cast each layer's K / V to float32 first: three passes over the cache (read bf16, write and read
// float32) where one is enough. This reads each key and value once, widening bf16 to float32 in registers (a bf16
// is the top half of a float32), for the G query heads that share a key / value head together.
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
}

inline float hsum8(f32x8 a) {
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

typedef int32_t i32x8 __attribute__((vector_size(32)));

// The vector types of one width (8 floats: the clones'; 16: AVX-512's), and bf16 widened to float32 a vector at a
// time (a bf16 is the top half of a float32).
#define FASTGATE_INLINE inline __attribute__((always_inline))

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

struct Vec8 {
  typedef f32x8 F;
  typedef i32x8 I;
  typedef u32x8 U32;
  typedef u16x8 U16;
  static constexpr int N = 8;
};
struct Vec16 {
  typedef f32x16 F;
  typedef i32x16 I;
  typedef u32x16 U32;
  typedef u16x16 U16;
  static constexpr int N = 16;
};

template <class V>
FASTGATE_INLINE typename V::F load_bf16v(const uint16_t* src) {
  typename V::U16 h;
  __builtin_memcpy(&h, src, sizeof h);
  const typename V::U32 u = __builtin_convertvector(h, typename V::U32) << 16;
  typename V::F f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
}

// A vector of V's floats from bf16 or float32 elements, and one element as float32: the loops below that read either
// (a bf16 store or a float32 one, bf16 rows or float32 rows) are written once over the element type.
template <class V>
FASTGATE_INLINE typename V::F loadv(const uint16_t* src) { return load_bf16v<V>(src); }
template <class V>
FASTGATE_INLINE typename V::F loadv(const float* src) {
  typename V::F f;
  __builtin_memcpy(&f, src, sizeof f);  // unaligned
  return f;
}
FASTGATE_INLINE float to_f32(uint16_t h) { return bf16_to_f32(h); }
FASTGATE_INLINE float to_f32(float f) { return f; }

// exp(x) for x <= 0 (scores less their maximum), a vector F (of floats; I: as many int32) at a time: 2^(x log2 e)
// split into 2^floor (the exponent bits) times a degree-6 polynomial for 2^frac (relative error ~2e-7); below -87 it
// flushes to ~0 as expf underflows. A scalar expf per score cost more than reading the keys.
template <class F, class I>
FASTGATE_INLINE F exp_nonpositive(F x) {
  const F lo = F{} - 87.0f;
  x = x < lo ? lo : x;
  const F t = x * 1.44269504088896341f;
  I ti = __builtin_convertvector(t, I);  // toward zero
  F tf = __builtin_convertvector(ti, F);
  ti += (tf > t);  // -1 where truncation rounded up: floor for negative t
  tf = __builtin_convertvector(ti, F);
  const F f = t - tf;  // [0, 1)
  F p = 1.535336188319500e-4f * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const I bits = (ti + 127) << 23;
  F scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline f32x8 exp8_nonpositive(f32x8 x) { return exp_nonpositive<f32x8, i32x8>(x); }

// The multiply-adds a thread of the decode rows' attention takes at least: ~20 us of work, where a WorkerPool thread
// joins for a few us (a thread started per call needed ~1M: SmolLM2's batch-1 step kept its 3 key / value heads on one
// thread up to ~1,800 columns)
constexpr int64_t kAttentionGrain = 1 << 18;
constexpr int64_t kPartColumns = 128;  // the fewest columns a part of a head's attention takes

// One row's key / value head: q [G, D] float32 (already scaled), k / v [n, D] bf16 rows `stride` apart; scores
// [G, n] scratch; out [G, D] float32. D <= kMaxD.
constexpr int64_t kMaxD = 256;

// One row of n scores becomes exp(score - max) in place (exp of non-positive numbers, in float32); returns the max
// and the exps' sum.
FASTGATE_INLINE std::pair<float, float> exp_row(float* sg, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t w = 0; w < n; ++w) mx = std::max(mx, sg[w]);
  const int64_t nv = n / 8 * 8;
  f32x8 vsum = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t w = 0; w < nv; w += 8) {
    f32x8 e = exp8_nonpositive(load8(sg + w) - mx);
    __builtin_memcpy(sg + w, &e, sizeof e);
    vsum += e;
  }
  float sum = hsum8(vsum);
  for (int64_t w = nv; w < n; ++w) {
    sg[w] = std::exp(sg[w] - mx);
    sum += sg[w];
  }
  return {mx, sum};
}

// Each of G rows of n scores (G x n, contiguous) becomes its softmax, in float32 (exp of non-positive numbers); with
// mx / sum given (G each), its exps instead, unnormalised, their max and sum there (a part of a row's columns, merged
// by the caller: merge_parts).
FASTGATE_CLONES
void softmax_rows(float* scores, int64_t n, int64_t G, float* mx = nullptr, float* sum = nullptr) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * n;
    const std::pair<float, float> ms = exp_row(sg, n);
    if (mx != nullptr) {
      mx[g] = ms.first;
      sum[g] = ms.second;
      continue;
    }
    const float inv = 1.0f / ms.second;
    for (int64_t w = 0; w < n; ++w) sg[w] *= inv;
  }
}

// mx / sum (G each; nullptr: none): the scores' exps unnormalised, their max and sum there (softmax_rows)
template <class T>
FASTGATE_INLINE void attend_head_t(const float* q, const T* k, const T* v, int64_t stride, int64_t n, int64_t G,
                                   int64_t D, float* scores, float* out, float* mx = nullptr, float* sum = nullptr) {
  const int64_t dv = D / 8 * 8;
  for (int64_t w = 0; w < n; ++w) {  // scores: each key row read once for the G heads
    const T* kw = k + w * stride;
    f32x8 kv[kMaxD / 8];
    for (int64_t j = 0; j < dv; j += 8) kv[j / 8] = loadv<Vec8>(kw + j);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      f32x8 acc = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t j = 0; j < dv; j += 8) acc += load8(qg + j) * kv[j / 8];
      float s = hsum8(acc);
      for (int64_t j = dv; j < D; ++j) s += qg[j] * to_f32(kw[j]);
      scores[g * n + w] = s;
    }
  }
  softmax_rows(scores, n, G, mx, sum);
  for (int64_t i = 0; i < G * D; ++i) out[i] = 0.0f;
  for (int64_t w = 0; w < n; ++w) {  // out: each value row read once for the G heads
    const T* vw = v + w * stride;
    f32x8 vv[kMaxD / 8];
    for (int64_t j = 0; j < dv; j += 8) vv[j / 8] = loadv<Vec8>(vw + j);
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * n + w];
      float* og = out + g * D;
      for (int64_t j = 0; j < dv; j += 8) {
        f32x8 o = load8(og + j) + p * vv[j / 8];
        __builtin_memcpy(og + j, &o, sizeof o);
      }
      for (int64_t j = dv; j < D; ++j) og[j] += p * to_f32(vw[j]);
    }
  }
}

// over a bf16 store (attend picks this or the AVX-512 form) and over a float32 one
FASTGATE_CLONES
void attend_head(const float* q, const uint16_t* k, const uint16_t* v, int64_t stride, int64_t n, int64_t G,
                 int64_t D, float* scores, float* out) {
  attend_head_t(q, k, v, stride, n, G, D, scores, out);
}

FASTGATE_CLONES
void attend_head_f32(const float* q, const float* k, const float* v, int64_t stride, int64_t n, int64_t G, int64_t D,
                     float* scores, float* out, float* mx = nullptr, float* sum = nullptr) {
  attend_head_t(q, k, v, stride, n, G, D, scores, out, mx, sum);
}

// The parts of a head's columns (attend_head_f32 with mx / sum) as its attention: o [parts][G][D] unnormalised,
// mx / sum [parts][G] -> out [G][D], each part's output and sum weighted by exp(its max - the max).
void merge_parts(const float* o, const float* mx, const float* sum, int64_t parts, int64_t G, int64_t D, float* out) {
  for (int64_t g = 0; g < G; ++g) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < parts; ++p) top = std::max(top, mx[p * G + g]);
    float den = 0.0f;
    float* og = out + g * D;
    for (int64_t i = 0; i < D; ++i) og[i] = 0.0f;
    for (int64_t p = 0; p < parts; ++p) {
      const float w = std::exp(mx[p * G + g] - top);
      den += w * sum[p * G + g];
      const float* op = o + (p * G + g) * D;
      for (int64_t i = 0; i < D; ++i) og[i] += w * op[i];
    }
    const float inv = 1.0f / den;
    for (int64_t i = 0; i < D; ++i) og[i] *= inv;
  }
}

// attend_head, or its AVX-512 form where the CPU has it and the shapes suit (defined with the AVX-512 code below)
void attend(const float* q, const uint16_t* k, const uint16_t* v, int64_t stride, int64_t n, int64_t G, int64_t D,
            float* scores, float* out);

// The most columns any of the m rows attends (positions checked to lie in the store's 0 .. cols - 1: the caller skips
// a host-side min / max a layer).
int64_t attended_width(const int64_t* pos, int64_t m, int64_t cols) {
  int64_t widest = 1;
  for (int64_t r = 0; r < m; ++r) {
    if (pos[r] < 0 || pos[r] >= cols)
      throw std::invalid_argument("decode_attention: positions must lie in 0.." + std::to_string(cols - 1));
    widest = std::max(widest, pos[r] + 1);
  }
  return widest;
}

// The shapes both decode attention entry points take: H a multiple of Hkv, 0 < D <= kMaxD.
void check_decode_shape(const char* name, int64_t m, int64_t H, int64_t Hkv, int64_t D) {
  if (m < 0 || H <= 0 || Hkv <= 0 || H % Hkv != 0 || D <= 0 || D > kMaxD)
    throw std::invalid_argument(std::string(name) + ": bad shape (H a multiple of Hkv, 0 < D <= 256)");
}

// q: [m, H, D] float32 contiguous; keys / values: bf16 with element strides (row, head, column) and unit stride over
// D, `cols` columns; pos: [m] int64, the last column each row attends (0 .. cols - 1, checked here: the caller skips
// a host-side min / max a layer); out: [m, H, D] float32 contiguous. Pointers come from
// torch tensors the caller checked (fastgate/ops/attention.py): this module does not link against torch. threads:
// at most that many (the caller passes torch's own count), 0: one per core.
void decode_attention_bf16(uintptr_t q_ptr, uintptr_t k_ptr, uintptr_t v_ptr, uintptr_t pos_ptr, uintptr_t out_ptr,
                           int64_t m, int64_t H, int64_t Hkv, int64_t D, int64_t cols, int64_t s_row, int64_t s_head,
                           int64_t s_col, double scale, int64_t threads) {
  check_decode_shape("decode_attention_bf16", m, H, Hkv, D);
  const float* q = reinterpret_cast<const float*>(q_ptr);
  const uint16_t* k = reinterpret_cast<const uint16_t*>(k_ptr);
  const uint16_t* v = reinterpret_cast<const uint16_t*>(v_ptr);
  const int64_t* pos = reinterpret_cast<const int64_t*>(pos_ptr);
  float* out = reinterpret_cast<float*>(out_ptr);
  const int64_t G = H / Hkv;
  const int64_t widest = attended_width(pos, m, cols);
  const float sc = static_cast<float>(scale);
  py::gil_scoped_release release;
  // threads from kAttentionGrain multiply-adds each (WorkerPool)
  split_rows(m * Hkv, m * Hkv * widest * D * G * 2, kAttentionGrain, [&](int64_t first, int64_t step) {
    std::vector<float> qs(G * D), scores(G * widest);  // per thread
    for (int64_t item = first; item < m * Hkv; item += step) {
      const int64_t r = item / Hkv, h = item % Hkv;
      const float* qr = q + (r * H + h * G) * D;  // the G query heads of key / value head h
      for (int64_t i = 0; i < G * D; ++i) qs[i] = qr[i] * sc;
      attend(qs.data(), k + r * s_row + h * s_head, v + r * s_row + h * s_head, s_col, pos[r] + 1, G, D,
                  scores.data(), out + (r * H + h * G) * D);
    }
    return true;
  }, threads);
}

// ---------------------------------------------------------------------------------------------- norm and rotary
// The fused pass's RMS norm and rotary embedding of bf16 rows, each in one call: as torch operations they were nine
// and seven a layer (a batch-1 decode step of SmolLM2 dispatched ~700 of them for ~1 ms). The arithmetic is HF's,
// rounding for rounding: every torch operation on bf16 computes in float32 and rounds to bf16 (to nearest even),
// so the rounding points are kept where the torch expressions have them. Only the norm's float32 sum of squares may
// add in another order than torch's reduction (its last bits, rarely a bf16 step of the output).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// The elementwise layer ops (rms_norm_bf16, rope_bf16) are written once over a vector type: 16
// floats a vector where the CPU has AVX-512 (checked once, at the first call), else 8 (the x86-64-v3 clone with
// AVX2, or the baseline). torch's own kernels run 16 wide on such a CPU: at 8 the C++ loops lost to them from ~16 rows.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
#define FASTGATE_AVX512 1
#define FASTGATE_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#endif

bool cpu_has_avx512() {
#ifdef FASTGATE_AVX512
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }();
  return ok;
#else
  return false;
#endif
}

// A test hook: 8 runs the 8-wide loops on an AVX-512 CPU too, so that one machine tests both widths.
std::atomic<int> g_max_width{16};

void set_max_vector_width(int64_t width) {
  if (width != 8 && width != 16) throw std::invalid_argument("set_max_vector_width: 8 or 16");
  g_max_width.store(static_cast<int>(width), std::memory_order_relaxed);
}

inline bool use_width16() { return cpu_has_avx512() && g_max_width.load(std::memory_order_relaxed) >= 16; }


// f32_to_bf16, a vector at a time (the same bits: nearest even, NaN kept a quiet NaN)
template <class V>
FASTGATE_INLINE typename V::U16 to_bf16v(typename V::F f) {
  typedef typename V::U32 U32;
  U32 u;
  __builtin_memcpy(&u, &f, sizeof u);
  const U32 nan = (U32)((u & 0x7fffffffu) > 0x7f800000u);  // all ones where NaN
  const U32 r = (((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) & ~nan) | (((u >> 16) | 0x40u) & nan);
  return __builtin_convertvector(r, typename V::U16);
}

template <class V>
FASTGATE_INLINE void store_bf16v(uint16_t* dst, typename V::F f) {
  const typename V::U16 h = to_bf16v<V>(f);
  __builtin_memcpy(dst, &h, sizeof h);
}

template <class V>
FASTGATE_INLINE typename V::F round_bf16v(typename V::F f) {
  const typename V::U32 u = __builtin_convertvector(to_bf16v<V>(f), typename V::U32) << 16;
  typename V::F r;
  __builtin_memcpy(&r, &u, sizeof r);
  return r;
}

// Each row function below once as a template and twice compiled: `name`8 (the clones) and `name`16 (AVX-512), and
// `name` picks one per call from the cached CPU check.
#ifdef FASTGATE_AVX512
#define FASTGATE_WIDTHS(name, params, args)                                             \
  FASTGATE_CLONES void name##8 params { name##_t<Vec8> args; }                          \
  FASTGATE_AVX512_TARGET void name##16 params { name##_t<Vec16> args; }                  \
  inline void name params {                                                             \
    if (use_width16()) name##16 args;                                                   \
    else name##8 args;                                                                  \
  }
#else
#define FASTGATE_WIDTHS(name, params, args)                    \
  FASTGATE_CLONES void name##8 params { name##_t<Vec8> args; } \
  inline void name params { name##8 args; }
#endif

// A row's sum of squares in torch's own order: at::native's vectorized_inner_sum over vectors of 8 floats (torch
// registers its sum kernel without an AVX-512 build, so 8 on AVX2 and AVX-512 CPUs alike): vectors 4i + k summed
// per k in a cascade of levels 16 steps long (multi_row_sum), the leftover vectors into k = 0, the four partials in
// order, then the scalar tail and the 8 lanes one by one. The squares of bf16 values are exact in float32, so this
// is torch's h.pow(2).mean(-1) bit for bit. (torch lengthens the levels only past 2^19 steps.) float32 rows: the same
// order, each square rounded to float32 before it is added (torch's pow makes a tensor of them): the caller compiles
// without contracting a product and a sum into one FMA (FASTGATE_F32_EXACT).
template <class V, class T>
FASTGATE_INLINE float torch_sum_squares(const T* xr, int64_t d) {
  typedef typename V::F F;
  constexpr int N = V::N;
  const int64_t vecs = d / N, steps = vecs / 4;
  F acc[4][4] = {};  // [level][partial]
  int64_t i = 0;
  for (; i + 16 <= steps;) {
    for (int j = 0; j < 16; ++j, ++i)
      for (int k = 0; k < 4; ++k) {
        const F v = loadv<V>(xr + (4 * i + k) * N);
        acc[0][k] += v * v;
      }
    for (int j = 1; j < 4; ++j) {
      for (int k = 0; k < 4; ++k) {
        acc[j][k] += acc[j - 1][k];
        acc[j - 1][k] = F{};
      }
      if ((i & (int64_t(15) << (4 * j))) != 0) break;
    }
  }
  for (; i < steps; ++i)
    for (int k = 0; k < 4; ++k) {
      const F v = loadv<V>(xr + (4 * i + k) * N);
      acc[0][k] += v * v;
    }
  for (int j = 1; j < 4; ++j)
    for (int k = 0; k < 4; ++k) acc[0][k] += acc[j][k];
  F part = acc[0][0];
  for (int64_t v = steps * 4; v < vecs; ++v) {
    const F x = loadv<V>(xr + v * N);
    part += x * x;
  }
  for (int k = 1; k < 4; ++k) part += acc[0][k];
  float sum = 0.0f;
  for (int64_t j = vecs * N; j < d; ++j) {
    const float v = to_f32(xr[j]);
    sum += v * v;
  }
  for (int k = 0; k < N; ++k) sum += part[k];
  return sum;
}

// The work (4 a value) a thread of the norm and the rotary embedding takes at least: ~32K values, ~25 us of one
// thread's loop. At 1 << 20 a prompt chunk of 512 rows (SmolLM2: 295K values a norm, 393K a rotary embedding) ran on
// one thread: 195 / 334 us a layer on a Zen 4 EPYC, 5% of a 512-token packed pass.
constexpr int64_t kElementwiseGrain = 1 << 17;

// One row of rms_norm_bf16; the scalar tail rounds alike.
template <class V>
FASTGATE_INLINE void rms_norm_row_t(const uint16_t* xr, const uint16_t* w, uint16_t* o, int64_t d, float e) {
  constexpr int N = V::N;
  // 8 wide in either width: torch's order (above); AVX-512VL runs the 8-float vectors in the 16-wide clone
  const float inv = 1.0f / std::sqrt(torch_sum_squares<Vec8>(xr, d) / static_cast<float>(d) + e);
  int64_t j = 0;
  for (; j + N <= d; j += N)
    store_bf16v<V>(o + j, load_bf16v<V>(w + j) * round_bf16v<V>(load_bf16v<V>(xr + j) * inv));
  for (; j < d; ++j) o[j] = f32_to_bf16(bf16_to_f32(w[j]) * round_bf16(bf16_to_f32(xr[j]) * inv));
}
FASTGATE_WIDTHS(rms_norm_row, (const uint16_t* xr, const uint16_t* w, uint16_t* o, int64_t d, float e),
                (xr, w, o, d, e))

// x: [rows, d] bf16, rows `x_stride` elements apart, unit stride along d; weight: [d] bf16; out: [rows, d] bf16
// contiguous. out = weight * bf16(x * rsqrt(mean(x^2) + eps)), the statistics in float32 (LlamaRMSNorm).
void rms_norm_bf16(uintptr_t x_ptr, uintptr_t w_ptr, uintptr_t out_ptr, int64_t rows, int64_t d, int64_t x_stride,
                   double eps, int64_t threads) {
  if (rows < 0 || d <= 0 || x_stride < d) throw std::invalid_argument("rms_norm_bf16: bad shape");
  const uint16_t* x = reinterpret_cast<const uint16_t*>(x_ptr);
  const uint16_t* w = reinterpret_cast<const uint16_t*>(w_ptr);
  uint16_t* out = reinterpret_cast<uint16_t*>(out_ptr);
  const float e = static_cast<float>(eps);
  py::gil_scoped_release release;
  split_rows(rows, rows * d * 4, kElementwiseGrain, [&](int64_t first, int64_t step) {
    for (int64_t r = first; r < rows; r += step) rms_norm_row(x + r * x_stride, w, out + r * d, d, e);
    return true;
  }, threads);
}

// One head of rope_bf16: out[i] = bf16(bf16(x[i] cos[i]) + bf16(rot[i] sin[i])), a vector at a time within each
// half (rot = -x[i + D/2] in the first half, x[i - D/2] in the second), a scalar tail where a half is not a multiple.
template <class V>
FASTGATE_INLINE void rope_head_t(const uint16_t* xr, const uint16_t* c, const uint16_t* s, uint16_t* o, int64_t half) {
  constexpr int N = V::N;
  for (int side = 0; side < 2; ++side) {
    const int64_t lo = side * half, other = side ? -half : half;
    const float sign = side ? 1.0f : -1.0f;
    int64_t i = lo;
    for (; i + N <= lo + half; i += N) {
      const typename V::F a = round_bf16v<V>(load_bf16v<V>(xr + i) * load_bf16v<V>(c + i));
      const typename V::F b = round_bf16v<V>((load_bf16v<V>(xr + i + other) * sign) * load_bf16v<V>(s + i));
      store_bf16v<V>(o + i, a + b);
    }
    for (; i < lo + half; ++i) {
      const float a = round_bf16(bf16_to_f32(xr[i]) * bf16_to_f32(c[i]));
      const float b = round_bf16((sign * bf16_to_f32(xr[i + other])) * bf16_to_f32(s[i]));
      o[i] = f32_to_bf16(a + b);
    }
  }
}
FASTGATE_WIDTHS(rope_head, (const uint16_t* xr, const uint16_t* c, const uint16_t* s, uint16_t* o, int64_t half),
                (xr, c, s, o, half))

// All H heads of one token of rope_bf16, each vector of cos / sin loaded once for the token's heads (rope_head_t's
// arithmetic, element for element: the same bits): a head at a time, a 512-token chunk of SmolLM2's 12 heads ran at
// ~5 cycles a value. xr: the token's first head, heads `s_head` apart; o: its [H, D] output, contiguous. A half that
// is not a multiple of the vector goes a head at a time (rope_head_t, its scalar tail).
template <class V>
FASTGATE_INLINE void rope_heads_t(const uint16_t* xr, int64_t s_head, int64_t H, const uint16_t* c, const uint16_t* s,
                                  uint16_t* o, int64_t half) {
  typedef typename V::F F;
  constexpr int N = V::N;
  const int64_t D = 2 * half;
  if (half % N) {
    for (int64_t h = 0; h < H; ++h) rope_head_t<V>(xr + h * s_head, c, s, o + h * D, half);
    return;
  }
  for (int64_t i = 0; i < half; i += N) {
    const F c0 = load_bf16v<V>(c + i), c1 = load_bf16v<V>(c + half + i);
    const F s0 = load_bf16v<V>(s + i), s1 = load_bf16v<V>(s + half + i);
    for (int64_t h = 0; h < H; ++h) {
      const uint16_t* xh = xr + h * s_head;
      const F x0 = load_bf16v<V>(xh + i), x1 = load_bf16v<V>(xh + half + i);
      store_bf16v<V>(o + h * D + i, round_bf16v<V>(x0 * c0) + round_bf16v<V>((x1 * -1.0f) * s0));
      store_bf16v<V>(o + h * D + half + i, round_bf16v<V>(x1 * c1) + round_bf16v<V>((x0 * 1.0f) * s1));
    }
  }
}
FASTGATE_WIDTHS(rope_heads, (const uint16_t* xr, int64_t s_head, int64_t H, const uint16_t* c, const uint16_t* s,
                             uint16_t* o, int64_t half), (xr, s_head, H, c, s, o, half))

// x: [T, H, D] bf16 with element strides (token, head), unit along D; cos / sin: [T, D] bf16 rows `c_stride` apart;
// out: [T, H, D] bf16 contiguous. out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), rotate_half(x) =
// cat(-x[D/2:], x[:D/2]) (HF's apply_rotary_pos_emb).
void rope_bf16(uintptr_t x_ptr, uintptr_t cos_ptr, uintptr_t sin_ptr, uintptr_t out_ptr, int64_t T, int64_t H,
               int64_t D, int64_t s_tok, int64_t s_head, int64_t c_stride, int64_t threads) {
  if (T < 0 || H <= 0 || D <= 0 || D % 2) throw std::invalid_argument("rope_bf16: bad shape (D even)");
  const uint16_t* x = reinterpret_cast<const uint16_t*>(x_ptr);
  const uint16_t* cs = reinterpret_cast<const uint16_t*>(cos_ptr);
  const uint16_t* sn = reinterpret_cast<const uint16_t*>(sin_ptr);
  uint16_t* out = reinterpret_cast<uint16_t*>(out_ptr);
  const int64_t half = D / 2;
  py::gil_scoped_release release;
  split_rows(T, T * H * D * 4, kElementwiseGrain, [&](int64_t first, int64_t step) {
    for (int64_t t = first; t < T; t += step) {
      const uint16_t* c = cs + t * c_stride;
      const uint16_t* s = sn + t * c_stride;
      rope_heads(x + t * s_tok, s_head, H, c, s, out + t * H * D, half);
    }
    return true;
  }, threads);
}

// The same for a pass of decode rows only, with the store writes and the casts around it (op decode_attention_step):
// row r's new key and value (k_new / v_new [m, Hkv, D] bf16, strided views of the layer's product) are written at
// column pos[r] of its store row, then its bf16 query heads (q [m, H, D], strided) attend columns 0 .. pos[r]; out:
// [m, H, D] bf16 contiguous, the float32 result rounded to nearest even. As torch operations around
// decode_attention_bf16 these were ten dispatches a layer (two indexed writes, casts, copies): the arithmetic is the
// same, so the tokens are too.
// decode_attention_step_bf16's work, its inputs checked (widest: attended_width's) and the GIL released by the caller
// (decode_layers_bf16 calls it too)
void attention_step_bf16(const uint16_t* q, int64_t q_row, int64_t q_head, const uint16_t* kn, int64_t kn_row,
                         int64_t kn_head, const uint16_t* vn, int64_t vn_row, int64_t vn_head, uint16_t* k,
                         uint16_t* v, const int64_t* pos, uint16_t* out, int64_t m, int64_t H, int64_t Hkv, int64_t D,
                         int64_t widest, int64_t s_row, int64_t s_head, int64_t s_col, float sc, int64_t threads,
                         const uint16_t* cs, const uint16_t* sn, int64_t c_stride) {
  const int64_t G = H / Hkv;
  split_rows(m * Hkv, m * Hkv * widest * D * G * 2, kAttentionGrain, [&](int64_t first, int64_t step) {
    std::vector<float> qs(G * D), scores(G * widest), o(G * D);  // per thread
    std::vector<uint16_t> qrot(cs ? D : 0);
    for (int64_t item = first; item < m * Hkv; item += step) {
      const int64_t r = item / Hkv, h = item % Hkv;
      uint16_t* kc = k + r * s_row + h * s_head + pos[r] * s_col;  // this row's new column
      uint16_t* vc = v + r * s_row + h * s_head + pos[r] * s_col;
      if (cs)
        rope_head(kn + r * kn_row + h * kn_head, cs + r * c_stride, sn + r * c_stride, kc, D / 2);
      else
        __builtin_memcpy(kc, kn + r * kn_row + h * kn_head, D * sizeof(uint16_t));
      __builtin_memcpy(vc, vn + r * vn_row + h * vn_head, D * sizeof(uint16_t));
      for (int64_t g = 0; g < G; ++g) {
        const uint16_t* qr = q + r * q_row + (h * G + g) * q_head;
        if (cs) {
          rope_head(qr, cs + r * c_stride, sn + r * c_stride, qrot.data(), D / 2);
          qr = qrot.data();
        }
        for (int64_t i = 0; i < D; ++i) qs[g * D + i] = bf16_to_f32(qr[i]) * sc;
      }
      attend(qs.data(), k + r * s_row + h * s_head, v + r * s_row + h * s_head, s_col, pos[r] + 1, G, D,
                  scores.data(), o.data());
      uint16_t* orow = out + (r * H + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i) orow[i] = f32_to_bf16(o[i]);
    }
    return true;
  }, threads);
}

void decode_attention_step_bf16(uintptr_t q_ptr, int64_t q_row, int64_t q_head, uintptr_t kn_ptr, int64_t kn_row,
                                int64_t kn_head, uintptr_t vn_ptr, int64_t vn_row, int64_t vn_head, uintptr_t k_ptr,
                                uintptr_t v_ptr, uintptr_t pos_ptr, uintptr_t out_ptr, int64_t m, int64_t H,
                                int64_t Hkv, int64_t D, int64_t cols, int64_t s_row, int64_t s_head, int64_t s_col,
                                double scale, int64_t threads, uintptr_t cos_ptr, uintptr_t sin_ptr,
                                int64_t c_stride) {
  check_decode_shape("decode_attention_step_bf16", m, H, Hkv, D);
  if (cos_ptr && D % 2) throw std::invalid_argument("decode_attention_step_bf16: the rotary embedding needs D even");
  // cos / sin (0: none): [m, D] bf16 rows c_stride apart; q and k_new are rotated first, as rope_bf16 rotates them
  // (the same loop), so that the fused pass's rotary embedding and attention are one call
  const int64_t* pos = reinterpret_cast<const int64_t*>(pos_ptr);
  const int64_t widest = attended_width(pos, m, cols);
  py::gil_scoped_release release;
  attention_step_bf16(reinterpret_cast<const uint16_t*>(q_ptr), q_row, q_head,
                      reinterpret_cast<const uint16_t*>(kn_ptr), kn_row, kn_head,
                      reinterpret_cast<const uint16_t*>(vn_ptr), vn_row, vn_head, reinterpret_cast<uint16_t*>(k_ptr),
                      reinterpret_cast<uint16_t*>(v_ptr), pos, reinterpret_cast<uint16_t*>(out_ptr), m, H, Hkv, D,
                      widest, s_row, s_head, s_col, static_cast<float>(scale), threads,
                      reinterpret_cast<const uint16_t*>(cos_ptr), reinterpret_cast<const uint16_t*>(sin_ptr),
                      c_stride);
}


// ---------------------------------------------------------------------------------------------- prefill attention
// A prompt chunk's causal attention over bf16 keys / values (op prefill_attention, fastgate/ops/prefill.py): torch's
// CPU flash kernel ran it at ~50 GFLOP/s and float32 batched products at ~70, where the model's bf16 products reach
// ~450. Here the scores come from AVX512-BF16 dot products (exact bf16 products, float32 sums: the float32 scores of
// the bf16 inputs), over keys repacked once per call in pairs along the head dim (16 keys a register); softmax and
// the value product in float32 (values widened in registers); the output rounded to bf16 once (to nearest even).
// Built where GCC can target AVX512-BF16 and run only where the CPU has it (prefill_attention_bf16_supported).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10  // AVX512-BF16 intrinsics
#define FASTGATE_BF16_KERNEL 1
#define FASTGATE_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))
#include <immintrin.h>
// GCC 12's AVX-512 headers trip -W(maybe-)uninitialized inside their own reductions and conversions: not ours
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#if defined(FASTGATE_AVX512) && defined(FASTGATE_BF16_KERNEL)  // the bf16 kernel's helpers and <immintrin.h>
// exp_nonpositive, 16 at a time
FASTGATE_AVX512_TARGET inline __m512 exp16_nonpositive(__m512 x) {
  return reinterpret_cast<__m512>(exp_nonpositive<f32x16, i32x16>(reinterpret_cast<f32x16>(x)));
}

// A score row's softmax over its first w columns, in place; zeros after them up to the next multiple of 16 (the
// padded row the value pass reads). Both prefill kernels' (bf16 and float32 inputs).
FASTGATE_AVX512_TARGET void softmax_prefix16(float* s, int64_t w) {
  const int64_t full = w / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (w - full)) - 1u);
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t c = 0; c < full; c += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + c));
  if (tail) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, s + full));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t c = 0; c < full; c += 16) {
    const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + c), m));
    _mm512_storeu_ps(s + c, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (tail) {
    const __m512 e = _mm512_maskz_mov_ps(tail, exp16_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + full), m)));
    _mm512_storeu_ps(s + full, e);  // zeros past the row's last column, within the padded row
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
  for (int64_t c = 0; c < full + (tail ? 16 : 0); c += 16) _mm512_storeu_ps(s + c, _mm512_mul_ps(_mm512_loadu_ps(s + c), inv));
}
#endif

#ifdef FASTGATE_BF16_KERNEL
// attend_head 16 floats a vector (AVX-512), for D a multiple of 32 up to 128: a key or value row of 32 bf16 is one
// 64-byte load split into its even and odd dims (a shift, an and: no widening shuffles), q permuted alike once; the
// value product keeps the outputs of up to GB query heads in registers across the keys (attend_head loads and stores
// them a key at a time). The scores' sums run in another order than attend_head's (16 lanes, not 8): the last bits of
// a score; the value product adds the keys in the same order.
template <int C>  // a row of 32 C bf16 as its even and odd dims, float32: a shift and an and a 64-byte load
FASTGATE_AVX512_TARGET inline void split_row(const uint16_t* row, __m512* even, __m512* odd) {
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int c = 0; c < C; ++c) {
    const __m512i x = _mm512_loadu_si512(row + 32 * c);
    even[c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    odd[c] = _mm512_castsi512_ps(_mm512_and_si512(x, hi));
  }
}

template <int C, int GB>  // C: chunks of 32 dims; GB: query heads a pass over the values
FASTGATE_AVX512_TARGET inline void value_pass(const float* p, int64_t n, const uint16_t* v, int64_t stride,
                                               float* oe, float* oo) {
  __m512 ae[GB][C], ao[GB][C];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < C; ++c) ae[g][c] = ao[g][c] = _mm512_setzero_ps();
  for (int64_t w = 0; w < n; ++w) {
    __m512 ve[C], vo[C];
    split_row<C>(v + w * stride, ve, vo);
    for (int g = 0; g < GB; ++g) {
      const __m512 pw = _mm512_set1_ps(p[g * n + w]);
      for (int c = 0; c < C; ++c) {
        ae[g][c] = _mm512_fmadd_ps(pw, ve[c], ae[g][c]);
        ao[g][c] = _mm512_fmadd_ps(pw, vo[c], ao[g][c]);
      }
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < C; ++c) {
      _mm512_storeu_ps(oe + (g * C + c) * 16, ae[g][c]);
      _mm512_storeu_ps(oo + (g * C + c) * 16, ao[g][c]);
    }
}

template <int C>
FASTGATE_AVX512_TARGET void attend_head16(const float* q, const uint16_t* k, const uint16_t* v, int64_t stride,
                                          int64_t n, int64_t G, float* scores, float* out) {
  constexpr int D = 32 * C;
  alignas(64) float qe[8][C * 16], qo[8][C * 16];  // G <= 8 (the caller checks)
  for (int64_t g = 0; g < G; ++g)
    for (int i = 0; i < C * 16; ++i) {
      const int c = i / 16, l = i % 16;
      qe[g][i] = q[g * D + 32 * c + 2 * l];
      qo[g][i] = q[g * D + 32 * c + 2 * l + 1];
    }
  for (int64_t w = 0; w < n; ++w) {  // scores: each key row read once for the G heads
    __m512 ke[C], ko[C];
    split_row<C>(k + w * stride, ke, ko);
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(_mm512_load_ps(qe[g]), ke[0]);
      acc = _mm512_fmadd_ps(_mm512_load_ps(qo[g]), ko[0], acc);
      for (int c = 1; c < C; ++c) {
        acc = _mm512_fmadd_ps(_mm512_load_ps(qe[g] + 16 * c), ke[c], acc);
        acc = _mm512_fmadd_ps(_mm512_load_ps(qo[g] + 16 * c), ko[c], acc);
      }
      scores[g * n + w] = _mm512_reduce_add_ps(acc);
    }
  }
  softmax_rows(scores, n, G);
  constexpr int GB = C <= 2 ? 4 : 2;  // the value pass's accumulators: 2 C GB registers
  alignas(64) float oe[GB * C * 16], oo[GB * C * 16];
  for (int64_t g0 = 0; g0 < G; g0 += GB) {
    const int64_t gb = std::min<int64_t>(GB, G - g0);
    const float* p = scores + g0 * n;
    switch (gb) {
      case 1: value_pass<C, 1>(p, n, v, stride, oe, oo); break;
      case 2: value_pass<C, 2>(p, n, v, stride, oe, oo); break;
      case 3: value_pass<C, C <= 2 ? 3 : 2>(p, n, v, stride, oe, oo); break;
      default: value_pass<C, GB>(p, n, v, stride, oe, oo); break;
    }
    for (int64_t g = 0; g < gb; ++g)
      for (int i = 0; i < C * 16; ++i) {
        const int c = i / 16, l = i % 16;
        out[(g0 + g) * D + 32 * c + 2 * l] = oe[g * C * 16 + i];
        out[(g0 + g) * D + 32 * c + 2 * l + 1] = oo[g * C * 16 + i];
      }
  }
}
#endif

void attend(const float* q, const uint16_t* k, const uint16_t* v, int64_t stride, int64_t n, int64_t G, int64_t D,
            float* scores, float* out) {
#ifdef FASTGATE_BF16_KERNEL
  if (use_width16() && G <= 8) {
    if (D == 32) return attend_head16<1>(q, k, v, stride, n, G, scores, out);
    if (D == 64) return attend_head16<2>(q, k, v, stride, n, G, scores, out);
    if (D == 128) return attend_head16<4>(q, k, v, stride, n, G, scores, out);
  }
#endif
  attend_head(q, k, v, stride, n, G, D, scores, out);
}

bool prefill_attention_bf16_supported() {
#ifdef FASTGATE_BF16_KERNEL
  static const bool supported = [] {  // asked once: every kernel call checks it
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512bf16");
  }();
  return supported;
#else
  return false;
#endif
}

#ifdef FASTGATE_BF16_KERNEL

// keys [S, D] bf16 (rows col_stride apart) -> kp [ceil(S / 16)][D / 2][16 keys][2 dims], zero past S
FASTGATE_BF16_TARGET void pack_key_pairs(const uint16_t* k, int64_t col_stride, int64_t S, int64_t D, uint32_t* kp) {
  const int64_t groups = (S + 15) / 16, D2 = D / 2;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t l = 0; l < 16; ++l) {
      const int64_t c = g * 16 + l;
      for (int64_t d2 = 0; d2 < D2; ++d2) {
        uint32_t pair = 0;
        if (c < S) __builtin_memcpy(&pair, k + c * col_stride + 2 * d2, sizeof pair);
        kp[(g * D2 + d2) * 16 + l] = pair;
      }
    }
}

// The value product of TV query vectors: out[t] = sum_j p[t][j] v[j] over j < width, D = 16 * D16.
template <int D16, int TV>
FASTGATE_BF16_TARGET inline void value_tile(const float* const* p, int64_t width, const uint16_t* v, int64_t col_stride,
                                            uint16_t* const* out) {
  __m512 acc[TV][D16];
  for (int t = 0; t < TV; ++t)
    for (int i = 0; i < D16; ++i) acc[t][i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; ++j) {
    const uint16_t* vj = v + j * col_stride;
    __m512 vv[D16];
    for (int i = 0; i < D16; ++i)
      vv[i] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vj + 16 * i))), 16));
    for (int t = 0; t < TV; ++t) {
      const __m512 pj = _mm512_set1_ps(p[t][j]);
      for (int i = 0; i < D16; ++i) acc[t][i] = _mm512_fmadd_ps(pj, vv[i], acc[t][i]);
    }
  }
  for (int t = 0; t < TV; ++t)
    for (int i = 0; i < D16; ++i)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[t] + 16 * i), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(acc[t][i])));
}

// The value pass's tile of TV query vectors from i0 (of nv; row_of / head_of as the item's): each one's probabilities
// (p) and output row (o: past nv, a repeat of the last vector, written to spare, TV rows of D); returns the tile's
// widest row, to which a shorter row's probabilities are zeroed from its own padded end (a multiple of N).
template <int TV, int N, class T, class RowOf, class HeadOf>
FASTGATE_INLINE int64_t value_tile_rows(int64_t i0, int64_t nv, int64_t start, float* scores, int64_t spad, T* out,
                                        int64_t H, int64_t D, RowOf row_of, HeadOf head_of, const float** p, T** o,
                                        T* spare) {
  int64_t width = 0;
  for (int t = 0; t < TV; ++t) {
    const int64_t i = std::min(i0 + t, nv - 1);
    p[t] = scores + i * spad;
    o[t] = i0 + t < nv ? out + (row_of(i) * H + head_of(i)) * D : spare + t * D;
    width = std::max(width, start + row_of(i) + 1);
  }
  for (int t = 0; t < TV; ++t) {
    const int64_t w = start + row_of(std::min(i0 + t, nv - 1)) + 1;
    float* pt = scores + std::min(i0 + t, nv - 1) * spad;
    for (int64_t c = (w + N - 1) / N * N; c < width; ++c) pt[c] = 0.0f;
  }
  return width;
}

constexpr int64_t kRowsPerItem = 16;  // query rows of one work item (its G heads each)
constexpr int kScoreTile = 8;         // query vectors whose scores one pass over the keys computes

// The float32 kernels' score tile of query vectors i0 .. i0 + tile - 1 (row_of / head_of as the item's): a pointer to
// each in q, kScoreTile of them (a short tile repeats its last vector); returns the key columns its widest row sees.
template <class RowOf, class HeadOf>
FASTGATE_INLINE int64_t score_tile_queries(const float* q, int64_t q_head, int64_t q_row, int64_t start, int64_t i0,
                                           int tile, RowOf row_of, HeadOf head_of, const float** qv) {
  for (int t = 0; t < kScoreTile; ++t) {
    const int64_t i = i0 + std::min(t, tile - 1);
    qv[t] = q + head_of(i) * q_head + row_of(i) * q_row;
  }
  return start + row_of(i0 + tile - 1) + 1;
}

// One work item: key / value head h's G query heads over query rows r0 .. r1 - 1 of the chunk.
template <int D16>
FASTGATE_BF16_TARGET void prefill_item(const uint16_t* q, int64_t q_head, int64_t q_row, const uint32_t* kp,
                                       const uint16_t* v, int64_t v_col, int64_t start, int64_t r0, int64_t r1,
                                       int64_t h, int64_t G, int64_t H, float scale, float* scores, int64_t spad,
                                       uint16_t* out) {
  constexpr int64_t D = 16 * D16, D2 = D / 2;
  constexpr int TV = 16 / D16;  // value tiles: TV x D16 = 16 accumulator registers of AVX-512's 32
  const int64_t nv = G * (r1 - r0);  // query vectors: (row, head) pairs, row-major
  auto head_of = [&](int64_t i) { return h * G + i % G; };
  auto row_of = [&](int64_t i) { return r0 + i / G; };
  for (int64_t i0 = 0; i0 < nv; i0 += kScoreTile) {  // scores
    const int tile = static_cast<int>(std::min<int64_t>(kScoreTile, nv - i0));
    uint32_t qp[kScoreTile][128];
    for (int t = 0; t < tile; ++t) {
      const uint16_t* qv = q + head_of(i0 + t) * q_head + row_of(i0 + t) * q_row;
      for (int64_t d2 = 0; d2 < D2; ++d2) __builtin_memcpy(&qp[t][d2], qv + 2 * d2, sizeof(uint32_t));
    }
    const int64_t width = start + row_of(i0 + tile - 1) + 1;  // the tile's widest row
    for (int64_t g = 0; g < (width + 15) / 16; ++g) {
      __m512 acc[kScoreTile];
      for (int t = 0; t < kScoreTile; ++t) acc[t] = _mm512_setzero_ps();
      const uint32_t* kg = kp + g * D2 * 16;
      for (int64_t d2 = 0; d2 < D2; ++d2) {
        const __m512i kk = _mm512_loadu_si512(kg + d2 * 16);
        for (int t = 0; t < tile; ++t)
          acc[t] = _mm512_dpbf16_ps(acc[t], reinterpret_cast<__m512bh>(kk),
                                    reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(qp[t][d2]))));
      }
      for (int t = 0; t < tile; ++t) _mm512_storeu_ps(scores + (i0 + t) * spad + g * 16, _mm512_mul_ps(acc[t], _mm512_set1_ps(scale)));
    }
  }
  for (int64_t i = 0; i < nv; ++i) softmax_prefix16(scores + i * spad, start + row_of(i) + 1);
  for (int64_t i0 = 0; i0 < nv; i0 += TV) {  // values: a tile of TV vectors of one key / value head
    const float* p[TV];
    uint16_t* o[TV];
    uint16_t spare[TV][D];
    const int64_t width =
        value_tile_rows<TV, 16>(i0, nv, start, scores, spad, out, H, D, row_of, head_of, p, o, &spare[0][0]);
    value_tile<D16, TV>(p, width, v, v_col, o);
  }
}

// prefill_item for head dim D (32, 64 or 128: its value tiles are sized per head dim)
FASTGATE_BF16_TARGET inline void prefill_item_d(int64_t D, const uint16_t* q, int64_t q_head, int64_t q_row,
                                                const uint32_t* kp, const uint16_t* v, int64_t v_col, int64_t start,
                                                int64_t r0, int64_t r1, int64_t h, int64_t G, int64_t H, float scale,
                                                float* scores, int64_t spad, uint16_t* out) {
  if (D == 32)
    prefill_item<2>(q, q_head, q_row, kp, v, v_col, start, r0, r1, h, G, H, scale, scores, spad, out);
  else if (D == 64)
    prefill_item<4>(q, q_head, q_row, kp, v, v_col, start, r0, r1, h, G, H, scale, scores, spad, out);
  else
    prefill_item<8>(q, q_head, q_row, kp, v, v_col, start, r0, r1, h, G, H, scale, scores, spad, out);
}
#endif

#ifdef FASTGATE_BF16_KERNEL
// Both prefill kernels' shape check and driver: each key / value head's keys packed (pack(h)) over the pool, then the
// work items (a head's query rows in blocks of kRowsPerItem, the widest blocks first), each thread with its own
// scores (G x kRowsPerItem rows of spad): item(h, r0, r1, scores).
inline void check_prefill_shape(const char* name, int64_t n, int64_t start, int64_t H, int64_t Hkv, int64_t D) {
  if (n < 0 || start < 0 || H <= 0 || Hkv <= 0 || H % Hkv != 0 || (D != 32 && D != 64 && D != 128))
    throw std::invalid_argument(std::string(name) + ": bad shape (H a multiple of Hkv, D one of 32, 64, 128)");
}

template <class Pack, class Item>
void prefill_items(int64_t n, int64_t S, int64_t Hkv, int64_t G, int64_t D, int64_t spad, int64_t threads, Pack pack,
                   Item item) {
  split_rows(Hkv, Hkv * S * D, 1 << 16, [&](int64_t first, int64_t step) {
    for (int64_t h = first; h < Hkv; h += step) pack(h);
    return true;
  }, threads);
  const int64_t blocks = (n + kRowsPerItem - 1) / kRowsPerItem, items = Hkv * blocks;
  split_rows(items, items * kRowsPerItem * G * S * D * 2, 1 << 20, [&](int64_t first, int64_t step) {
    std::vector<float> scores(G * kRowsPerItem * spad);  // per thread
    for (int64_t it = first; it < items; it += step) {
      const int64_t h = it % Hkv, b = blocks - 1 - it / Hkv;  // the widest blocks first
      const int64_t r0 = b * kRowsPerItem;
      item(h, r0, std::min(n, r0 + kRowsPerItem), scores.data());
    }
    return true;
  }, threads);
}
#endif

// q: bf16 [H heads, n rows, D] with element strides (q_head, q_row, 1); keys / values: bf16 [Hkv, start + n, D] with
// strides (kv_head, kv_col, 1); out: [n, H, D] bf16 contiguous. Query row r of head h sees columns 0 .. start + r of
// key / value head h / (H / Hkv). D one of 32, 64, 128. Pointers come from torch tensors the caller checked
// (fastgate/ops/prefill.py). threads: at most that many (the caller passes torch's own count), 0: one per core.
void prefill_attention_bf16(uintptr_t q_ptr, int64_t q_head, int64_t q_row, uintptr_t k_ptr, uintptr_t v_ptr,
                            int64_t kv_head, int64_t kv_col, uintptr_t out_ptr, int64_t n, int64_t H, int64_t Hkv,
                            int64_t D, int64_t start, double scale, int64_t threads) {
#ifdef FASTGATE_BF16_KERNEL
  if (!prefill_attention_bf16_supported())
    throw std::invalid_argument("prefill_attention_bf16: this CPU has no AVX512-BF16");
  check_prefill_shape("prefill_attention_bf16", n, start, H, Hkv, D);
  if (n == 0) return;
  const uint16_t* q = reinterpret_cast<const uint16_t*>(q_ptr);
  const uint16_t* k = reinterpret_cast<const uint16_t*>(k_ptr);
  const uint16_t* v = reinterpret_cast<const uint16_t*>(v_ptr);
  uint16_t* out = reinterpret_cast<uint16_t*>(out_ptr);
  const int64_t S = start + n, G = H / Hkv, groups = (S + 15) / 16, spad = groups * 16, per_head = groups * (D / 2) * 16;
  const float sc = static_cast<float>(scale);
  py::gil_scoped_release release;
  std::vector<uint32_t> kp(Hkv * per_head);
  prefill_items(n, S, Hkv, G, D, spad, threads,
                [&](int64_t h) { pack_key_pairs(k + h * kv_head, kv_col, S, D, kp.data() + h * per_head); },
                [&](int64_t h, int64_t r0, int64_t r1, float* scores) {
                  prefill_item_d(D, q, q_head, q_row, kp.data() + h * per_head, v + h * kv_head, kv_col, start, r0,
                                 r1, h, G, H, sc, scores, spad, out);
                });
#else
  (void)q_ptr, (void)q_head, (void)q_row, (void)k_ptr, (void)v_ptr, (void)kv_head, (void)kv_col, (void)out_ptr;
  (void)n, (void)H, (void)Hkv, (void)D, (void)start, (void)scale, (void)threads;
  throw std::invalid_argument("prefill_attention_bf16: not built for this platform");
#endif
}

// A packed pass's prompt chunks, each attending its own prompt, in one call: per chunk what prefill_attention_bf16
// computes, work item for work item (the same bits), with every chunk's items over the pool at once (a pass of 12
// short chunks made 12 calls a layer, each 3 items on 2 threads for SmolLM2) and the chunks' new keys / values
// written into their buffers here. q: bf16 [H, T, D] of the pass with strides (q_head, q_row, 1); kn / vn: the
// pass's new keys / values [Hkv, T, D] with strides (kn_head, kn_row, 1) / (vn_head, vn_row, 1); table: int64
// [nseg, 6], a chunk a row: (its offset in the pass, n rows, start column, its key buffer, its value buffer, the
// buffers' head stride), the buffers bf16 [Hkv, >= start + n, D] with columns D apart; out: bf16 [T, H, D]
// contiguous, a chunk's rows at its offset. threads as prefill_attention_bf16's.
void prefill_attention_segs_bf16(uintptr_t q_ptr, int64_t q_head, int64_t q_row, uintptr_t kn_ptr, int64_t kn_head,
                                 int64_t kn_row, uintptr_t vn_ptr, int64_t vn_head, int64_t vn_row,
                                 uintptr_t table_ptr, int64_t nseg, uintptr_t out_ptr, int64_t H, int64_t Hkv,
                                 int64_t D, double scale, int64_t threads) {
#ifdef FASTGATE_BF16_KERNEL
  if (!prefill_attention_bf16_supported())
    throw std::invalid_argument("prefill_attention_segs_bf16: this CPU has no AVX512-BF16");
  if (nseg < 0) throw std::invalid_argument("prefill_attention_segs_bf16: negative chunk count");
  struct Seg {
    int64_t off, n, start, S, spad, per_head, head;
    uint16_t* k;
    uint16_t* v;
    size_t kp0;
  };
  const int64_t* table = reinterpret_cast<const int64_t*>(table_ptr);
  std::vector<Seg> segs;
  size_t kp_size = 0;
  int64_t max_spad = 0;
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t* row = table + 6 * s;
    check_prefill_shape("prefill_attention_segs_bf16", row[1], row[2], H, Hkv, D);
    if (row[0] < 0) throw std::invalid_argument("prefill_attention_segs_bf16: negative chunk offset");
    if (row[1] == 0) continue;
    Seg g;
    g.off = row[0], g.n = row[1], g.start = row[2], g.S = g.start + g.n;
    const int64_t groups = (g.S + 15) / 16;
    g.spad = groups * 16, g.per_head = groups * (D / 2) * 16, g.head = row[5];
    g.k = reinterpret_cast<uint16_t*>(static_cast<uintptr_t>(row[3]));
    g.v = reinterpret_cast<uint16_t*>(static_cast<uintptr_t>(row[4]));
    g.kp0 = kp_size;
    kp_size += static_cast<size_t>(Hkv * g.per_head);
    max_spad = std::max(max_spad, g.spad);
    segs.push_back(g);
  }
  if (segs.empty()) return;
  const uint16_t* q = reinterpret_cast<const uint16_t*>(q_ptr);
  const uint16_t* kn = reinterpret_cast<const uint16_t*>(kn_ptr);
  const uint16_t* vn = reinterpret_cast<const uint16_t*>(vn_ptr);
  uint16_t* out = reinterpret_cast<uint16_t*>(out_ptr);
  const int64_t G = H / Hkv, units = static_cast<int64_t>(segs.size()) * Hkv;
  const float sc = static_cast<float>(scale);
  py::gil_scoped_release release;
  std::vector<uint32_t> kp(kp_size);
  int64_t pack_work = 0;
  for (const Seg& g : segs) pack_work += Hkv * g.S * D;
  // the chunks' new columns into their buffers, then each (chunk, head)'s keys packed as the one-chunk call packs them
  split_rows(units, pack_work, 1 << 16, [&](int64_t first, int64_t step) {
    for (int64_t u = first; u < units; u += step) {
      const Seg& g = segs[u / Hkv];
      const int64_t h = u % Hkv;
      for (int64_t r = 0; r < g.n; ++r) {
        const int64_t dst = h * g.head + (g.start + r) * D;
        std::memcpy(g.k + dst, kn + h * kn_head + (g.off + r) * kn_row, D * sizeof(uint16_t));
        std::memcpy(g.v + dst, vn + h * vn_head + (g.off + r) * vn_row, D * sizeof(uint16_t));
      }
      pack_key_pairs(g.k + h * g.head, D, g.S, D, kp.data() + g.kp0 + h * g.per_head);
    }
    return true;
  }, threads);
  struct Item {
    int64_t seg, h, r0, r1, width;
  };
  std::vector<Item> items;
  int64_t item_work = 0;
  for (size_t s = 0; s < segs.size(); ++s) {
    const Seg& g = segs[s];
    for (int64_t r0 = 0; r0 < g.n; r0 += kRowsPerItem)
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t r1 = std::min(g.n, r0 + kRowsPerItem);
        items.push_back({static_cast<int64_t>(s), h, r0, r1, g.start + r1});
      }
    item_work += Hkv * g.n * G * g.S * D * 2;
  }
  // the widest items first, as the one-chunk call orders its blocks
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.width > b.width; });
  const int64_t n_items = static_cast<int64_t>(items.size());
  split_rows(n_items, item_work, 1 << 20, [&](int64_t first, int64_t step) {
    std::vector<float> scores(G * kRowsPerItem * max_spad);  // per thread
    for (int64_t it = first; it < n_items; it += step) {
      const Item& m = items[it];
      const Seg& g = segs[m.seg];
      prefill_item_d(D, q + g.off * q_row, q_head, q_row, kp.data() + g.kp0 + m.h * g.per_head, g.v + m.h * g.head, D,
                     g.start, m.r0, m.r1, m.h, G, H, sc, scores.data(), g.spad, out + g.off * H * D);
    }
    return true;
  }, threads);
#else
  (void)q_ptr, (void)q_head, (void)q_row, (void)kn_ptr, (void)kn_head, (void)kn_row, (void)vn_ptr, (void)vn_head;
  (void)vn_row, (void)table_ptr, (void)nseg, (void)out_ptr, (void)H, (void)Hkv, (void)D, (void)scale, (void)threads;
  throw std::invalid_argument("prefill_attention_segs_bf16: not built for this platform");
#endif
}

// The same attention over float32 queries, keys and values (op prefill_attention for a float32 model): torch's CPU
// flash kernel ran a 700-token SmolLM2 prompt's layer (9 heads, 3 key / value heads, head dim 64) in 6.1 ms on two
// Zen 4 cores (~90 GFLOP/s), ~1/6 of a 16 x 700 float32 prefill, and a chunk that continues a prompt through a mask
// over the whole rectangle. Here: each score a float32 dot product over the head dim, 16 keys a register (keys
// repacked once per call, [16 keys][D] transposed), the upper triangle skipped; the softmax and the value product as
// in the bf16 kernel; the output float32. The sums run in another order than the flash kernel's: the last bits of an
// output (tests/test_prefill_attention.py bounds them). 16 floats a vector with AVX-512, else 8 with AVX2 and FMA.
#if defined(FASTGATE_AVX512) && defined(FASTGATE_BF16_KERNEL)  // the bf16 kernel's helpers and <immintrin.h>
// keys [S, D] float32 (rows col_stride apart) -> kt [ceil(S / 16)][D][16 keys], zero past S
FASTGATE_AVX512_TARGET void pack_keys_f32(const float* k, int64_t col_stride, int64_t S, int64_t D, float* kt) {
  const int64_t groups = (S + 15) / 16;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t l = 0; l < 16; ++l) {
      const int64_t c = g * 16 + l;
      for (int64_t d = 0; d < D; ++d) kt[(g * D + d) * 16 + l] = c < S ? k[c * col_stride + d] : 0.0f;
    }
}

// The value product of TV query vectors over float32 values: out[t] = sum_j p[t][j] v[j] over j < width.
template <int D16, int TV>
FASTGATE_AVX512_TARGET inline void value_tile_f32(const float* const* p, int64_t width, const float* v,
                                                  int64_t col_stride, float* const* out) {
  __m512 acc[TV][D16];
  for (int t = 0; t < TV; ++t)
    for (int i = 0; i < D16; ++i) acc[t][i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; ++j) {
    const float* vj = v + j * col_stride;
    __m512 vv[D16];
    for (int i = 0; i < D16; ++i) vv[i] = _mm512_loadu_ps(vj + 16 * i);
    for (int t = 0; t < TV; ++t) {
      const __m512 pj = _mm512_set1_ps(p[t][j]);
      for (int i = 0; i < D16; ++i) acc[t][i] = _mm512_fmadd_ps(pj, vv[i], acc[t][i]);
    }
  }
  for (int t = 0; t < TV; ++t)
    for (int i = 0; i < D16; ++i) _mm512_storeu_ps(out[t] + 16 * i, acc[t][i]);
}

// One work item of prefill_attention_f32: key / value head h's G query heads over query rows r0 .. r1 - 1.
template <int D16>
FASTGATE_AVX512_TARGET void prefill_item_f32(const float* q, int64_t q_head, int64_t q_row, const float* kt,
                                             const float* v, int64_t v_col, int64_t start, int64_t r0, int64_t r1,
                                             int64_t h, int64_t G, int64_t H, float scale, float* scores, int64_t spad,
                                             float* out) {
  constexpr int64_t D = 16 * D16;
  constexpr int TV = 16 / D16;  // value tiles: TV x D16 = 16 accumulator registers
  const int64_t nv = G * (r1 - r0);  // query vectors: (row, head) pairs, row-major
  auto head_of = [&](int64_t i) { return h * G + i % G; };
  auto row_of = [&](int64_t i) { return r0 + i / G; };
  for (int64_t i0 = 0; i0 < nv; i0 += kScoreTile) {  // scores
    const int tile = static_cast<int>(std::min<int64_t>(kScoreTile, nv - i0));
    const float* qv[kScoreTile];
    const int64_t width = score_tile_queries(q, q_head, q_row, start, i0, tile, row_of, head_of, qv);
    for (int64_t g = 0; g < (width + 15) / 16; ++g) {
      __m512 acc[kScoreTile];
      for (int t = 0; t < kScoreTile; ++t) acc[t] = _mm512_setzero_ps();
      const float* kg = kt + g * D * 16;
      for (int64_t d = 0; d < D; ++d) {
        const __m512 kk = _mm512_loadu_ps(kg + d * 16);
        for (int t = 0; t < kScoreTile; ++t) acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(qv[t][d]), kk, acc[t]);
      }
      for (int t = 0; t < tile; ++t) _mm512_storeu_ps(scores + (i0 + t) * spad + g * 16, _mm512_mul_ps(acc[t], _mm512_set1_ps(scale)));
    }
  }
  for (int64_t i = 0; i < nv; ++i) softmax_prefix16(scores + i * spad, start + row_of(i) + 1);
  for (int64_t i0 = 0; i0 < nv; i0 += TV) {  // values: a tile of TV vectors of one key / value head
    const float* p[TV];
    float* o[TV];
    float spare[TV][D];
    const int64_t width =
        value_tile_rows<TV, 16>(i0, nv, start, scores, spad, out, H, D, row_of, head_of, p, o, &spare[0][0]);
    value_tile_f32<D16, TV>(p, width, v, v_col, o);
  }
}

// The same kernel 8 floats a vector, for CPUs with AVX2 and FMA but no AVX-512 (and, through set_max_vector_width(8),
// for tests on one that has it): 8 keys a register, keys repacked [8 keys][D]; the value product over 64 dims at a
// time (AVX2's 16 registers); the softmax's last vector masked by lane. Another order of sums than the 16-wide one.
#define FASTGATE_AVX2_FMA_TARGET __attribute__((target("avx2,fma")))

// keys [S, D] float32 (rows col_stride apart) -> kt [ceil(S / 8)][D][8 keys], zero past S
FASTGATE_AVX2_FMA_TARGET void pack_keys_f32x8(const float* k, int64_t col_stride, int64_t S, int64_t D, float* kt) {
  const int64_t groups = (S + 7) / 8;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t l = 0; l < 8; ++l) {
      const int64_t c = g * 8 + l;
      for (int64_t d = 0; d < D; ++d) kt[(g * D + d) * 8 + l] = c < S ? k[c * col_stride + d] : 0.0f;
    }
}

// A score row's softmax over its first w columns, in place; zeros after them up to the next multiple of 8.
FASTGATE_INLINE void softmax_prefix8(float* s, int64_t w) {
  const int64_t full = w / 8 * 8, rem = w - full;
  const i32x8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  const i32x8 live = lane < static_cast<int32_t>(rem);
  const f32x8 ninf = f32x8{} - std::numeric_limits<float>::infinity(), zero = f32x8{};
  f32x8 vm = ninf;
  for (int64_t c = 0; c < full; c += 8) {
    const f32x8 x = load8(s + c);
    vm = x > vm ? x : vm;
  }
  if (rem) {
    const f32x8 x = live ? load8(s + full) : ninf;
    vm = x > vm ? x : vm;
  }
  float m = vm[0];
  for (int l = 1; l < 8; ++l) m = std::max(m, vm[l]);
  f32x8 vs = zero;
  for (int64_t c = 0; c < full; c += 8) {
    const f32x8 e = exp_nonpositive<f32x8, i32x8>(load8(s + c) - m);
    __builtin_memcpy(s + c, &e, sizeof e);
    vs += e;
  }
  if (rem) {  // the lanes past w: whatever the row held, 0 after
    const f32x8 e = live ? exp_nonpositive<f32x8, i32x8>((live ? load8(s + full) : ninf) - m) : zero;
    __builtin_memcpy(s + full, &e, sizeof e);
    vs += e;
  }
  const float inv = 1.0f / hsum8(vs);
  for (int64_t c = 0; c < full + (rem ? 8 : 0); c += 8) {
    const f32x8 x = load8(s + c) * inv;
    __builtin_memcpy(s + c, &x, sizeof x);
  }
}

// The value product of TV query vectors over DV x 8 dims of float32 values (v, out: at the block's first dim).
template <int DV, int TV>
FASTGATE_INLINE void value_tile_f32x8(const float* const* p, int64_t width, const float* v, int64_t col_stride,
                                      float* const* out, int64_t dim0) {
  f32x8 acc[TV][DV];
  for (int t = 0; t < TV; ++t)
    for (int i = 0; i < DV; ++i) acc[t][i] = f32x8{};
  for (int64_t j = 0; j < width; ++j) {
    const float* vj = v + j * col_stride + dim0;
    for (int i = 0; i < DV; ++i) {
      const f32x8 vv = load8(vj + 8 * i);
      for (int t = 0; t < TV; ++t) acc[t][i] += p[t][j] * vv;
    }
  }
  for (int t = 0; t < TV; ++t)
    for (int i = 0; i < DV; ++i) __builtin_memcpy(out[t] + dim0 + 8 * i, &acc[t][i], sizeof acc[t][i]);
}

// One work item of prefill_attention_f32 at 8 floats a vector (prefill_item_f32's).
FASTGATE_AVX2_FMA_TARGET void prefill_item_f32x8(const float* q, int64_t q_head, int64_t q_row, const float* kt,
                                                 const float* v, int64_t v_col, int64_t start, int64_t r0, int64_t r1,
                                                 int64_t h, int64_t G, int64_t H, int64_t D, float scale,
                                                 float* scores, int64_t spad, float* out) {
  const int64_t nv = G * (r1 - r0);  // query vectors: (row, head) pairs, row-major
  auto head_of = [&](int64_t i) { return h * G + i % G; };
  auto row_of = [&](int64_t i) { return r0 + i / G; };
  for (int64_t i0 = 0; i0 < nv; i0 += kScoreTile) {  // scores
    const int tile = static_cast<int>(std::min<int64_t>(kScoreTile, nv - i0));
    const float* qv[kScoreTile];
    const int64_t width = score_tile_queries(q, q_head, q_row, start, i0, tile, row_of, head_of, qv);
    for (int64_t g = 0; g < (width + 7) / 8; ++g) {
      f32x8 acc[kScoreTile];
      for (int t = 0; t < kScoreTile; ++t) acc[t] = f32x8{};
      const float* kg = kt + g * D * 8;
      for (int64_t d = 0; d < D; ++d) {
        const f32x8 kk = load8(kg + d * 8);
        for (int t = 0; t < kScoreTile; ++t) acc[t] += qv[t][d] * kk;
      }
      for (int t = 0; t < tile; ++t) {
        const f32x8 x = acc[t] * scale;
        __builtin_memcpy(scores + (i0 + t) * spad + g * 8, &x, sizeof x);
      }
    }
  }
  for (int64_t i = 0; i < nv; ++i) softmax_prefix8(scores + i * spad, start + row_of(i) + 1);
  const int TV = D == 32 ? 2 : 1;  // TV x 4 or 1 x 8 accumulators of AVX2's 16 registers
  for (int64_t i0 = 0; i0 < nv; i0 += TV) {  // values: a tile of TV vectors of one key / value head
    const float* p[2];
    float* o[2];
    float spare[2][128];
    const int64_t width = TV == 2 ? value_tile_rows<2, 8>(i0, nv, start, scores, spad, out, H, D, row_of, head_of, p, o,
                                                         &spare[0][0])
                                  : value_tile_rows<1, 8>(i0, nv, start, scores, spad, out, H, D, row_of, head_of, p, o,
                                                         &spare[0][0]);
    if (D == 32)
      value_tile_f32x8<4, 2>(p, width, v, v_col, o, 0);
    else
      for (int64_t d0 = 0; d0 < D; d0 += 64) value_tile_f32x8<8, 1>(p, width, v, v_col, o, d0);
  }
}
#endif

bool prefill_attention_f32_supported() {
#if defined(FASTGATE_AVX512) && defined(FASTGATE_BF16_KERNEL)  // the bf16 kernel's helpers and <immintrin.h>
  static const bool avx2 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return cpu_has_avx512() || avx2;
#else
  return false;
#endif
}

// prefill_attention_bf16's layout and semantics over float32 q, keys, values and out (D one of 32, 64, 128).
void prefill_attention_f32(uintptr_t q_ptr, int64_t q_head, int64_t q_row, uintptr_t k_ptr, uintptr_t v_ptr,
                           int64_t kv_head, int64_t kv_col, uintptr_t out_ptr, int64_t n, int64_t H, int64_t Hkv,
                           int64_t D, int64_t start, double scale, int64_t threads) {
#if defined(FASTGATE_AVX512) && defined(FASTGATE_BF16_KERNEL)  // the bf16 kernel's helpers and <immintrin.h>
  if (!prefill_attention_f32_supported())
    throw std::invalid_argument("prefill_attention_f32: this CPU has neither AVX-512 nor AVX2 and FMA");
  check_prefill_shape("prefill_attention_f32", n, start, H, Hkv, D);
  if (n == 0) return;
  const float* q = reinterpret_cast<const float*>(q_ptr);
  const float* k = reinterpret_cast<const float*>(k_ptr);
  const float* v = reinterpret_cast<const float*>(v_ptr);
  float* out = reinterpret_cast<float*>(out_ptr);
  const int64_t N = use_width16() ? 16 : 8;  // keys a register: decided per call, as the layer ops' width
  const int64_t S = start + n, G = H / Hkv, groups = (S + N - 1) / N, spad = groups * N, per_head = groups * D * N;
  const float sc = static_cast<float>(scale);
  py::gil_scoped_release release;
  std::vector<float> kt(Hkv * per_head);
  prefill_items(n, S, Hkv, G, D, spad, threads,
                [&](int64_t h) {
                  if (N == 16) pack_keys_f32(k + h * kv_head, kv_col, S, D, kt.data() + h * per_head);
                  else pack_keys_f32x8(k + h * kv_head, kv_col, S, D, kt.data() + h * per_head);
                },
                [&](int64_t h, int64_t r0, int64_t r1, float* scores) {
                  const float* kth = kt.data() + h * per_head;
                  const float* vh = v + h * kv_head;
                  if (N == 8)
                    prefill_item_f32x8(q, q_head, q_row, kth, vh, kv_col, start, r0, r1, h, G, H, D, sc, scores, spad,
                                       out);
                  else if (D == 32)
                    prefill_item_f32<2>(q, q_head, q_row, kth, vh, kv_col, start, r0, r1, h, G, H, sc, scores, spad, out);
                  else if (D == 64)
                    prefill_item_f32<4>(q, q_head, q_row, kth, vh, kv_col, start, r0, r1, h, G, H, sc, scores, spad, out);
                  else
                    prefill_item_f32<8>(q, q_head, q_row, kth, vh, kv_col, start, r0, r1, h, G, H, sc, scores, spad, out);
                });
#else
  (void)q_ptr, (void)q_head, (void)q_row, (void)k_ptr, (void)v_ptr, (void)kv_head, (void)kv_col, (void)out_ptr;
  (void)n, (void)H, (void)Hkv, (void)D, (void)start, (void)scale, (void)threads;
  throw std::invalid_argument("prefill_attention_f32: not built for this platform");
#endif
}

// -------------------------------------------------------------------------------- weight-only quantized products
// The decode step's products over the weights' own codes (ops int4_matmul, int8_matmul; fastgate/ops/quant.py).
// torch's CPU kernels (aten._weight_int4pack_mm_for_cpu, _weight_int8pack_mm) ran a batch-1 step of SmolLM2's int4
// blocks at ~16 GB/s of codes on one Zen 4 core, and its int8 head at ~17 GB/s: together 90% of the step. Here, with
// AVX512-BF16:
//
// int4 (codes q [N, K / 2], byte j of a row holding k = 2j in its low nibble and 2j + 1 in its high one; scale, zero
// [N, K / 32] float32; w = (code - 8) scale + zero): the codes, scales and zeros in tiles of four rows, one forward
// stream a tile, made once a layer; 32 codes become exact bf16 values 1 + c / 16 in one shift and one ternary logic
// operation, and one vdpbf16ps multiplies them by the input, permuted once a call to match (int4_tiles_run below has
// the layout and the algebra). Four weight rows share each load of the input; the zeros' part once a group.
// int8 (q [N, K] int8, scale [N] float32; w = q scale): the codes in tiles of four rows too, widened to float32 in
// registers, float32 products and sums, the scale once a row.
// Both sum in float32 (in another order than torch's kernels: the last bits of a sum), prefetch the weights they
// stream, and round the output to bf16 once, to nearest even. Built where GCC targets AVX512-BF16; chosen only where
// the CPU has it (the registry). The 256-bit half block of int4_tiles_run repeats the 512-bit block's steps in the
// other width's intrinsics (K = 576: 18 groups, four blocks and a half).
constexpr int kQuantInputs = 4;  // input rows a tile (M > 4: tiles of 4 in turn)
// the weights are streamed from memory: each load asks for the line this far ahead (the hardware's prefetchers
// alone left the int4 kernel at ~16 GB/s on a Zen 4 EPYC; 2 / 4 / 8 KB ahead: 4.9 / 3.7 / 3.4 ms for SmolLM2's 120)
constexpr int64_t kPrefetchBytes = 8192;

// The multiply-adds a thread of a quantized product takes at least (a bench hook sets it: set_quant_grain)
std::atomic<int64_t> g_quant_grain{1 << 17};

void set_quant_grain(int64_t grain) {
  if (grain < 1) throw std::invalid_argument("set_quant_grain: grain >= 1");
  g_quant_grain.store(grain, std::memory_order_relaxed);
}

// Splits N weight rows over the threads, each a run of whole units of 8 rows (every kernel's tile is 4 or 8 rows)
// as even as the units allow, and a thread's run into blocks of 64 rows, the M input rows into tiles of `inputs`,
// calling rows(m0, mb, n0, n1) for each (n0 a unit's first row). Why units, not blocks, between threads: with the
// threads' runs in whole blocks of 64, SmolLM2's 576-row products (o, down) split 4 : 5 blocks and the caller waited
// for the worker ~1 / 9 of each (2 threads); runs of 8-row units split them 36 : 36.
template <class Rows>
void quant_split(int64_t M, int64_t N, int64_t K, int64_t threads, Rows rows, int64_t inputs = kQuantInputs) {
  constexpr int64_t kUnit = 8, kBlock = 64;
  const int64_t units = (N + kUnit - 1) / kUnit;
  split_rows(units, M * N * K, g_quant_grain.load(std::memory_order_relaxed), [&](int64_t first, int64_t step) {
    // a thread's rows side by side, not every step-th: the kernels prefetch kPrefetchBytes ahead in the weights,
    // which past a block's end is the next block's (SmolLM2's 576 -> 3,072 rows: 2 threads read 8.4 GB/s with the
    // blocks interleaved, where 1 read 7.9)
    const int64_t begin = first * units / step * kUnit, end = std::min(N, (first + 1) * units / step * kUnit);
    for (int64_t n0 = begin; n0 < end; n0 += kBlock) {
      const int64_t n1 = std::min(end, n0 + kBlock);
      for (int64_t m0 = 0; m0 < M; m0 += inputs) rows(m0, std::min<int64_t>(inputs, M - m0), n0, n1);
    }
    return true;
  }, threads);
}

#ifdef FASTGATE_BF16_KERNEL

// The int4 codes as the kernel streams them: tiles of four weight rows (kInt4TileRows), one forward stream a tile
// (fastgate.ops.quant.int4_bf16_tiles makes them once a layer). Tile t holds rows 4t .. 4t + 3 (rows past N zero)
// in blocks of four groups (the last block two groups where G % 4 == 2; G otherwise padded with zero groups to a
// multiple of four); a block of gb groups is 96 gb bytes:
//     codes [4 rows][16 gb] bytes (a row's 32-bit lane j: codes 8j .. 8j + 7 in its nibbles p = 0 .. 7, bits 4p ..
//           4p + 3, the plain codes' own byte order), scales [4 rows][gb] float32, corrections [4 rows][gb] float32
//           (zero - 24 scale, rounded once)
// Pass s (0 .. 3) of a row's 64 bytes moves nibbles s and s + 4 to bits 3 .. 6 and 19 .. 22 and sets 0x3F80 above
// each: the bf16 pair (1 + c / 16, 1 + c' / 16), exact, in one shift and one ternary logic operation; one vdpbf16ps
// then multiplies the pairs by xp, the input permuted to match (int4_prepare: xp [blocks][4 passes][32] bf16 per
// input row, zero past K), into float32. The sum of the four passes is, in the lanes of group g, sum (1 + c / 16) x
// over the group: times its scale into the row's 16 lanes. With S_g the group's sum of x,
//     y = 16 sum_g scale_g (S_g + sum_k c x / 16) + sum_g (zero_g - 24 scale_g) S_g
// (w = (c - 8) scale + zero): the corrections' sum in the lanes [row][g % 4] of one more accumulator. The offset S_g
// stays within 16x the codes' own part (a code at the mantissa's top bits, not its bottom: 1 + c / 16, not 128 + c),
// so cancelling it costs ~4 of float32's 24 bits.
// Why tiles, not the rows as held: a tile of four rows read side by side from the plain codes is twelve streams
// (codes, scales, zeros of each row), which the CPU's prefetchers did not follow; one stream a tile took SmolLM2's
// 120 int4 products of a batch-1 step (80 MB) from 5.2 to 3.6 ms on one Zen 4 core (15 -> 21 GB/s), 3.2 to 2.5 ms on
// two (25 -> 32 GB/s, a sum's read then 35).
constexpr int kInt4TileRows = 4;
constexpr int64_t kInt4Float = 0, kInt4Half = 1;  // the tiles' forms: float32 scales and corrections, or d and m

// an output: the sum rounded to bf16, then, with a residual res [M, N] bf16, bf16(res + that) (torch's h + y of bf16)
inline uint16_t int4_out(float sum, const uint16_t* res, int64_t i) {
  const uint16_t y = f32_to_bf16(sum);
  return res ? f32_to_bf16(bf16_to_f32(res[i]) + bf16_to_f32(y)) : y;
}

// the groups a row of K inputs has in the tiles: G, or G rounded up to four unless G % 4 == 2
inline int64_t int4_tile_groups(int64_t K) {
  const int64_t G = K / 32;
  return G % 4 == 2 ? G : (G + 3) / 4 * 4;
}

// the four passes' bf16 pairs (1 + c / 16, 1 + c' / 16) of 64 (or 32) bytes of codes: nibbles s and s + 4 of each
// 32-bit lane moved to bits 3 .. 6 and 19 .. 22, 0x3F80 set above each
FASTGATE_BF16_TARGET inline void int4_passes(__m512i q, __m512bh w[4]) {
  const __m512i nibbles = _mm512_set1_epi32(0x00780078), one = _mm512_set1_epi32(0x3F803F80);
  w[0] = reinterpret_cast<__m512bh>(_mm512_ternarylogic_epi32(_mm512_slli_epi32(q, 3), nibbles, one, 0xEA));
  w[1] = reinterpret_cast<__m512bh>(_mm512_ternarylogic_epi32(_mm512_srli_epi32(q, 1), nibbles, one, 0xEA));
  w[2] = reinterpret_cast<__m512bh>(_mm512_ternarylogic_epi32(_mm512_srli_epi32(q, 5), nibbles, one, 0xEA));
  w[3] = reinterpret_cast<__m512bh>(_mm512_ternarylogic_epi32(_mm512_srli_epi32(q, 9), nibbles, one, 0xEA));
}

FASTGATE_BF16_TARGET inline void int4_passes(__m256i q, __m256bh w[4]) {
  const __m256i nibbles = _mm256_set1_epi32(0x00780078), one = _mm256_set1_epi32(0x3F803F80);
  w[0] = reinterpret_cast<__m256bh>(_mm256_ternarylogic_epi32(_mm256_slli_epi32(q, 3), nibbles, one, 0xEA));
  w[1] = reinterpret_cast<__m256bh>(_mm256_ternarylogic_epi32(_mm256_srli_epi32(q, 1), nibbles, one, 0xEA));
  w[2] = reinterpret_cast<__m256bh>(_mm256_ternarylogic_epi32(_mm256_srli_epi32(q, 5), nibbles, one, 0xEA));
  w[3] = reinterpret_cast<__m256bh>(_mm256_ternarylogic_epi32(_mm256_srli_epi32(q, 9), nibbles, one, 0xEA));
}

// tiles t0 .. t1 - 1 of the int4 product for MB input rows (xp, S as int4_prepare makes them, rows xp_stride and
// S_stride apart; S zero past G)
// a block's scales and corrections, [4 rows][4 groups] (int4_floats16) or [4 rows][2 groups] (int4_floats8), from p:
// float32 as held, or made from float16 d and m as the float32 form's were made at load
template <bool Half>
FASTGATE_BF16_TARGET inline void int4_floats16(const uint8_t* p, __m512& sc, __m512& co) {
  if constexpr (Half) {
    sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512 zero = _mm512_add_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))),
                                      _mm512_mul_ps(_mm512_set1_ps(8.0f), sc));  // m + 8 d: 8 d exact, one rounding
    co = _mm512_fnmadd_ps(_mm512_set1_ps(24.0f), sc, zero);
  } else {
    sc = _mm512_loadu_ps(reinterpret_cast<const float*>(p));
    co = _mm512_loadu_ps(reinterpret_cast<const float*>(p + 64));
  }
}

template <bool Half>
FASTGATE_BF16_TARGET inline void int4_floats8(const uint8_t* p, __m256& sc, __m256& co) {
  if constexpr (Half) {
    sc = _mm256_maskz_cvtph_ps(0xFF, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));  // AVX512VL: no F16C target
    const __m256 zero = _mm256_add_ps(_mm256_maskz_cvtph_ps(0xFF, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))),
                                      _mm256_mul_ps(_mm256_set1_ps(8.0f), sc));
    co = _mm256_fnmadd_ps(_mm256_set1_ps(24.0f), sc, zero);
  } else {
    sc = _mm256_loadu_ps(reinterpret_cast<const float*>(p));
    co = _mm256_loadu_ps(reinterpret_cast<const float*>(p + 32));
  }
}

// Half (the tiles' second form, kInt4Half): a block's scales and zeros are a Q4_1 file's own float16 d and m ([4 rows]
// [gb] each, 80 gb bytes a block), the float32 scale d and correction (m + 8 d) - 24 d made here as the float32 form's
// were made at load (fastgate.ops.quant.int4_bf16_tiles takes this form only where they come out the same bits).
template <int MB, bool Half>
FASTGATE_BF16_TARGET void int4_tiles_run(const uint16_t* xp, int64_t xp_stride, const float* S, int64_t S_stride,
                                         const uint8_t* tiles, int64_t K, int64_t t0, int64_t t1, int64_t N,
                                         uint16_t* y, const uint16_t* res) {
  // row r's lanes: group g's four lanes get scale [r][g] (constants in memory: the accumulators take the registers)
  alignas(64) static const int32_t spread[4][16] = {
      {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3},         {4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7},
      {8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11}, {12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15}};
  alignas(32) static const int32_t spread8[4][8] = {
      {0, 0, 0, 0, 1, 1, 1, 1}, {2, 2, 2, 2, 3, 3, 3, 3}, {4, 4, 4, 4, 5, 5, 5, 5}, {6, 6, 6, 6, 7, 7, 7, 7}};
  constexpr int64_t kGroupBytes = Half ? 80 : 96;  // a row-group's codes and its two floats, times four rows
  const int64_t Gt = int4_tile_groups(K), full = Gt / 4, tile_bytes = kGroupBytes * Gt;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* p = tiles + t * tile_bytes;
    __m512 acc[kInt4TileRows][MB], corr[MB];  // corr: lanes [row][g % 4]
    for (int m = 0; m < MB; ++m) {
      corr[m] = _mm512_setzero_ps();
      for (int r = 0; r < kInt4TileRows; ++r) acc[r][m] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < full; ++b, p += 4 * kGroupBytes) {  // a block: codes 256 bytes, then the floats
      for (int l = 0; l < 4 * kGroupBytes / 64; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes + 64 * l, _MM_HINT_T0);
      __m512 sc, co;  // [4 rows][4 groups]
      int4_floats16<Half>(p + 256, sc, co);
      for (int m = 0; m < MB; ++m)
        corr[m] = _mm512_fmadd_ps(co, _mm512_broadcast_f32x4(_mm_loadu_ps(S + m * S_stride + 4 * b)), corr[m]);
      for (int r = 0; r < kInt4TileRows; ++r) {
        const __m512i q = _mm512_loadu_si512(p + 64 * r);  // 128 codes: four groups of row r
        const __m512 s = _mm512_permutexvar_ps(_mm512_load_si512(spread[r]), sc);
        __m512bh w[4];
        int4_passes(q, w);
        for (int m = 0; m < MB; ++m) {
          const uint16_t* xb = xp + m * xp_stride + b * 128;
          __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), w[0], reinterpret_cast<__m512bh>(_mm512_loadu_si512(xb)));
          d = _mm512_dpbf16_ps(d, w[1], reinterpret_cast<__m512bh>(_mm512_loadu_si512(xb + 32)));
          d = _mm512_dpbf16_ps(d, w[2], reinterpret_cast<__m512bh>(_mm512_loadu_si512(xb + 64)));
          d = _mm512_dpbf16_ps(d, w[3], reinterpret_cast<__m512bh>(_mm512_loadu_si512(xb + 96)));
          acc[r][m] = _mm512_fmadd_ps(d, s, acc[r][m]);
        }
      }
    }
    if (Gt % 4 == 2) {  // the last two groups (K = 576: 18): codes 128 bytes, scales 32, corrections 32; 256 bits wide
      __m256 sc, co;  // [4 rows][2 groups]
      int4_floats8<Half>(p + 128, sc, co);
      for (int m = 0; m < MB; ++m) {  // [4 rows][2] -> corr's lanes 4r, 4r + 1
        const __m128 s2 = _mm_castpd_ps(_mm_load1_pd(reinterpret_cast<const double*>(S + m * S_stride + 4 * full)));
        const __m256 c2 = _mm256_mul_ps(co, _mm256_set_m128(s2, s2));
        corr[m] = _mm512_add_ps(corr[m], _mm512_maskz_permutexvar_ps(
                                             0x3333, _mm512_set_epi32(0, 0, 7, 6, 0, 0, 5, 4, 0, 0, 3, 2, 0, 0, 1, 0),
                                             _mm512_castps256_ps512(c2)));
      }
      for (int r = 0; r < kInt4TileRows; ++r) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * r));
        const __m256 s = _mm256_permutexvar_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(spread8[r])), sc);
        __m256bh w[4];
        int4_passes(q, w);
        for (int m = 0; m < MB; ++m) {
          const uint16_t* xb = xp + m * xp_stride + full * 128;
          __m256 d = _mm256_setzero_ps();
          for (int ps = 0; ps < 4; ++ps)
            d = _mm256_dpbf16_ps(d, w[ps], reinterpret_cast<__m256bh>(
                                                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 32 * ps))));
          acc[r][m] = _mm512_add_ps(acc[r][m], _mm512_zextps256_ps512(_mm256_mul_ps(d, s)));  // the low 8 lanes
        }
      }
    }
    for (int m = 0; m < MB; ++m) {  // the four rows' sums at once: halves added, then two rounds of pairwise sums
      __m256 h[4];
      for (int r = 0; r < 4; ++r)
        h[r] = _mm256_add_ps(_mm512_castps512_ps256(acc[r][m]),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][m]), 1)));
      const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
      const __m128 codes = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
      const __m128 c = _mm_hadd_ps(_mm_hadd_ps(_mm512_extractf32x4_ps(corr[m], 0), _mm512_extractf32x4_ps(corr[m], 1)),
                                   _mm_hadd_ps(_mm512_extractf32x4_ps(corr[m], 2), _mm512_extractf32x4_ps(corr[m], 3)));
      alignas(16) float sums[4];
      _mm_store_ps(sums, _mm_fmadd_ps(_mm_set1_ps(16.0f), codes, c));  // 16x: exact
      for (int r = 0; r < kInt4TileRows && 4 * t + r < N; ++r)
        y[m * N + 4 * t + r] = int4_out(sums[r], res, m * N + 4 * t + r);
    }
  }
}

// The int8 codes as the kernel streams them: tiles of four weight rows, one forward stream a tile (fastgate.ops.quant.
// int8_bf16_tiles makes them once a layer): tile t [K16 / 16][4 rows][16] int8, K16 = K rounded up to 16, codes past
// K and rows past N zero; each 64-byte line is the four rows' next 16 codes. Why: SmolLM2's LM head (49,152 x 576,
// 28 MB) read as rows side by side, four at a time, took 1.5 ms of a batch-1 decode step on two Zen 4 cores (19
// GB/s); as tiles 0.65 ms (43 GB/s). The sums run as the rows' did (16 lanes, k in order): the same bits.
constexpr int kInt8TileRows = 4;

// tiles t0 .. t1 - 1 of the int8 product for MB input rows x [MB, K16] float32 (rows K16 apart, zero past K) ->
// y bf16; scale [N] float32
template <int MB>
FASTGATE_BF16_TARGET void int8_tiles_run(const float* x, const int8_t* tiles, const float* scale, int64_t K16,
                                         int64_t t0, int64_t t1, int64_t N, uint16_t* y) {
  for (int64_t t = t0; t < t1; ++t) {
    const int8_t* p = tiles + t * kInt8TileRows * K16;
    __m512 acc[kInt8TileRows][MB];
    for (int r = 0; r < kInt8TileRows; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K16; k += 16, p += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
      __m512 xv[MB];
      for (int m = 0; m < MB; ++m) xv[m] = _mm512_loadu_ps(x + m * K16 + k);
      for (int r = 0; r < kInt8TileRows; ++r) {
        const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * r))));
        for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_fmadd_ps(w, xv[m], acc[r][m]);
      }
    }
    for (int r = 0; r < kInt8TileRows && kInt8TileRows * t + r < N; ++r) {
      const int64_t n = kInt8TileRows * t + r;
      for (int m = 0; m < MB; ++m) y[m * N + n] = f32_to_bf16(_mm512_reduce_add_ps(acc[r][m]) * scale[n]);
    }
  }
}

#endif

bool quant_kernels_supported() { return prefill_attention_bf16_supported(); }

#ifdef FASTGATE_BF16_KERNEL
// One input row's preparation for int4_tiles_run: the groups' sums S [G] (float32) and the row permuted for the passes,
// xp [blocks * 128] bf16 (block b, pass s, pair j: the inputs of codes 8j + s and 8j + s + 4 of the block's 128; zero
// past K), 32 values a vector (two-source word permutes); S_g = the group's 32 values summed in float32.
FASTGATE_BF16_TARGET void int4_prepare(const uint16_t* x, int64_t K, float* S, uint16_t* xp) {
  const int64_t G = K / 32, blocks = (G + 3) / 4;
  for (int64_t g = 0; g < G; ++g) {
    const __m512i v = _mm512_loadu_si512(x + g * 32);  // 32 bf16
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));  // the even ones, widened
    const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
    S[g] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
  }
  // pass s, position 2j + h <- code 8j + s + 4h: positions 0-15 from the block's first 64 codes, 16-31 from the rest
  alignas(64) uint16_t idx[4][32];
  for (int s = 0; s < 4; ++s)
    for (int t = 0; t < 32; ++t) idx[s][t] = static_cast<uint16_t>((8 * (t / 2) + s + 4 * (t % 2)) % 64);
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i v[4];
    for (int i = 0; i < 4; ++i) {
      const int64_t k0 = b * 128 + 32 * i, left = K - k0;
      v[i] = left >= 32 ? _mm512_loadu_si512(x + k0)
                        : (left > 0 ? _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << left) - 1), x + k0)
                                    : _mm512_setzero_si512());
    }
    for (int s = 0; s < 4; ++s) {
      const __m512i ix = _mm512_load_si512(idx[s]);
      const __m512i a = _mm512_permutex2var_epi16(v[0], ix, v[1]), c = _mm512_permutex2var_epi16(v[2], ix, v[3]);
      _mm512_storeu_si512(xp + b * 128 + 32 * s, _mm512_mask_blend_epi16(0xFFFF0000u, a, c));
    }
  }
}
#endif

#ifdef FASTGATE_BF16_KERNEL
// int4_matmul_bf16's work, its inputs checked and the GIL released by the caller (decode_layers_bf16 calls it too)
void int4_bf16(const uint16_t* x, int64_t x_stride, const uint8_t* tiles, int64_t form, uint16_t* y, int64_t M,
               int64_t N, int64_t K, int64_t threads, const uint16_t* norm, float eps, const uint16_t* res) {
  const int64_t G = K / 32, blocks = (G + 3) / 4, xp_stride = blocks * 128, S_stride = (G + 15) / 16 * 16;
  // per input row (normed first where asked): each group's sum S_g (zero past G) and the row permuted for the passes
  std::vector<float> S(M * S_stride, 0.0f);
  std::vector<uint16_t> xp(M * xp_stride), xn(norm ? K : 0);
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* xm = x + m * x_stride;
    if (norm) {
      rms_norm_row(xm, norm, xn.data(), K, eps);
      xm = xn.data();
    }
    int4_prepare(xm, K, S.data() + m * S_stride, xp.data() + m * xp_stride);
  }
  const int64_t rows = (N + kInt4TileRows - 1) / kInt4TileRows * kInt4TileRows;  // whole tiles
  quant_split(M, rows, K, threads, [&](int64_t m0, int64_t mb, int64_t n0, int64_t n1) {
    const uint16_t* xm = xp.data() + m0 * xp_stride;
    const float* Sm = S.data() + m0 * S_stride;
    uint16_t* ym = y + m0 * N;
    const uint16_t* rm = res ? res + m0 * N : nullptr;
    const int64_t t0 = n0 / kInt4TileRows, t1 = n1 / kInt4TileRows;  // n0, n1: multiples of 8 or the end
    const auto run = [&](auto half) {
      constexpr bool H = decltype(half)::value;
      switch (mb) {
        case 1: int4_tiles_run<1, H>(xm, xp_stride, Sm, S_stride, tiles, K, t0, t1, N, ym, rm); break;
        case 2: int4_tiles_run<2, H>(xm, xp_stride, Sm, S_stride, tiles, K, t0, t1, N, ym, rm); break;
        case 3: int4_tiles_run<3, H>(xm, xp_stride, Sm, S_stride, tiles, K, t0, t1, N, ym, rm); break;
        default: int4_tiles_run<4, H>(xm, xp_stride, Sm, S_stride, tiles, K, t0, t1, N, ym, rm); break;
      }
    };
    if (form == kInt4Half) run(std::true_type{}); else run(std::false_type{});
  });
}
#endif

// x [M, K] bf16 (rows x_stride elements apart, unit stride along K); tiles: the layer's codes, scales and zeros in the
// kernel's tiles (above; fastgate.ops.quant.int4_bf16_tiles: ceil(N / 4) tiles of 96 G' bytes, G' the tile groups),
// contiguous; out [M, N] bf16 contiguous. K a multiple of 32, at most 16,384. norm_ptr (0: none): the rows are first
// RMS-normed with that weight [K] bf16 and eps, as rms_norm_bf16 norms them (the same loop), so that the fused pass's
// norm and the product after it are one call. res_ptr (0: none): a residual [M, N] bf16 contiguous added to the
// product as torch adds two bf16 tensors (out = res + y, each output rounded once more).
void int4_matmul_bf16(uintptr_t x_ptr, int64_t x_stride, uintptr_t tiles_ptr, int64_t form, uintptr_t out_ptr,
                      int64_t M, int64_t N, int64_t K, int64_t threads, uintptr_t norm_ptr, double eps,
                      uintptr_t res_ptr) {
  pool_spin();  // the decode path: idle workers spin between its calls
#ifdef FASTGATE_BF16_KERNEL
  if (!quant_kernels_supported()) throw std::invalid_argument("int4_matmul_bf16: this CPU has no AVX512-BF16");
  if (M < 0 || N <= 0 || K <= 0 || K % 32 != 0 || K > 16384 || x_stride < K)
    throw std::invalid_argument("int4_matmul_bf16: bad shape (K a multiple of 32, at most 16384)");
  if (form != kInt4Float && form != kInt4Half) throw std::invalid_argument("int4_matmul_bf16: form 0 or 1");
  if (M == 0) return;
  py::gil_scoped_release release;
  int4_bf16(reinterpret_cast<const uint16_t*>(x_ptr), x_stride, reinterpret_cast<const uint8_t*>(tiles_ptr), form,
            reinterpret_cast<uint16_t*>(out_ptr), M, N, K, threads, reinterpret_cast<const uint16_t*>(norm_ptr),
            static_cast<float>(eps), reinterpret_cast<const uint16_t*>(res_ptr));
#else
  (void)x_ptr, (void)x_stride, (void)tiles_ptr, (void)form, (void)out_ptr, (void)M, (void)N, (void)K, (void)threads;
  (void)norm_ptr, (void)eps, (void)res_ptr;
  throw std::invalid_argument("int4_matmul_bf16: not built for this platform");
#endif
}

// x [M, K] bf16 (rows x_stride apart, unit stride along K); tiles: the layer's codes q [N, K] int8 in the kernel's
// tiles (above: ceil(N / 4) tiles of 4 K16 bytes), contiguous; scale [N] float32; out [M, N] bf16 contiguous.
void int8_matmul_bf16(uintptr_t x_ptr, int64_t x_stride, uintptr_t tiles_ptr, uintptr_t scale_ptr, uintptr_t out_ptr,
                      int64_t M, int64_t N, int64_t K, int64_t threads) {
  pool_spin();  // the decode path: idle workers spin between its calls
#ifdef FASTGATE_BF16_KERNEL
  if (!quant_kernels_supported()) throw std::invalid_argument("int8_matmul_bf16: this CPU has no AVX512-BF16");
  if (M < 0 || N <= 0 || K <= 0 || x_stride < K) throw std::invalid_argument("int8_matmul_bf16: bad shape");
  if (M == 0) return;
  const uint16_t* x = reinterpret_cast<const uint16_t*>(x_ptr);
  const int8_t* tiles = reinterpret_cast<const int8_t*>(tiles_ptr);
  const float* scale = reinterpret_cast<const float*>(scale_ptr);
  uint16_t* y = reinterpret_cast<uint16_t*>(out_ptr);
  py::gil_scoped_release release;
  const int64_t K16 = (K + 15) / 16 * 16;
  std::vector<float> xf(M * K16, 0.0f);  // the inputs widened once, zero past K
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xf[m * K16 + k] = bf16_to_f32(x[m * x_stride + k]);
  const int64_t rows = (N + kInt8TileRows - 1) / kInt8TileRows * kInt8TileRows;  // whole tiles
  quant_split(M, rows, K, threads, [&](int64_t m0, int64_t mb, int64_t n0, int64_t n1) {
    const float* xm = xf.data() + m0 * K16;
    uint16_t* ym = y + m0 * N;
    const int64_t t0 = n0 / kInt8TileRows, t1 = n1 / kInt8TileRows;  // n0, n1: multiples of 8 or the end
    switch (mb) {
      case 1: int8_tiles_run<1>(xm, tiles, scale, K16, t0, t1, N, ym); break;
      case 2: int8_tiles_run<2>(xm, tiles, scale, K16, t0, t1, N, ym); break;
      case 3: int8_tiles_run<3>(xm, tiles, scale, K16, t0, t1, N, ym); break;
      default: int8_tiles_run<4>(xm, tiles, scale, K16, t0, t1, N, ym); break;
    }
  });
#else
  (void)x_ptr, (void)x_stride, (void)tiles_ptr, (void)scale_ptr, (void)out_ptr, (void)M, (void)N, (void)K;
  (void)threads;
  throw std::invalid_argument("int8_matmul_bf16: not built for this platform");
#endif
}

// ---- The decode step's quantized products over float32 rows (AVX2 + FMA) ----
//
// The same products as int4_matmul_bf16 / int8_matmul_bf16 for a float32 model: x [M, K] float32 in, y [M, N]
// float32 out, nothing rounded to bf16. Written for CPUs without AVX-512 (an AVX2-only EPYC: there torch's weight-only
// kernels run a scalar loop on float32 rows, and bf16 is emulated), and taken by float32 rows on every x86-64 CPU with
// AVX2 and FMA. int4: a group's 16 bytes widen to 32-bit lanes (vpmovzxbd), a mask and a shift give its even and odd
// codes as exact float32, and each multiplies the input permuted to match (xp: per 16 codes, the 8 even inputs, then
// the 8 odd ones), so that
//     y = sum_g scale_g sum_k c_k x_k + sum_g (zero_g - 8 scale_g) S_g        (w = (c - 8) scale + zero)
// with S_g the group's sum of x. int8: codes widened to float32, float32 products, the scale once a row. Both sum in
// float32 in their own order (the last bits of a sum differ from F.linear's), prefetch the weights they stream, and
// never load past a row (every load is whole: a group is 16 bytes, an int8 row's tail goes scalar).
#if defined(__x86_64__) && defined(__GNUC__)
#define FASTGATE_AVX2_KERNEL 1
#define FASTGATE_AVX2_TARGET __attribute__((target("avx2,fma")))
#include <immintrin.h>
#endif

bool quant_f32_kernels_supported() {
#ifdef FASTGATE_AVX2_KERNEL
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return ok;
#else
  return false;
#endif
}

#ifdef FASTGATE_AVX2_KERNEL
constexpr int kF32Inputs = 2;  // int8: input rows a tile (16 ymm registers: 4 rows x 2 inputs of sums, 2 inputs, 1 code)
constexpr int kF32Int4Inputs = 6;  // int4: input rows a tile (one weight row's codes decoded once for the six)

FASTGATE_AVX2_TARGET inline float hsum8_avx(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 p = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}

// The float32 kernels read their weights in tiles of kTileRows rows, the tile's rows interleaved group by group, so a
// tile is one forward stream (int4: codes [ceil(N / 8)][G][8][16] bytes, scales [ceil(N / 8)][G][8] float32; int8:
// codes [ceil(N / 8)][K8 / 8][8][8], K8 = K rounded up to 8, zero codes past K and in the last tile's rows past N).
// Why: read row by row, a tile's rows were eight streams 288 bytes apart, which the prefetchers did not follow: one
// thread of SmolLM2's 30 layers of int4 products at batch 1 took 10.8 ms (7.4 GB/s), tiled 7.0 (11.1 GB/s, the
// machine's single-core read rate); its int8 LM head 4.5 against 2.0-2.3 ms (an AVX2-only EPYC, one run each of a
// standalone bench). fastgate.ops.quant makes the tiles from a layer's plain codes once. The int4 zeros come as
// offsets zero - 8 scale, tiled as the scales: summed for a tile's eight rows at once in its loop (a row's gathered
// scales and zeros summed after its loop cost ~40% of a 576-wide row's time).
constexpr int64_t kTileRows = 8;

FASTGATE_AVX2_TARGET inline __m256 hsum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                                           __m256 a6, __m256 a7) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));  // halves' sums of a0 .. a3
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// the sum of v's eight lanes, in hsum8x8's order: ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7))
FASTGATE_AVX2_TARGET inline float hsum8_pairs(__m256 v) {
  const __m256 h = _mm256_hadd_ps(v, v);
  const __m256 q = _mm256_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1)));
}

// rows n .. n + R of the int4 product for MB input rows (xp [MB][K] permuted, S [MB][G] group sums, both K and G
// apart) -> y [MB][N] float32 (+ res [MB][N] where given: y = res + product, one float32 addition); rows n .. n + R
// lie in one tile; only the first `valid` are written (a last tile's rows past N: zero codes, not written). With the
// offsets o_g = zero_g - 8 scale_g (tiled as the scales),
//     y = sum_g scale_g sum_k c_k x_k + sum_g o_g S_g,
// the first sum in 8 lanes a row, then its lanes in hsum8x8's order, the second in one chain of multiply-adds over g;
// a row's arithmetic is the same in either tile shape (a row's output does not depend on the rows batched with it).
// offs (R = 1 tiles): this row's lane of the tile's offset sums (int4_offsets_f32); the R = 8 tile sums its own.
template <int R, int MB>
FASTGATE_AVX2_TARGET inline void int4_tile_f32(const float* xp, const float* S, const uint8_t* qt, const float* st,
                                               const float* ot, int64_t K, int64_t n, int64_t valid, int64_t N,
                                               float* y, const float* res, const float* offs) {
  const int64_t G = K / 32, r0 = n % kTileRows;
  const int64_t tile = (n / kTileRows) * G * kTileRows;  // the tile's first scale (and offset)
  const uint8_t* qb = qt + tile * 16 + 16 * r0;  // group g of row r: qb + 128 g + 16 r
  const float* sb = st + tile + r0;  // its scale: sb + 8 g + r
  const float* ob = ot + tile + r0;  // its offset: ob + 8 g + r
  const bool lead = r0 == 0;  // the tile's first row prefetches for the tile (the others read what it brought)
  const __m256i low = _mm256_set1_epi32(15);
  __m256 acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();
  __m256 off = _mm256_setzero_ps();  // R = 8, MB = 1: the eight rows' offset sums, lane r row r
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* qg = qb + 16 * kTileRows * g;
    const float* sg = sb + kTileRows * g;
    const float* og = ob + kTileRows * g;
    if (lead) {  // a group of the tile: two lines of codes, a quarter line of scales and of offsets
      _mm_prefetch(reinterpret_cast<const char*>(qg) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(qg) + kPrefetchBytes + 64, _MM_HINT_T0);
      if (g % 2 == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(sg) + kPrefetchBytes / 4, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(og) + kPrefetchBytes / 4, _MM_HINT_T0);
      }
    }
    if constexpr (R == kTileRows && MB == 1)
      off = _mm256_fmadd_ps(_mm256_loadu_ps(og), _mm256_broadcast_ss(S + g), off);
    for (int r = 0; r < R; ++r) {
      const uint8_t* qr = qg + 16 * r;  // the group's 32 codes
      const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qr)));
      const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qr + 8)));
      const __m256 c0 = _mm256_cvtepi32_ps(_mm256_and_si256(v0, low));  // codes 0, 2, .. 14
      const __m256 c1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4));  // codes 1, 3, .. 15
      const __m256 c2 = _mm256_cvtepi32_ps(_mm256_and_si256(v1, low));  // codes 16, 18, .. 30
      const __m256 c3 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4));  // codes 17, 19, .. 31
      const __m256 s = _mm256_broadcast_ss(sg + r);
      for (int m = 0; m < MB; ++m) {
        const float* xb = xp + m * K + 32 * g;
        // two short chains, not one of five dependent multiply-adds a group (with eight rows a tile at one input
        // row: 157 -> 139 us for 576 -> 3,072 on an AVX2-only EPYC core, within that machine's noise)
        const __m256 d0 = _mm256_fmadd_ps(c1, _mm256_loadu_ps(xb + 8), _mm256_mul_ps(c0, _mm256_loadu_ps(xb)));
        const __m256 d1 = _mm256_fmadd_ps(c3, _mm256_loadu_ps(xb + 24), _mm256_mul_ps(c2, _mm256_loadu_ps(xb + 16)));
        acc[r][m] = _mm256_fmadd_ps(_mm256_add_ps(d0, d1), s, acc[r][m]);
      }
    }
  }
  if constexpr (R == kTileRows && MB == 1) {  // the eight rows' lane sums at once, plus their offsets' sums
    alignas(32) float sums[kTileRows];
    _mm256_store_ps(sums, _mm256_add_ps(hsum8x8(acc[0][0], acc[1][0], acc[2][0], acc[3][0], acc[4][0], acc[5][0],
                                                acc[6][0], acc[7][0]), off));
    for (int r = 0; r < valid; ++r) y[n + r] = res ? res[n + r] + sums[r] : sums[r];
  } else {
    for (int r = 0; r < R && r < valid; ++r)
      for (int m = 0; m < MB; ++m) {
        // plus the row's offsets' sum, its lane of the tile's (offs [MB][kTileRows] from this row's lane on:
        // int4_offsets_f32, one multiply-add a group as the lanes above take it)
        const float sum = hsum8_pairs(acc[r][m]) + offs[m * kTileRows + r];
        const int64_t i = m * N + n + r;
        y[i] = res ? res[i] + sum : sum;
      }
  }
}

// The offsets' sums sum_g o_g S_g of one tile's eight rows (lane r: row r) for MB input rows -> off [MB][kTileRows]:
// lane by lane the chain a row's scalar sum ran before (one multiply-add a group, in g's order), so the same bits.
// Why: run per row and input row, that chain of dependent scalar multiply-adds (~4 cycles each) held a multi-row
// product for a latency a group: SmolLM2's batch-16 step spent ~40 of its ~95 ms of layers there (an AVX2-only EPYC).
template <int MB>
FASTGATE_AVX2_TARGET inline void int4_offsets_f32(const float* S, const float* ot, int64_t K, int64_t tile_row,
                                                  float* off) {
  const int64_t G = K / 32;
  const float* ob = ot + (tile_row / kTileRows) * G * kTileRows;  // group g's eight offsets: ob + 8 g
  __m256 o[MB];
  for (int m = 0; m < MB; ++m) o[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const __m256 v = _mm256_loadu_ps(ob + kTileRows * g);
    for (int m = 0; m < MB; ++m) o[m] = _mm256_fmadd_ps(v, _mm256_broadcast_ss(S + m * G + g), o[m]);
  }
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(off + m * kTileRows, o[m]);
}

template <int MB>
FASTGATE_AVX2_TARGET void int4_rows_f32(const float* xp, const float* S, const uint8_t* qt, const float* st,
                                        const float* ot, int64_t K, int64_t n0, int64_t n1, int64_t N, float* y,
                                        const float* res) {
  // Several input rows take one weight row at a time, its codes decoded once for all of them, their sums in registers
  // (16 ymm: up to 6 sums, the row's 4 codes, its scale, the mask, 2 partial sums; the inputs read from memory). Tiles
  // of four weight rows by two inputs kept their 8 sums on the stack (a load and two stores each a group): 576 -> 3,072
  // at 16 rows ran at ~18 G multiply-adds a second on an AVX2-only EPYC, 1.35-1.6x slower. One input row takes a
  // whole tile of eight weight rows (some sums on the stack too, but eight rows' codes in flight: four a tile was no
  // faster at batch 1). n0 is a tile's first row.
  if constexpr (MB == 1) {
    for (int64_t n = n0; n < n1; n += kTileRows)
      int4_tile_f32<kTileRows, 1>(xp, S, qt, st, ot, K, n, std::min(kTileRows, n1 - n), N, y, res, nullptr);
  } else {
    alignas(32) float off[MB * kTileRows];  // the current tile's rows' offset sums, input row by input row
    int64_t tile = -1;
    for (int64_t n = n0; n < n1; ++n) {
      if (n / kTileRows != tile) {
        tile = n / kTileRows;
        int4_offsets_f32<MB>(S, ot, K, n, off);
      }
      int4_tile_f32<1, MB>(xp, S, qt, st, ot, K, n, 1, N, y, res, off + n % kTileRows);  // this row's lane
    }
  }
}

// rows n .. n + R of the int8 product (one tile's rows r0 .. r0 + R) for MB input rows x [MB, K8] float32 (rows
// x_stride apart, zero past K where K8 > K) -> y [MB][N] float32, the first `valid` rows written
template <int R, int MB>
FASTGATE_AVX2_TARGET inline void int8_tile_f32(const float* x, int64_t x_stride, const int8_t* qt, const float* scale,
                                               int64_t K8, int64_t n, int64_t valid, int64_t N, float* y) {
  const int64_t r0 = n % kTileRows;
  const int8_t* qb = qt + (n / kTileRows) * K8 * kTileRows + 8 * r0;  // codes k .. k + 7 of row r: qb + 8 k + 8 r
  const bool lead = r0 == 0;
  __m256 acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = _mm256_loadu_ps(x + m * x_stride + k);
    const int8_t* qk = qb + kTileRows * k;
    if (lead) _mm_prefetch(reinterpret_cast<const char*>(qk) + kPrefetchBytes, _MM_HINT_T0);  // the tile's line
    for (int r = 0; r < R; ++r) {
      const __m256 w =
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qk + 8 * r))));
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_fmadd_ps(w, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R && r < valid; ++r)
    for (int m = 0; m < MB; ++m) y[m * N + n + r] = hsum8_avx(acc[r][m]) * scale[n + r];
}

template <int MB>
FASTGATE_AVX2_TARGET void int8_rows_f32(const float* x, int64_t x_stride, const int8_t* qt, const float* scale,
                                        int64_t K8, int64_t n0, int64_t n1, int64_t N, float* y) {
  // one input row: a whole tile at a time (8 sums); two: a half tile (4 rows x 2 inputs of sums, 2 inputs, 1 code:
  // 15 ymm), the tile's second half read from the cache the first filled. n0 is a tile's first row.
  constexpr int64_t R = MB == 1 ? kTileRows : kTileRows / 2;
  for (int64_t n = n0; n < n1; n += R)
    int8_tile_f32<R, MB>(x, x_stride, qt, scale, K8, n, std::min<int64_t>(R, n1 - n), N, y);
}

// The fused pass's float32 layer ops (rms_norm_f32, rope_f32, decode_attention_step_f32): the bf16 ones' loops for a
// float32 model, where a batch-1 step of SmolLM2 spent ~10 of ~30 ms in the norms, rotary embeddings and attention as
// torch operations (an AVX2-only EPYC). The norm and the rotary embedding are torch's float32 arithmetic bit for bit:
// every product rounded before a sum, as torch's elementwise kernels round it, so these are compiled without
// contracting a product and a sum into one FMA (GCC does so by default where the target has FMA).
#define FASTGATE_F32_EXACT __attribute__((target("avx2,fma"), optimize("fp-contract=off")))

// One row of rms_norm_f32: weight * (x * rsqrt(mean(x^2) + eps)), the sum of squares in torch's order.
FASTGATE_F32_EXACT void rms_norm_row_f32(const float* xr, const float* w, float* o, int64_t d, float e) {
  const float inv = 1.0f / std::sqrt(torch_sum_squares<Vec8>(xr, d) / static_cast<float>(d) + e);
  const __m256 iv = _mm256_set1_ps(inv);
  int64_t j = 0;
  for (; j + 8 <= d; j += 8)
    _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_loadu_ps(w + j), _mm256_mul_ps(_mm256_loadu_ps(xr + j), iv)));
  for (; j < d; ++j) o[j] = w[j] * (xr[j] * inv);
}

// One head of rope_f32: out[i] = x[i] cos[i] + rot[i] sin[i], each product rounded (rot as in rope_head_t).
FASTGATE_F32_EXACT void rope_head_f32(const float* xr, const float* c, const float* s, float* o, int64_t half) {
  for (int side = 0; side < 2; ++side) {
    const int64_t lo = side * half, other = side ? -half : half;
    const float sign = side ? 1.0f : -1.0f;
    const __m256 sg = _mm256_set1_ps(sign);
    int64_t i = lo;
    for (; i + 8 <= lo + half; i += 8) {
      const __m256 a = _mm256_mul_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(c + i));
      const __m256 b = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i + other), sg), _mm256_loadu_ps(s + i));
      _mm256_storeu_ps(o + i, _mm256_add_ps(a, b));
    }
    for (; i < lo + half; ++i) {
      const float a = xr[i] * c[i];
      const float b = (sign * xr[i + other]) * s[i];
      o[i] = a + b;
    }
  }
}
#endif

// x [M, K] float32 (rows x_stride elements apart, unit stride along K); qt / st / ot: the codes, scales and offsets
// zero - 8 scale in tiles (kTileRows above: [ceil(N / 8)][K / 32][8][16] uint8, [ceil(N / 8)][K / 32][8] float32
// each), contiguous; out [M, N] float32 contiguous; K a multiple of 32. res_ptr (0: none): a residual [M, N] float32
// contiguous, out = res + product (torch's h + y, one float32 addition each). w_ptr (0: none): a norm
// weight [K] float32, the product of rms_norm_f32(x, w, eps) instead (the same loop, bitwise the two calls).
#ifdef FASTGATE_AVX2_KERNEL
// int4_matmul_f32's work, its inputs checked and the GIL released by the caller (decode_layers_f32 calls it too).
void int4_f32(const float* x, int64_t x_stride, const uint8_t* qt, const float* st, const float* ot, float* y,
              int64_t M, int64_t N, int64_t K, int64_t threads, const float* res, const float* w, float eps) {
  const int64_t G = K / 32;
  std::vector<float> normed(w ? K : 0);  // one row normed at a time, then permuted as x's rows are
  // per input row: each group's sum S_g, and the row permuted: per 16 codes, the even inputs, then the odd ones
  std::vector<float> S(M * G), xp(M * K);
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * x_stride;
    if (w) {
      rms_norm_row_f32(xm, w, normed.data(), K, eps);
      xm = normed.data();
    }
    float* pm = xp.data() + m * K;
    for (int64_t c = 0; c < K; c += 16)
      for (int j = 0; j < 8; ++j) {
        pm[c + j] = xm[c + 2 * j];
        pm[c + 8 + j] = xm[c + 2 * j + 1];
      }
    for (int64_t g = 0; g < G; ++g) {
      float sum = 0.0f;
      for (int j = 0; j < 32; ++j) sum += xm[32 * g + j];
      S[m * G + g] = sum;
    }
  }
  quant_split(M, N, K, threads, [&](int64_t m0, int64_t mb, int64_t n0, int64_t n1) {
    const float* xm = xp.data() + m0 * K;
    const float* Sm = S.data() + m0 * G;
    float* ym = y + m0 * N;
    const float* rm = res ? res + m0 * N : nullptr;
    switch (mb) {
      case 1: int4_rows_f32<1>(xm, Sm, qt, st, ot, K, n0, n1, N, ym, rm); break;
      case 2: int4_rows_f32<2>(xm, Sm, qt, st, ot, K, n0, n1, N, ym, rm); break;
      case 3: int4_rows_f32<3>(xm, Sm, qt, st, ot, K, n0, n1, N, ym, rm); break;
      case 4: int4_rows_f32<4>(xm, Sm, qt, st, ot, K, n0, n1, N, ym, rm); break;
      case 5: int4_rows_f32<5>(xm, Sm, qt, st, ot, K, n0, n1, N, ym, rm); break;
      default: int4_rows_f32<6>(xm, Sm, qt, st, ot, K, n0, n1, N, ym, rm); break;
    }
  }, kF32Int4Inputs);
}
#endif

void int4_matmul_f32(uintptr_t x_ptr, int64_t x_stride, uintptr_t q_ptr, uintptr_t scale_ptr, uintptr_t offset_ptr,
                     uintptr_t out_ptr, int64_t M, int64_t N, int64_t K, int64_t threads, uintptr_t res_ptr,
                     uintptr_t w_ptr, double eps) {
  pool_spin();  // the decode path: idle workers spin between its calls
#ifdef FASTGATE_AVX2_KERNEL
  if (!quant_f32_kernels_supported()) throw std::invalid_argument("int4_matmul_f32: this CPU has no AVX2 and FMA");
  if (M < 0 || N <= 0 || K <= 0 || K % 32 != 0 || x_stride < K)
    throw std::invalid_argument("int4_matmul_f32: bad shape (K a multiple of 32, x_stride >= K)");
  if (M == 0) return;
  py::gil_scoped_release release;
  int4_f32(reinterpret_cast<const float*>(x_ptr), x_stride, reinterpret_cast<const uint8_t*>(q_ptr),
           reinterpret_cast<const float*>(scale_ptr), reinterpret_cast<const float*>(offset_ptr),
           reinterpret_cast<float*>(out_ptr), M, N, K, threads, reinterpret_cast<const float*>(res_ptr),
           reinterpret_cast<const float*>(w_ptr), static_cast<float>(eps));
#else
  (void)x_ptr, (void)x_stride, (void)q_ptr, (void)scale_ptr, (void)offset_ptr, (void)out_ptr, (void)M, (void)N;
  (void)K, (void)threads, (void)res_ptr, (void)w_ptr, (void)eps;
  throw std::invalid_argument("int4_matmul_f32: not built for this platform");
#endif
}

// x [M, K] float32 (rows x_stride apart, unit stride along K); qt: the codes in tiles ([ceil(N / 8)][K8 / 8][8][8]
// int8, K8 = K rounded up to 8, zero codes past K), scale [N] float32, contiguous; out [M, N] float32 contiguous.
void int8_matmul_f32(uintptr_t x_ptr, int64_t x_stride, uintptr_t q_ptr, uintptr_t scale_ptr, uintptr_t out_ptr,
                     int64_t M, int64_t N, int64_t K, int64_t threads) {
  pool_spin();  // the decode path: idle workers spin between its calls
#ifdef FASTGATE_AVX2_KERNEL
  if (!quant_f32_kernels_supported()) throw std::invalid_argument("int8_matmul_f32: this CPU has no AVX2 and FMA");
  if (M < 0 || N <= 0 || K <= 0 || x_stride < K) throw std::invalid_argument("int8_matmul_f32: bad shape");
  if (M == 0) return;
  const int8_t* qt = reinterpret_cast<const int8_t*>(q_ptr);
  const float* scale = reinterpret_cast<const float*>(scale_ptr);
  float* y = reinterpret_cast<float*>(out_ptr);
  const int64_t K8 = (K + 7) / 8 * 8;
  py::gil_scoped_release release;
  const float* x = reinterpret_cast<const float*>(x_ptr);
  std::vector<float> padded;  // K not a multiple of 8: the rows copied with zeros past K (the codes' own zeros)
  if (K8 != K) {
    padded.assign(M * K8, 0.0f);
    for (int64_t m = 0; m < M; ++m) std::copy(x + m * x_stride, x + m * x_stride + K, padded.data() + m * K8);
    x = padded.data();
    x_stride = K8;
  }
  quant_split(M, N, K8, threads, [&](int64_t m0, int64_t mb, int64_t n0, int64_t n1) {
    const float* xm = x + m0 * x_stride;
    float* ym = y + m0 * N;
    if (mb == 1) int8_rows_f32<1>(xm, x_stride, qt, scale, K8, n0, n1, N, ym);
    else int8_rows_f32<2>(xm, x_stride, qt, scale, K8, n0, n1, N, ym);
  }, kF32Inputs);
#else
  (void)x_ptr, (void)x_stride, (void)q_ptr, (void)scale_ptr, (void)out_ptr, (void)M, (void)N, (void)K, (void)threads;
  throw std::invalid_argument("int8_matmul_f32: not built for this platform");
#endif
}


// x: [rows, d] float32, rows `x_stride` elements apart, unit stride along d; weight: [d] float32; out: [rows, d]
// float32 contiguous. out = weight * (x * rsqrt(mean(x^2) + eps)): torch's float32 arithmetic (LlamaRMSNorm of float32
// rows) bit for bit, for d >= 8 (shorter rows torch sums in another order: the caller's reference takes them).
void rms_norm_f32(uintptr_t x_ptr, uintptr_t w_ptr, uintptr_t out_ptr, int64_t rows, int64_t d, int64_t x_stride,
                  double eps, int64_t threads) {
#ifdef FASTGATE_AVX2_KERNEL
  if (!quant_f32_kernels_supported()) throw std::invalid_argument("rms_norm_f32: this CPU has no AVX2 and FMA");
  if (rows < 0 || d <= 0 || x_stride < d) throw std::invalid_argument("rms_norm_f32: bad shape");
  const float* x = reinterpret_cast<const float*>(x_ptr);
  const float* w = reinterpret_cast<const float*>(w_ptr);
  float* out = reinterpret_cast<float*>(out_ptr);
  const float e = static_cast<float>(eps);
  py::gil_scoped_release release;
  split_rows(rows, rows * d * 4, kElementwiseGrain, [&](int64_t first, int64_t step) {
    for (int64_t r = first; r < rows; r += step) rms_norm_row_f32(x + r * x_stride, w, out + r * d, d, e);
    return true;
  }, threads);
#else
  (void)x_ptr, (void)w_ptr, (void)out_ptr, (void)rows, (void)d, (void)x_stride, (void)eps, (void)threads;
  throw std::invalid_argument("rms_norm_f32: not built for this platform");
#endif
}

// x: [T, H, D] float32 with element strides (token, head), unit along D; cos / sin: [T, D] float32 rows `c_stride`
// apart; out: [T, H, D] float32 contiguous. out = x * cos + rotate_half(x) * sin, torch's float32 arithmetic bit for
// bit (HF's apply_rotary_pos_emb).
void rope_f32(uintptr_t x_ptr, uintptr_t cos_ptr, uintptr_t sin_ptr, uintptr_t out_ptr, int64_t T, int64_t H, int64_t D,
              int64_t s_tok, int64_t s_head, int64_t c_stride, int64_t threads) {
#ifdef FASTGATE_AVX2_KERNEL
  if (!quant_f32_kernels_supported()) throw std::invalid_argument("rope_f32: this CPU has no AVX2 and FMA");
  if (T < 0 || H <= 0 || D <= 0 || D % 2) throw std::invalid_argument("rope_f32: bad shape (D even)");
  const float* x = reinterpret_cast<const float*>(x_ptr);
  const float* cs = reinterpret_cast<const float*>(cos_ptr);
  const float* sn = reinterpret_cast<const float*>(sin_ptr);
  float* out = reinterpret_cast<float*>(out_ptr);
  py::gil_scoped_release release;
  split_rows(T, T * H * D * 4, kElementwiseGrain, [&](int64_t first, int64_t step) {
    for (int64_t t = first; t < T; t += step)
      for (int64_t h = 0; h < H; ++h)
        rope_head_f32(x + t * s_tok + h * s_head, cs + t * c_stride, sn + t * c_stride, out + (t * H + h) * D, D / 2);
    return true;
  }, threads);
#else
  (void)x_ptr, (void)cos_ptr, (void)sin_ptr, (void)out_ptr, (void)T, (void)H, (void)D, (void)s_tok, (void)s_head;
  (void)c_stride, (void)threads;
  throw std::invalid_argument("rope_f32: not built for this platform");
#endif
}

// decode_attention_step_bf16 over a float32 store, float32 in and out (a float32 model): row r's new key and value
// (k_new / v_new [m, Hkv, D], strided views of the layer's product; k_new rotated first where cos / sin are given, by
// rope_f32's loop) written at column pos[r] of its store row, then its query heads (q [m, H, D], strided; rotated
// likewise) attend columns 0 .. pos[r] (attend_head's float32 arithmetic, the scores' softmax with its exp); out
// [m, H, D] float32 contiguous.
#ifdef FASTGATE_AVX2_KERNEL
// attend_head_f32 for head dim 64 (SmolLM2's and Qwen2.5's), AVX2 and FMA: a query head's scores 8 columns at a time
// (8 sums in registers, reduced to one vector of 8 scores by horizontal adds) and its output in registers over the
// columns, a head at a time. The general loop sums each score horizontally and keeps its key row and the output in
// memory: a batch-16 step of SmolLM2 at 600 tokens read its 443 MB of keys and values at ~8 GB/s there (`sum`: ~20).
// Sums in another order than attend_head_f32, within float32 rounding.

// q . kw of 64 floats (q as 8 vectors), its 8 lanes' partial sums
FASTGATE_AVX2_TARGET inline __m256 dot64_lanes(const __m256* qv, const float* kw) {
  __m256 acc = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kw));
  for (int i = 1; i < 8; ++i) acc = _mm256_fmadd_ps(qv[i], _mm256_loadu_ps(kw + 8 * i), acc);
  return acc;
}

FASTGATE_AVX2_TARGET void attend_head_f32_64(const float* q, const float* k, const float* v, int64_t stride, int64_t n,
                                             int64_t G, float* scores, float* out, float* mx, float* sum) {
  constexpr int64_t D = 64;
  for (int64_t g = 0; g < G; ++g) {
    __m256 qv[8];
    for (int i = 0; i < 8; ++i) qv[i] = _mm256_loadu_ps(q + g * D + 8 * i);
    float* sg = scores + g * n;
    int64_t w = 0;
    for (; w + 8 <= n; w += 8) {
      __m256 a[8];
      for (int c = 0; c < 8; ++c) a[c] = dot64_lanes(qv, k + (w + c) * stride);
      _mm256_storeu_ps(sg + w, hsum8x8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]));
    }
    for (; w < n; ++w) sg[w] = hsum8_avx(dot64_lanes(qv, k + w * stride));
  }
  softmax_rows(scores, n, G, mx, sum);
  for (int64_t g = 0; g < G; ++g) {
    const float* sg = scores + g * n;
    __m256 o[8];
    for (int i = 0; i < 8; ++i) o[i] = _mm256_setzero_ps();
    for (int64_t w = 0; w < n; ++w) {
      const __m256 p = _mm256_broadcast_ss(sg + w);
      const float* vw = v + w * stride;
      for (int i = 0; i < 8; ++i) o[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vw + 8 * i), o[i]);
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(out + g * D + 8 * i, o[i]);
  }
}

// attend_head_f32, or its head-dim-64 form
inline void attend_f32(const float* q, const float* k, const float* v, int64_t stride, int64_t n, int64_t G, int64_t D,
                       float* scores, float* out, float* mx = nullptr, float* sum = nullptr) {
  if (D == 64)
    attend_head_f32_64(q, k, v, stride, n, G, scores, out, mx, sum);
  else
    attend_head_f32(q, k, v, stride, n, G, D, scores, out, mx, sum);
}

// decode_attention_step_f32's work, its inputs checked and the GIL released by the caller (decode_layers_f32 calls it
// too).
void attention_step_f32(const float* q, int64_t q_row, int64_t q_head, const float* kn, int64_t kn_row,
                        int64_t kn_head, const float* vn, int64_t vn_row, int64_t vn_head, float* k, float* v,
                        const int64_t* pos, float* out, int64_t m, int64_t H, int64_t Hkv, int64_t D, int64_t cols,
                        int64_t s_row, int64_t s_head, int64_t s_col, float sc, int64_t threads, const float* cs,
                        const float* sn, int64_t c_stride) {
  const int64_t G = H / Hkv;
  const int64_t widest = attended_width(pos, m, cols);
  // first the new keys and values into the store and the queries rotated and scaled (m Hkv D copies: serial)
  std::vector<float> qs(m * H * D), qrot(cs ? D : 0);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t h = 0; h < Hkv; ++h) {
      float* kc = k + r * s_row + h * s_head + pos[r] * s_col;  // this row's new column
      float* vc = v + r * s_row + h * s_head + pos[r] * s_col;
      if (cs)
        rope_head_f32(kn + r * kn_row + h * kn_head, cs + r * c_stride, sn + r * c_stride, kc, D / 2);
      else
        __builtin_memcpy(kc, kn + r * kn_row + h * kn_head, D * sizeof(float));
      __builtin_memcpy(vc, vn + r * vn_row + h * vn_head, D * sizeof(float));
      for (int64_t g = 0; g < G; ++g) {
        const float* qr = q + r * q_row + (h * G + g) * q_head;
        if (cs) {
          rope_head_f32(qr, cs + r * c_stride, sn + r * c_stride, qrot.data(), D / 2);
          qr = qrot.data();
        }
        float* qd = qs.data() + (r * H + h * G + g) * D;
        for (int64_t i = 0; i < D; ++i) qd[i] = qr[i] * sc;
      }
    }
  // then each (row, key / value head) attends; fewer of them than threads (a batch-1 step: SmolLM2's 3 heads on 2
  // cores ran 2 : 1) split their columns into parts of at least kPartColumns, merged after
  const int64_t items = m * Hkv, work = items * widest * D * G * 2;
  const int64_t hw = usable_threads(threads);
  const int64_t parts = items < 4 * hw && work >= 2 * kAttentionGrain
                            ? std::max<int64_t>(1, std::min<int64_t>(hw, widest / kPartColumns)) : 1;
  const int64_t units = items * parts;
  std::vector<float> po(parts > 1 ? units * G * D : 0), pm(parts > 1 ? units * G : 0), ps(pm.size());
  split_rows(units, work, kAttentionGrain, [&](int64_t first, int64_t step) {
    std::vector<float> scores(G * widest);  // per thread
    for (int64_t u = first; u < units; u += step) {
      const int64_t item = u / parts, p = u % parts, r = item / Hkv, h = item % Hkv;
      const int64_t n = pos[r] + 1, c0 = p * n / parts, c1 = (p + 1) * n / parts;
      const float* qh = qs.data() + (r * H + h * G) * D;
      const int64_t at = r * s_row + h * s_head + c0 * s_col;
      if (parts == 1)
        attend_f32(qh, k + at, v + at, s_col, n, G, D, scores.data(), out + (r * H + h * G) * D);
      else if (c1 > c0)
        attend_f32(qh, k + at, v + at, s_col, c1 - c0, G, D, scores.data(), po.data() + u * G * D, pm.data() + u * G,
                   ps.data() + u * G);
      else  // an empty part (fewer columns than parts): nothing to weigh
        for (int64_t g = 0; g < G; ++g) pm[u * G + g] = -std::numeric_limits<float>::infinity(), ps[u * G + g] = 0;
    }
    return true;
  }, threads);
  if (parts > 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t r = item / Hkv, h = item % Hkv;
      merge_parts(po.data() + item * parts * G * D, pm.data() + item * parts * G, ps.data() + item * parts * G, parts,
                  G, D, out + (r * H + h * G) * D);
    }
}
#endif

void decode_attention_step_f32(uintptr_t q_ptr, int64_t q_row, int64_t q_head, uintptr_t kn_ptr, int64_t kn_row,
                               int64_t kn_head, uintptr_t vn_ptr, int64_t vn_row, int64_t vn_head, uintptr_t k_ptr,
                               uintptr_t v_ptr, uintptr_t pos_ptr, uintptr_t out_ptr, int64_t m, int64_t H, int64_t Hkv,
                               int64_t D, int64_t cols, int64_t s_row, int64_t s_head, int64_t s_col, double scale,
                               int64_t threads, uintptr_t cos_ptr, uintptr_t sin_ptr, int64_t c_stride) {
#ifdef FASTGATE_AVX2_KERNEL
  if (!quant_f32_kernels_supported())
    throw std::invalid_argument("decode_attention_step_f32: this CPU has no AVX2 and FMA");
  check_decode_shape("decode_attention_step_f32", m, H, Hkv, D);
  if (cos_ptr && D % 2) throw std::invalid_argument("decode_attention_step_f32: the rotary embedding needs D even");
  py::gil_scoped_release release;
  attention_step_f32(reinterpret_cast<const float*>(q_ptr), q_row, q_head, reinterpret_cast<const float*>(kn_ptr),
                     kn_row, kn_head, reinterpret_cast<const float*>(vn_ptr), vn_row, vn_head,
                     reinterpret_cast<float*>(k_ptr), reinterpret_cast<float*>(v_ptr),
                     reinterpret_cast<const int64_t*>(pos_ptr), reinterpret_cast<float*>(out_ptr), m, H, Hkv, D, cols,
                     s_row, s_head, s_col, static_cast<float>(scale), threads, reinterpret_cast<const float*>(cos_ptr),
                     reinterpret_cast<const float*>(sin_ptr), c_stride);
#else
  (void)q_ptr, (void)q_row, (void)q_head, (void)kn_ptr, (void)kn_row, (void)kn_head, (void)vn_ptr, (void)vn_row;
  (void)vn_head, (void)k_ptr, (void)v_ptr, (void)pos_ptr, (void)out_ptr, (void)m, (void)H, (void)Hkv, (void)D;
  (void)cols, (void)s_row, (void)s_head, (void)s_col, (void)scale, (void)threads, (void)cos_ptr, (void)sin_ptr;
  (void)c_stride;
  throw std::invalid_argument("decode_attention_step_f32: not built for this platform");
#endif
}

// The SwiGLU of a float32 decode step with torch's own exponential: the fused pass multiplies silu(gate) by up as
// torch computes them (x / (1 + exp(-x)), exp by the SLEEF routine torch's vectorized float kernels call), so that
// decode_layers_f32 is bitwise the per-op path. libtorch_cpu exports that routine; it is looked up where torch is
// loaded (the registry asks torch_exp_found first, and probes the loop against torch's silu once).
#ifdef FASTGATE_AVX2_KERNEL
using Exp8 = __m256 (*)(__m256);

// a routine of the loaded libtorch_cpu by name (nullptr: torch not loaded, or no such symbol), kept in `found` (a
// plain pointer: an atomic of a vector function's pointer drops the vector's attributes)
void* torch_symbol(const char* name, std::atomic<void*>& found) {
  if (void* seen = found.load(std::memory_order_acquire)) return seen;
  void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
  if (!lib) return nullptr;
  void* fn = dlsym(lib, name);
  dlclose(lib);  // NOLOAD took a reference of its own: torch keeps it loaded
  if (fn) found.store(fn, std::memory_order_release);
  return fn;
}

Exp8 torch_exp8() {
  static std::atomic<void*> found{nullptr};
  return reinterpret_cast<Exp8>(torch_symbol("Sleef_expf8_u10", found));
}
#endif

bool torch_exp_found() {
#ifdef FASTGATE_AVX2_KERNEL
  return quant_f32_kernels_supported() && torch_exp8() != nullptr;
#else
  return false;
#endif
}

#ifdef FASTGATE_AVX2_KERNEL
FASTGATE_F32_EXACT inline __m256 silu8(__m256 x, Exp8 exp8) {  // torch's x / (1 + exp(-x)) of a vector
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_xor_ps(x, _mm256_set1_ps(-0.0f)))));
}

// The values torch's vectorized float loops take a step: two of its vectors, 8 floats each in an AVX2 build of its
// kernels, 16 in an AVX-512 one (which one runs is torch's CPU capability: set_torch_float_block); the rest of a row
// runs its scalar loop
std::atomic<int64_t> torch_float_block{16};

// o[i] = silu(g[i]) * u[i] for i < n, as torch's loop over a row computes and rounds them: torch_float_block at a
// time (each lane's exp is the same SLEEF routine at either width), the last n % block one by one with the C
// library's exp (torch's scalar silu)
FASTGATE_F32_EXACT void silu_mul_row_f32(const float* g, const float* u, float* o, int64_t n, Exp8 exp8) {
  const int64_t block = torch_float_block.load(std::memory_order_relaxed);
  int64_t i = 0;
  for (; i + block <= n; i += block)
    for (int64_t j = i; j < i + block; j += 8)
      _mm256_storeu_ps(o + j, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + j), exp8), _mm256_loadu_ps(u + j)));
  for (; i < n; ++i) {
    const float x = g[i];
    const float s = x / (1.0f + std::exp(-x));
    o[i] = s * u[i];
  }
}

// gu [m, 2 I] float32 contiguous -> out [m, I]: silu(gu[:, :I]) * gu[:, I:], row by row
void silu_mul_rows_f32(const float* gu, float* out, int64_t m, int64_t I, Exp8 exp8) {
  for (int64_t r = 0; r < m; ++r) silu_mul_row_f32(gu + r * 2 * I, gu + r * 2 * I + I, out + r * I, I, exp8);
}

// torch's exp for the entry point `name`, or a clear error where it does not run here
Exp8 checked_exp8(const char* name) {
  if (!torch_exp_found())
    throw std::invalid_argument(std::string(name) + ": needs AVX2, FMA and torch's exp (libtorch_cpu loaded)");
  return torch_exp8();
}
#endif

// How many values torch's vectorized float loops take a step here: 16 (its AVX2 kernels) or 32 (AVX-512); the
// registry sets it once from torch's CPU capability, before it probes the SwiGLU against torch's.
void set_torch_float_block(int64_t block) {
  if (block != 16 && block != 32)
    throw std::invalid_argument("set_torch_float_block: 16 (AVX2) or 32 (AVX-512), got " + std::to_string(block));
#ifdef FASTGATE_AVX2_KERNEL
  torch_float_block.store(block, std::memory_order_relaxed);
#endif
}

// gu [m, 2 I] float32 contiguous -> out [m, I]: silu(gu[:, :I]) * gu[:, I:] (the gated MLP's product, torch's
// arithmetic bit for bit where torch_exp_found).
void silu_mul_f32(uintptr_t gu_ptr, uintptr_t out_ptr, int64_t m, int64_t I) {
#ifdef FASTGATE_AVX2_KERNEL
  const Exp8 exp8 = checked_exp8("silu_mul_f32");
  if (m < 0 || I <= 0) throw std::invalid_argument("silu_mul_f32: bad shape");
  py::gil_scoped_release release;
  silu_mul_rows_f32(reinterpret_cast<const float*>(gu_ptr), reinterpret_cast<float*>(out_ptr), m, I, exp8);
#else
  (void)gu_ptr, (void)out_ptr, (void)m, (void)I;
  throw std::invalid_argument("silu_mul_f32: not built for this platform");
#endif
}

// The decode step's choice and log-prob of each row's next token from its float32 logits: torch's log_softmax(logits)
// [chosen] bit for bit, and, where asked, chosen = argmax (torch's: the first largest, a NaN the largest). torch's
// two kernels read the 49,152 logits of a SmolLM2 row in ~60 (log_softmax) and ~60-130 us (argmax) on an AVX2-only
// EPYC, 1.5 ms of a batch-16 step; this reads them twice. torch's arithmetic, as its AVX2 kernel has it
// (ATen/native/cpu/LogSoftmaxKernelImpl.h, serial_vec_log_softmax_lastdim_range, and at::vec::reduce_all /
// map_reduce_all): the row's maximum, then the sum of exp(x - max) over vectors of 8 in order (a last partial vector
// merged into the first lanes), both vectors reduced by the same three shuffles; lse = log(sum) by torch's vector
// log; the log-prob (x - max) - lse. exp and log are SLEEF's routines that libtorch_cpu exports and calls (found
// where torch is loaded); the registry probes this against torch once and binds it only where it agrees. A torch
// whose float kernels run 16 wide (CPU capability AVX512) sums in vectors of 16: `width` 16 runs that order (below).
#ifdef FASTGATE_AVX2_KERNEL
using Log8 = __m256 (*)(__m256);

Log8 torch_log8() {
  static std::atomic<void*> found{nullptr};
  return reinterpret_cast<Log8>(torch_symbol("Sleef_logf8_u10", found));
}

FASTGATE_F32_EXACT inline __m256 vmax8(__m256 a, __m256 b) {  // at::vec::maximum: a NaN in either lane wins
  return _mm256_or_ps(_mm256_max_ps(a, b), _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
}

FASTGATE_F32_EXACT inline __m256 load_first(const float* p, int64_t count) {  // lanes [0, count), zeros after
  alignas(32) float tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < count; ++i) tmp[i] = p[i];
  return _mm256_load_ps(tmp);
}

FASTGATE_F32_EXACT inline __m256 set_first(__m256 a, __m256 b, int64_t count) {  // b's lanes [0, count), then a's
  alignas(32) float x[8], y[8];
  _mm256_store_ps(x, a);
  _mm256_store_ps(y, b);
  for (int64_t i = 0; i < count; ++i) x[i] = y[i];
  return _mm256_load_ps(x);
}

template <class Op>
FASTGATE_F32_EXACT inline float reduce8(__m256 v, Op op) {  // at::vec::vec_reduce_all's AVX2 shuffles
  v = op(v, _mm256_permute2f128_ps(v, v, 0x1));
  v = op(v, _mm256_shuffle_ps(v, v, 0x4E));
  v = op(v, _mm256_shuffle_ps(v, v, 0xB1));
  return _mm256_cvtss_f32(v);
}

// vec_reduce_all's path under 8: lane 0 op'ed with each other lane in turn, the lanes read as they were stored
// once (op'ed with the zero padding, a lane of a row of negative values would be 0 by the time it is read)
template <class Op>
FASTGATE_F32_EXACT inline float reduce_short(__m256 v, int64_t size, Op op) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  for (int64_t i = 1; i < size; ++i) {
    alignas(32) float next[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    next[0] = lanes[i];
    v = op(v, _mm256_load_ps(next));
  }
  return _mm256_cvtss_f32(v);
}

// at::vec::map_reduce_all of one row (reduce_all where `map` is the identity): op over map(vectors of 8) in order, a
// last partial vector merged into the first lanes, then the three shuffles; a row under 8 one lane at a time
template <class Map, class Op>
FASTGATE_F32_EXACT inline float map_reduce_row(const float* x, int64_t V, Map map, Op op) {
  if (V < 8) return reduce_short(map(load_first(x, V)), V, op);
  __m256 acc = map(_mm256_loadu_ps(x));
  int64_t d = 8;
  for (; d < V - V % 8; d += 8) acc = op(acc, map(_mm256_loadu_ps(x + d)));
  if (V - d > 0) acc = set_first(acc, op(acc, map(load_first(x + d, V - d))), V - d);
  return reduce8(acc, op);
}

// one row: (max, lse) as torch's log_softmax computes them
FASTGATE_F32_EXACT std::pair<float, float> row_lse(const float* x, int64_t V, Exp8 exp8, Log8 log8) {
  const float m = map_reduce_row(x, V, [](__m256 v) { return v; }, [](__m256 a, __m256 b) { return vmax8(a, b); });
  const __m256 mv = _mm256_set1_ps(m);
  const float sum = map_reduce_row(x, V, [&](__m256 v) { return exp8(_mm256_sub_ps(v, mv)); },
                                   [](__m256 a, __m256 b) { return _mm256_add_ps(a, b); });
  return {m, _mm256_cvtss_f32(log8(_mm256_set1_ps(sum)))};
}

// torch's argmax of one row: the first largest; the first NaN where there is one
FASTGATE_F32_EXACT int64_t row_argmax(const float* x, int64_t V) {
  int64_t best = 0;
  float b = x[0];
  if (std::isnan(b)) return 0;
  int64_t i = 1;
  for (; i + 8 <= V; i += 8) {  // a vector at a time; only a vector holding a larger value (or a NaN) is looked into
    const __m256 v = _mm256_loadu_ps(x + i);
    const int gt = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(b), _CMP_NLE_UQ));  // v > b or unordered
    if (gt)
      for (int64_t j = i; j < i + 8; ++j) {
        if (std::isnan(x[j])) return j;
        if (x[j] > b) b = x[j], best = j;
      }
  }
  for (; i < V; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > b) b = x[i], best = i;
  }
  return best;
}
#endif

#if defined(FASTGATE_AVX2_KERNEL) && defined(FASTGATE_AVX512)
// The same as torch's AVX-512 kernels have it (a torch whose CPU capability is AVX512): vectors of 16, the partial
// last one merged by a masked blend, four shuffles (at::vec's VecReduceAllSIMD<float> for AVX-512), SLEEF's 16-wide
// exp and log. Why: on such a torch (Zen 4 EPYCs, Xeons) the 8-wide order is not torch's, the probe refused it and a
// batch-1 step ran torch's log_softmax, argmax and gather (~0.15 ms of a SmolLM2 step on a Zen 4 EPYC).
using Vec16Fn = __m512 (*)(__m512);

#define FASTGATE_F32_EXACT16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma"), optimize("fp-contract=off")))

FASTGATE_F32_EXACT16 inline __m512 vmax16(__m512 a, __m512 b) {  // at::vec::maximum: a NaN in either lane wins
  const __mmask16 nan = _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q);
  return _mm512_or_ps(_mm512_max_ps(a, b), _mm512_castsi512_ps(_mm512_maskz_set1_epi32(nan, -1)));
}

template <class Op>
FASTGATE_F32_EXACT16 inline float reduce16(__m512 v, Op op) {  // VecReduceAllSIMD<float>'s AVX-512 shuffles
  v = op(v, _mm512_shuffle_f32x4(v, v, 0x4E));
  v = op(v, _mm512_shuffle_f32x4(v, v, 0xB1));
  v = op(v, _mm512_shuffle_ps(v, v, 0x4E));
  v = op(v, _mm512_shuffle_ps(v, v, 0xB1));
  return _mm512_cvtss_f32(v);
}

template <class Op>
FASTGATE_F32_EXACT16 inline float reduce_short16(__m512 v, int64_t size, Op op) {  // vec_reduce_all under 16
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  for (int64_t i = 1; i < size; ++i) v = op(v, _mm512_maskz_loadu_ps(1, lanes + i));  // (lanes[i], 0, ..., 0)
  return _mm512_cvtss_f32(v);
}

// at::vec::map_reduce_all of one row over vectors of 16 (map_reduce_row's order)
template <class Map, class Op>
FASTGATE_F32_EXACT16 inline float map_reduce_row16(const float* x, int64_t V, Map map, Op op) {
  const auto first = [](int64_t count) { return static_cast<__mmask16>((1u << count) - 1); };
  if (V < 16) return reduce_short16(map(_mm512_maskz_loadu_ps(first(V), x)), V, op);
  __m512 acc = map(_mm512_loadu_ps(x));
  int64_t d = 16;
  for (; d < V - V % 16; d += 16) acc = op(acc, map(_mm512_loadu_ps(x + d)));
  if (V - d > 0)  // Vectorized::set(acc, op(acc, last), count): the first count lanes from the second
    acc = _mm512_mask_blend_ps(first(V - d), acc, op(acc, map(_mm512_maskz_loadu_ps(first(V - d), x + d))));
  return reduce16(acc, op);
}

FASTGATE_F32_EXACT16 std::pair<float, float> row_lse16(const float* x, int64_t V, Vec16Fn exp16, Vec16Fn log16) {
  const float m = map_reduce_row16(x, V, [](__m512 v) { return v; }, [](__m512 a, __m512 b) { return vmax16(a, b); });
  const __m512 mv = _mm512_set1_ps(m);
  const float sum = map_reduce_row16(x, V, [&](__m512 v) { return exp16(_mm512_sub_ps(v, mv)); },
                                     [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
  return {m, _mm512_cvtss_f32(log16(_mm512_set1_ps(sum)))};
}

Vec16Fn torch_vec16(const char* name, std::atomic<void*>& found) { return reinterpret_cast<Vec16Fn>(torch_symbol(name, found)); }
#endif

// logits [m, V] float32 (rows `stride` apart, unit stride along V); chosen [m] int64: read, or written with each row's
// argmax where `argmax`; out [m] float32: log_softmax(logits)[r, chosen[r]], torch's bits (above). width: the vectors
// of the torch to match, 8 (AVX2) or 16 (AVX-512; only where this CPU has it).
void token_logprobs_f32(uintptr_t logits_ptr, int64_t m, int64_t V, int64_t stride, uintptr_t chosen_ptr, bool argmax,
                        uintptr_t out_ptr, int64_t threads, int64_t width) {
#ifdef FASTGATE_AVX2_KERNEL
  const Exp8 exp8 = checked_exp8("token_logprobs_f32");
  const Log8 log8 = torch_log8();
  if (log8 == nullptr) throw std::invalid_argument("token_logprobs_f32: torch's log (Sleef_logf8_u10) not found");
  if (m < 0 || V <= 0 || stride < V) throw std::invalid_argument("token_logprobs_f32: bad shape");
  if (width != 8 && width != 16) throw std::invalid_argument("token_logprobs_f32: width 8 or 16");
#ifdef FASTGATE_AVX512
  static std::atomic<void*> exp_found{nullptr}, log_found{nullptr};
  const Vec16Fn exp16 = width == 16 ? torch_vec16("Sleef_expf16_u10", exp_found) : nullptr;
  const Vec16Fn log16 = width == 16 ? torch_vec16("Sleef_logf16_u10", log_found) : nullptr;
  if (width == 16 && !(cpu_has_avx512() && exp16 != nullptr && log16 != nullptr))
    throw std::invalid_argument("token_logprobs_f32: width 16 needs AVX-512 and torch's 16-wide exp and log");
#else
  if (width == 16) throw std::invalid_argument("token_logprobs_f32: width 16 not built for this platform");
#endif
  const float* logits = reinterpret_cast<const float*>(logits_ptr);
  int64_t* chosen = reinterpret_cast<int64_t*>(chosen_ptr);
  float* out = reinterpret_cast<float*>(out_ptr);
  if (!argmax)
    for (int64_t r = 0; r < m; ++r)
      if (chosen[r] < 0 || chosen[r] >= V) throw std::invalid_argument("token_logprobs_f32: a chosen token out of range");
  py::gil_scoped_release release;
  split_rows(m, m * V * 4, 1 << 17, [&](int64_t first, int64_t step) {
    for (int64_t r = first; r < m; r += step) {
      const float* x = logits + r * stride;
      if (argmax) chosen[r] = row_argmax(x, V);
#ifdef FASTGATE_AVX512
      const auto [mx, lse] = width == 16 ? row_lse16(x, V, exp16, log16) : row_lse(x, V, exp8, log8);
#else
      const auto [mx, lse] = row_lse(x, V, exp8, log8);
#endif
      out[r] = (x[chosen[r]] - mx) - lse;
    }
    return true;
  }, threads);
#else
  (void)logits_ptr, (void)m, (void)V, (void)stride, (void)chosen_ptr, (void)argmax, (void)out_ptr, (void)threads;
  (void)width;
  throw std::invalid_argument("token_logprobs_f32: not built for this platform");
#endif
}

// The decoder layers first .. last - 1 of a float32 model whose four products a layer are int4 (Llama / Qwen2 /
// Mistral: norm, q/k/v, rotary embedding, attention, o + residual, norm, gate/up, SwiGLU, down + residual) for m
// decode rows, in one call: the fused pass's per-op path (int4_matmul_f32 with its norm, the bias, decode_attention_
// step_f32 with its rotary embedding, int4_matmul_f32 with its residual, silu_mul_f32) step for step, so bitwise the
// same, without ~7 Python calls and tensors a layer (a batch-1 step of SmolLM2: ~4 ms of host time in ~13 ms).
//   h [m, d] float32 contiguous (not written); out [m, d] float32 contiguous: the last layer's output
//   table [L, 15] int64: a layer's pointers: qkv codes, scales, offsets, bias (0: none); o's, gate_up's, down's
//     codes, scales, offsets; the two norms' weights (layers indexed by their row; codes, scales and offsets in
//     int4_matmul_f32's tiles, N: (H + 2 Hkv) D, d, 2 I, d; K: d, H D, d, I)
//   floats [L, 3] float64: the norms' eps, the attention's scaling
//   kv [L, 2] int64: the layer's key and value store [R, Hkv, C, D] float32 (strides s_row, s_head, s_col, 1 alike)
//   cos / sin [m, D] float32, rows c_stride apart; pos [m] int64: row r's new column
void decode_layers_f32(uintptr_t h_ptr, uintptr_t out_ptr, int64_t m, int64_t d, uintptr_t table_ptr,
                       uintptr_t floats_ptr, uintptr_t kv_ptr, int64_t first, int64_t last, int64_t H, int64_t Hkv,
                       int64_t D, int64_t I, uintptr_t cos_ptr, uintptr_t sin_ptr, int64_t c_stride,
                       uintptr_t pos_ptr, int64_t cols, int64_t s_row, int64_t s_head, int64_t s_col,
                       int64_t threads) {
  pool_spin();  // the decode path: idle workers spin between its calls
#ifdef FASTGATE_AVX2_KERNEL
  const Exp8 exp8 = checked_exp8("decode_layers_f32");
  check_decode_shape("decode_layers_f32", m, H, Hkv, D);
  if (d <= 0 || d % 32 || (H * D) % 32 || I <= 0 || I % 32 || D % 2 || first < 0 || last < first || c_stride < D)
    throw std::invalid_argument("decode_layers_f32: bad shape (d, H D and I multiples of 32, D even)");
  if (m == 0 || first == last) return;
  const int64_t* table = reinterpret_cast<const int64_t*>(table_ptr);
  const double* floats = reinterpret_cast<const double*>(floats_ptr);
  const int64_t* kv = reinterpret_cast<const int64_t*>(kv_ptr);
  const float* cs = reinterpret_cast<const float*>(cos_ptr);
  const float* sn = reinterpret_cast<const float*>(sin_ptr);
  const int64_t* pos = reinterpret_cast<const int64_t*>(pos_ptr);
  attended_width(pos, m, cols);  // the positions checked before any layer writes the store
  const int64_t width = (H + 2 * Hkv) * D;
  auto f = [](int64_t p) { return reinterpret_cast<const float*>(p); };
  auto u8 = [](int64_t p) { return reinterpret_cast<const uint8_t*>(p); };
  py::gil_scoped_release release;
  std::vector<float> qkv(m * width), attn(m * H * D), gu(m * 2 * I), act(m * I), h2(m * d), h3(m * d);
  const float* hin = reinterpret_cast<const float*>(h_ptr);
  for (int64_t l = first; l < last; ++l) {
    const int64_t* t = table + l * 15;
    const double* e = floats + l * 3;
    float* hout = l + 1 == last ? reinterpret_cast<float*>(out_ptr) : h3.data();
    int4_f32(hin, d, u8(t[0]), f(t[1]), f(t[2]), qkv.data(), m, width, d, threads, nullptr, f(t[13]),
             static_cast<float>(e[0]));
    if (t[3])
      for (int64_t r = 0; r < m; ++r)
        for (int64_t j = 0; j < width; ++j) qkv[r * width + j] += f(t[3])[j];
    attention_step_f32(qkv.data(), width, D, qkv.data() + H * D, width, D, qkv.data() + (H + Hkv) * D, width, D,
                       reinterpret_cast<float*>(kv[2 * l]), reinterpret_cast<float*>(kv[2 * l + 1]), pos,
                       attn.data(), m, H, Hkv, D, cols, s_row, s_head, s_col, static_cast<float>(e[2]), threads, cs,
                       sn, c_stride);
    int4_f32(attn.data(), H * D, u8(t[4]), f(t[5]), f(t[6]), h2.data(), m, d, H * D, threads, hin, nullptr, 0.0f);
    int4_f32(h2.data(), d, u8(t[7]), f(t[8]), f(t[9]), gu.data(), m, 2 * I, d, threads, nullptr, f(t[14]),
             static_cast<float>(e[1]));
    silu_mul_rows_f32(gu.data(), act.data(), m, I, exp8);
    int4_f32(act.data(), I, u8(t[10]), f(t[11]), f(t[12]), hout, m, d, I, threads, h2.data(), nullptr, 0.0f);
    hin = hout;
  }
#else
  (void)h_ptr, (void)out_ptr, (void)m, (void)d, (void)table_ptr, (void)floats_ptr, (void)kv_ptr, (void)first;
  (void)last, (void)H, (void)Hkv, (void)D, (void)I, (void)cos_ptr, (void)sin_ptr, (void)c_stride, (void)pos_ptr;
  (void)cols, (void)s_row, (void)s_head, (void)s_col, (void)threads;
  throw std::invalid_argument("decode_layers_f32: not built for this platform");
#endif
}

// The SwiGLU of a bf16 decode step as torch computes it: silu of the bf16 gate (torch's kernel for bf16 widens to
// float32, takes x / (1 + exp(-x)) with the same SLEEF exp, rounds to bf16), then that times up (widened, multiplied,
// rounded). torch's loop takes two of its bf16 vectors a step (64 values where its kernels run AVX-512: twice the
// float block) and the rest of a row with the C library's exp; the product rounds alike in both, so only the silu's
// tail matters. o[i] for i < n, g / u / o bf16.
#if defined(FASTGATE_AVX2_KERNEL) && defined(FASTGATE_BF16_KERNEL)
// V's width with torch's exp of that width, `exp` (R: its vector type): x / (1 + exp(-x)) as torch's vectorized silu,
// rounded to bf16, times up; the scalar tail with the C library's exp (torch's scalar silu).
template <class V, class R>
FASTGATE_INLINE void silu_mul_row_bf16_t(const uint16_t* g, const uint16_t* u, uint16_t* o, int64_t n, R (*exp)(R)) {
  typedef typename V::F F;
  const int64_t block = 2 * torch_float_block.load(std::memory_order_relaxed);  // 32 or 64: whole vectors of 8 or 16
  // bf16 <-> float32 a vector at a time (load_bf16v, round_bf16v, store_bf16v: f32_to_bf16's bits): the scalar
  // conversions took ~6 us of a 1,536-wide row (SmolLM2), 30 a batch-1 step
  int64_t i = 0;
  for (; i + block <= n; i += block)
    for (int64_t j = i; j < i + block; j += V::N) {
      const F x = load_bf16v<V>(g + j);
      const F si = round_bf16v<V>(x / (1.0f + (F)exp((R)(-x))));
      store_bf16v<V>(o + j, si * load_bf16v<V>(u + j));
    }
  for (; i < n; ++i) {
    const float xi = bf16_to_f32(g[i]);
    const float si = xi / (1.0f + std::exp(-xi));
    o[i] = f32_to_bf16(round_bf16(si) * bf16_to_f32(u[i]));
  }
}

FASTGATE_F32_EXACT void silu_mul_row_bf16(const uint16_t* g, const uint16_t* u, uint16_t* o, int64_t n, Exp8 exp8) {
  silu_mul_row_bf16_t<Vec8>(g, u, o, n, exp8);
}

#ifdef FASTGATE_AVX512
// The same sixteen at a time with torch's 16-wide exp (the routine its AVX-512 kernels call; each lane's exp is the
// same SLEEF routine at either width): the same bits at ~1.7x the 8-wide loop's speed (the exp is most of it). Where
// the CPU runs AVX-512 and libtorch_cpu exports it.
using Exp16 = __m512 (*)(__m512);

Exp16 torch_exp16() {
  static std::atomic<void*> found{nullptr};
  return reinterpret_cast<Exp16>(torch_symbol("Sleef_expf16_u10", found));
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma"), optimize("fp-contract=off")))
void silu_mul_row_bf16_16(const uint16_t* g, const uint16_t* u, uint16_t* o, int64_t n, Exp16 exp16) {
  silu_mul_row_bf16_t<Vec16>(g, u, o, n, exp16);
}
#endif

// gu [m, 2 I] bf16 contiguous -> out [m, I]: silu(gu[:, :I]) * gu[:, I:], row by row; the rows split over up to
// `threads` threads (0: one per core) where they are enough work (a prompt chunk's: 497 x 1,536 values took 1.5 ms on
// one thread of a Zen 4 EPYC, torch's silu and product 0.4 ms on two); 16 wide where use_width16 and torch's 16-wide
// exp is found.
void silu_mul_rows_bf16(const uint16_t* gu, uint16_t* out, int64_t m, int64_t I, Exp8 exp8, int64_t threads = 1) {
#ifdef FASTGATE_AVX512
  const Exp16 exp16 = use_width16() ? torch_exp16() : nullptr;
#endif
  split_rows(m, m * I * 8, kElementwiseGrain, [&](int64_t first, int64_t step) {
    for (int64_t r = first; r < m; r += step) {
#ifdef FASTGATE_AVX512
      if (exp16 != nullptr) {
        silu_mul_row_bf16_16(gu + r * 2 * I, gu + r * 2 * I + I, out + r * I, I, exp16);
        continue;
      }
#endif
      silu_mul_row_bf16(gu + r * 2 * I, gu + r * 2 * I + I, out + r * I, I, exp8);
    }
    return true;
  }, threads);
}
#endif

// gu [m, 2 I] bf16 contiguous -> out [m, I]: silu(gu[:, :I]) * gu[:, I:] of bf16 rows, torch's arithmetic bit for bit
// where torch_exp_found (the registry probes it against torch's before decode_layers_bf16 is bound).
void silu_mul_bf16(uintptr_t gu_ptr, uintptr_t out_ptr, int64_t m, int64_t I, int64_t threads) {
#if defined(FASTGATE_AVX2_KERNEL) && defined(FASTGATE_BF16_KERNEL)
  const Exp8 exp8 = checked_exp8("silu_mul_bf16");
  if (m < 0 || I <= 0 || threads < 0) throw std::invalid_argument("silu_mul_bf16: bad shape");
  py::gil_scoped_release release;
  silu_mul_rows_bf16(reinterpret_cast<const uint16_t*>(gu_ptr), reinterpret_cast<uint16_t*>(out_ptr), m, I, exp8,
                     threads);
#else
  (void)gu_ptr, (void)out_ptr, (void)m, (void)I, (void)threads;
  throw std::invalid_argument("silu_mul_bf16: not built for this platform");
#endif
}

// decode_layers_f32 for a bf16 model whose four products a layer are int4, on a CPU with AVX512-BF16: the fused
// pass's bf16 per-op path (int4_matmul_bf16 with its norm; the q/k/v bias added and rounded as torch adds a bf16 bias;
// decode_attention_step_bf16 with its rotary embedding; int4_matmul_bf16 with its residual; torch's SwiGLU of bf16)
// step for step, so bitwise the same, without ~7 Python calls and tensors a layer (a batch-1 step of SmolLM2: ~2 ms of
// host time in ~8 ms on a Zen 4 EPYC).
//   h [m, d] bf16 contiguous (not written); out [m, d] bf16 contiguous: the last layer's output
//   table [L, 11] int64: a layer's pointers: qkv's tiles, its bias (bf16; 0: none); o's, gate_up's, down's tiles
//     (int4_matmul_bf16's; N: (H + 2 Hkv) D, d, 2 I, d; K: d, H D, d, I); the two norms' weights (bf16); then the
//     four products' tile forms (kInt4Float, kInt4Half), checked before any layer runs
//   floats [L, 3] float64: the norms' eps, the attention's scaling
//   kv [L, 2] int64: the layer's key and value store [R, Hkv, C, D] bf16 (strides s_row, s_head, s_col, 1 alike)
//   cos / sin [m, D] bf16, rows c_stride apart; pos [m] int64: row r's new column
void decode_layers_bf16(uintptr_t h_ptr, uintptr_t out_ptr, int64_t m, int64_t d, uintptr_t table_ptr,
                        uintptr_t floats_ptr, uintptr_t kv_ptr, int64_t first, int64_t last, int64_t H, int64_t Hkv,
                        int64_t D, int64_t I, uintptr_t cos_ptr, uintptr_t sin_ptr, int64_t c_stride,
                        uintptr_t pos_ptr, int64_t cols, int64_t s_row, int64_t s_head, int64_t s_col,
                        int64_t threads) {
  pool_spin();  // the decode path: idle workers spin between its calls
#if defined(FASTGATE_AVX2_KERNEL) && defined(FASTGATE_BF16_KERNEL)
  const Exp8 exp8 = checked_exp8("decode_layers_bf16");
  if (!quant_kernels_supported()) throw std::invalid_argument("decode_layers_bf16: this CPU has no AVX512-BF16");
  check_decode_shape("decode_layers_bf16", m, H, Hkv, D);
  if (d <= 0 || d % 32 || d > 16384 || (H * D) % 32 || H * D > 16384 || I <= 0 || I % 32 || I > 16384 || D % 2
      || first < 0 || last < first || c_stride < D)
    throw std::invalid_argument("decode_layers_bf16: bad shape (d, H D and I multiples of 32 up to 16384, D even)");
  if (m == 0 || first == last) return;
  const int64_t* table = reinterpret_cast<const int64_t*>(table_ptr);
  const double* floats = reinterpret_cast<const double*>(floats_ptr);
  const int64_t* kv = reinterpret_cast<const int64_t*>(kv_ptr);
  const uint16_t* cs = reinterpret_cast<const uint16_t*>(cos_ptr);
  const uint16_t* sn = reinterpret_cast<const uint16_t*>(sin_ptr);
  const int64_t* pos = reinterpret_cast<const int64_t*>(pos_ptr);
  const int64_t widest = attended_width(pos, m, cols);  // the positions checked before any layer writes the store
  for (int64_t l = first; l < last; ++l)
    for (int i = 7; i < 11; ++i)
      if (table[l * 11 + i] != kInt4Float && table[l * 11 + i] != kInt4Half)
        throw std::invalid_argument("decode_layers_bf16: a tile form is 0 or 1");
  const int64_t width = (H + 2 * Hkv) * D;
  auto b = [](int64_t p) { return reinterpret_cast<const uint16_t*>(p); };
  auto u8 = [](int64_t p) { return reinterpret_cast<const uint8_t*>(p); };
  py::gil_scoped_release release;
  std::vector<uint16_t> qkv(m * width), attn(m * H * D), gu(m * 2 * I), act(m * I), h2(m * d), h3(m * d);
  const uint16_t* hin = reinterpret_cast<const uint16_t*>(h_ptr);
  for (int64_t l = first; l < last; ++l) {
    const int64_t* t = table + l * 11;
    const double* e = floats + l * 3;
    uint16_t* hout = l + 1 == last ? reinterpret_cast<uint16_t*>(out_ptr) : h3.data();
    int4_bf16(hin, d, u8(t[0]), t[7], qkv.data(), m, width, d, threads, b(t[5]), static_cast<float>(e[0]), nullptr);
    if (t[1])  // torch's y + bias of bf16: each sum rounded
      for (int64_t r = 0; r < m; ++r)
        for (int64_t j = 0; j < width; ++j)
          qkv[r * width + j] = f32_to_bf16(bf16_to_f32(qkv[r * width + j]) + bf16_to_f32(b(t[1])[j]));
    attention_step_bf16(qkv.data(), width, D, qkv.data() + H * D, width, D, qkv.data() + (H + Hkv) * D, width, D,
                        reinterpret_cast<uint16_t*>(kv[2 * l]), reinterpret_cast<uint16_t*>(kv[2 * l + 1]), pos,
                        attn.data(), m, H, Hkv, D, widest, s_row, s_head, s_col, static_cast<float>(e[2]), threads,
                        cs, sn, c_stride);
    int4_bf16(attn.data(), H * D, u8(t[2]), t[8], h2.data(), m, d, H * D, threads, nullptr, 0.0f, hin);
    int4_bf16(h2.data(), d, u8(t[3]), t[9], gu.data(), m, 2 * I, d, threads, b(t[6]), static_cast<float>(e[1]),
              nullptr);
    silu_mul_rows_bf16(gu.data(), act.data(), m, I, exp8);
    int4_bf16(act.data(), I, u8(t[4]), t[10], hout, m, d, I, threads, nullptr, 0.0f, h2.data());
    hin = hout;
  }
#else
  (void)h_ptr, (void)out_ptr, (void)m, (void)d, (void)table_ptr, (void)floats_ptr, (void)kv_ptr, (void)first;
  (void)last, (void)H, (void)Hkv, (void)D, (void)I, (void)cos_ptr, (void)sin_ptr, (void)c_stride, (void)pos_ptr;
  (void)cols, (void)s_row, (void)s_head, (void)s_col, (void)threads;
  throw std::invalid_argument("decode_layers_bf16: not built for this platform");
#endif
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastgate C++ ops: token-to-word alignment, word log-probs, dual-path AIS scores, eigenscore, decode attention, RMS norm and rotary embedding of bf16 rows, prefill attention";
  m.def("align_words", &align_words, py::arg("pieces"),
        "Group generated token pieces (all str or all bytes) into words; returns (words, word_ids).");
  m.def("word_logprobs", &word_logprobs, py::arg("token_logprobs"), py::arg("word_ids"), py::arg("n_words") = -1,
        "Mean token log-prob per word; words with no token get 0.");
  m.def("ais_scores", &ais_scores, py::arg("q"), py::arg("p"), py::arg("docs"), py::arg("mode") = "angle");
  m.def("ais_scores_batch", &ais_scores_batch, py::arg("Q"), py::arg("P"), py::arg("D"), py::arg("mode") = "angle");
  m.def("align_word_logprobs_batch", &align_word_logprobs_batch, py::arg("batch_pieces"), py::arg("batch_logprobs"),
        "align_words + word_logprobs for many sequences; returns [(words, word_ids, word_logprobs)].");
  m.def("ais_topk_batch", &ais_topk_batch, py::arg("Q"), py::arg("P"), py::arg("D"), py::arg("k"),
        py::arg("mode") = "angle", "AIS scores and top-k indices per row, best first: (scores [B, k], idx [B, k]).");
  m.def("decode_attention_bf16", &decode_attention_bf16, py::arg("q"), py::arg("keys"), py::arg("values"),
        py::arg("pos"), py::arg("out"), py::arg("m"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"),
        py::arg("cols"), py::arg("row_stride"), py::arg("head_stride"), py::arg("col_stride"), py::arg("scale"), py::arg("threads") = 0,
        "Decode rows' attention over a bf16 key / value store, float32 inside (pointers to checked torch tensors).");
  m.def("decode_attention_step_bf16", &decode_attention_step_bf16, py::arg("q"), py::arg("q_row"), py::arg("q_head"),
        py::arg("k_new"), py::arg("k_new_row"), py::arg("k_new_head"), py::arg("v_new"), py::arg("v_new_row"),
        py::arg("v_new_head"), py::arg("keys"), py::arg("values"), py::arg("pos"), py::arg("out"), py::arg("m"),
        py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("cols"), py::arg("row_stride"),
        py::arg("head_stride"), py::arg("col_stride"), py::arg("scale"), py::arg("threads") = 0,
        py::arg("cos") = 0, py::arg("sin") = 0, py::arg("cos_stride") = 0,
        "A decode-only pass's store writes and attention over a bf16 store, bf16 in and out (checked pointers); with "
        "cos / sin, q and k_new rotated first (rope_bf16's loop).");
  m.def("rms_norm_bf16", &rms_norm_bf16, py::arg("x"), py::arg("weight"), py::arg("out"), py::arg("rows"),
        py::arg("d"), py::arg("x_stride"), py::arg("eps"), py::arg("threads") = 0,
        "LlamaRMSNorm of bf16 rows, float32 statistics, HF's roundings (pointers to checked torch tensors).");
  m.def("set_quant_grain", &set_quant_grain, py::arg("grain"),
        "Bench hook: the multiply-adds a thread of a quantized product takes at least (default 2^17).");
  m.def("set_max_vector_width", &set_max_vector_width, py::arg("width"),
        "Test hook: 8 runs the elementwise layer ops 8 wide on an AVX-512 CPU too; 16 (the default) restores them.");
  m.def("cpu_has_avx512", &cpu_has_avx512,
        "Whether this CPU runs the elementwise layer ops 16 floats a vector (AVX-512F/BW/VL/DQ).");
  m.def("rope_bf16", &rope_bf16, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("out"), py::arg("tokens"),
        py::arg("heads"), py::arg("head_dim"), py::arg("token_stride"), py::arg("head_stride"), py::arg("cos_stride"),
        py::arg("threads") = 0, "HF's rotary embedding of bf16 rows, HF's roundings (pointers to checked torch tensors).");
  m.def("prefill_attention_bf16", &prefill_attention_bf16, py::arg("q"), py::arg("q_head_stride"),
        py::arg("q_row_stride"), py::arg("keys"), py::arg("values"), py::arg("kv_head_stride"), py::arg("kv_col_stride"),
        py::arg("out"), py::arg("n"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("start"),
        py::arg("scale"), py::arg("threads") = 0,
        "A prompt chunk's causal attention over bf16 keys / values, AVX512-BF16 scores, float32 softmax and values, "
        "bf16 out (pointers to checked torch tensors).");
  m.def("prefill_attention_segs_bf16", &prefill_attention_segs_bf16, py::arg("q"), py::arg("q_head_stride"),
        py::arg("q_row_stride"), py::arg("new_keys"), py::arg("new_keys_head_stride"), py::arg("new_keys_row_stride"),
        py::arg("new_values"), py::arg("new_values_head_stride"), py::arg("new_values_row_stride"), py::arg("table"),
        py::arg("chunks"), py::arg("out"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"),
        py::arg("scale"), py::arg("threads") = 0,
        "A packed pass's prompt chunks in one call: each chunk's new keys / values into its buffers, then its causal "
        "attention as prefill_attention_bf16 computes it (pointers to checked torch tensors; table int64 [chunks, 6]).");
  m.def("prefill_attention_f32", &prefill_attention_f32, py::arg("q"), py::arg("q_head_stride"),
        py::arg("q_row_stride"), py::arg("keys"), py::arg("values"), py::arg("kv_head_stride"), py::arg("kv_col_stride"),
        py::arg("out"), py::arg("n"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("start"),
        py::arg("scale"), py::arg("threads") = 0,
        "A prompt chunk's causal attention over float32 keys / values, AVX-512 or AVX2 and FMA (pointers to checked "
        "torch tensors).");
  m.def("prefill_attention_f32_supported", &prefill_attention_f32_supported,
        "Whether this CPU runs prefill_attention_f32 (AVX-512, or AVX2 and FMA: 8 floats a vector).");
  m.def("prefill_attention_bf16_supported", &prefill_attention_bf16_supported,
        "Whether this CPU runs prefill_attention_bf16 (AVX512-BF16).");
  m.def("quant_kernels_supported", &quant_kernels_supported,
        "Whether int4_matmul_bf16 / int8_matmul_bf16 run here (built for and running on a CPU with AVX512-BF16)");
  m.def("int4_matmul_bf16", &int4_matmul_bf16, py::arg("x"), py::arg("x_stride"), py::arg("tiles"), py::arg("form"),
        py::arg("out"),
        py::arg("m"), py::arg("n"), py::arg("k"), py::arg("threads") = 0,
        py::arg("norm") = 0, py::arg("eps") = 1e-6, py::arg("residual") = 0);
  m.def("int8_matmul_bf16", &int8_matmul_bf16, py::arg("x"), py::arg("x_stride"), py::arg("tiles"), py::arg("scale"),
        py::arg("out"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("threads") = 0);
  m.def("int4_matmul_f32", &int4_matmul_f32, py::arg("x"), py::arg("x_stride"), py::arg("q"), py::arg("scale"),
        py::arg("offset"), py::arg("out"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("threads") = 0,
        py::arg("residual") = 0, py::arg("norm_weight") = 0, py::arg("eps") = 1e-6,
        "The int4 weight-only product of float32 rows (AVX2 + FMA; codes, scales and offsets in the tiles csrc/ops.cpp "
        "describes); with norm_weight, of "
        "rms_norm_f32(x, norm_weight, eps)");
  m.def("rms_norm_f32", &rms_norm_f32, py::arg("x"), py::arg("weight"), py::arg("out"), py::arg("rows"), py::arg("d"),
        py::arg("x_stride"), py::arg("eps"), py::arg("threads") = 0,
        "LlamaRMSNorm of float32 rows, torch's float32 arithmetic bit for bit (AVX2 + FMA; checked pointers).");
  m.def("rope_f32", &rope_f32, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("out"), py::arg("tokens"),
        py::arg("heads"), py::arg("head_dim"), py::arg("token_stride"), py::arg("head_stride"), py::arg("cos_stride"),
        py::arg("threads") = 0, "HF's rotary embedding of float32 rows, bit for bit (AVX2 + FMA; checked pointers).");
  m.def("decode_attention_step_f32", &decode_attention_step_f32, py::arg("q"), py::arg("q_row"), py::arg("q_head"),
        py::arg("k_new"), py::arg("k_new_row"), py::arg("k_new_head"), py::arg("v_new"), py::arg("v_new_row"),
        py::arg("v_new_head"), py::arg("keys"), py::arg("values"), py::arg("pos"), py::arg("out"), py::arg("m"),
        py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("cols"), py::arg("row_stride"),
        py::arg("head_stride"), py::arg("col_stride"), py::arg("scale"), py::arg("threads") = 0,
        py::arg("cos") = 0, py::arg("sin") = 0, py::arg("cos_stride") = 0,
        "A decode-only pass's store writes and attention over a float32 store, float32 in and out (AVX2 + FMA; "
        "checked pointers); with cos / sin, q and k_new rotated first.");
  m.def("int8_matmul_f32", &int8_matmul_f32, py::arg("x"), py::arg("x_stride"), py::arg("q"), py::arg("scale"),
        py::arg("out"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("threads") = 0,
        "The int8 weight-only product of float32 rows (AVX2 + FMA)");
  m.def("quant_f32_kernels_supported", &quant_f32_kernels_supported,
        "Whether int4_matmul_f32 / int8_matmul_f32 run here (built for x86-64 and the CPU has AVX2 and FMA)");
  m.def("pool_spin", &pool_spin,
        "The extension's idle worker threads spin for its next call again (after pool_rest); its quantized products "
        "and layer stacks call it themselves");
  m.def("pool_rest", &pool_rest,
        "The extension's idle worker threads sleep at once after each call instead of spinning, until pool_spin: call "
        "it before torch runs its own threads (a oneDNN product), which a spinning worker would take a core from");
  m.def("torch_exp_found", &torch_exp_found,
        "Whether silu_mul_f32 and decode_layers_f32 run here (AVX2, FMA and torch's SLEEF exp found)");
  m.def("set_torch_float_block", &set_torch_float_block, py::arg("block"),
        "How many floats torch's vectorized loops take a step (16: AVX2, 32: AVX-512): silu_mul_f32's and "
        "decode_layers_f32's SwiGLU then split a row as torch does");
  m.def("silu_mul_f32", &silu_mul_f32, py::arg("gu"), py::arg("out"), py::arg("rows"), py::arg("inter"),
        "out [m, I] = silu(gu[:, :I]) * gu[:, I:] of float32 rows, torch's arithmetic");
  m.def("token_logprobs_f32", &token_logprobs_f32, py::arg("logits"), py::arg("rows"), py::arg("vocab"),
        py::arg("stride"), py::arg("chosen"), py::arg("argmax"), py::arg("out"), py::arg("threads") = 0,
        py::arg("width") = 8,
        "out[r] = log_softmax(logits)[r, chosen[r]] of float32 rows, torch's bits (chosen = argmax where asked; "
        "width: the vectors of the torch matched, 8 or 16)");
  m.def("decode_layers_f32", &decode_layers_f32, py::arg("h"), py::arg("out"), py::arg("rows"), py::arg("d"),
        py::arg("table"), py::arg("floats"), py::arg("kv"), py::arg("first"), py::arg("last"), py::arg("heads"),
        py::arg("kv_heads"), py::arg("head_dim"), py::arg("inter"), py::arg("cos"), py::arg("sin"),
        py::arg("c_stride"), py::arg("pos"), py::arg("cols"), py::arg("s_row"), py::arg("s_head"), py::arg("s_col"),
        py::arg("threads"), "A float32 model's int4 decoder layers first .. last - 1 for decode rows, in one call");
  m.def("silu_mul_bf16", &silu_mul_bf16, py::arg("gu"), py::arg("out"), py::arg("rows"), py::arg("inter"),
        py::arg("threads") = 1,
        "out [m, I] = silu(gu[:, :I]) * gu[:, I:] of bf16 rows, torch's arithmetic; rows over up to `threads` "
        "threads (0: one per core)");
  m.def("decode_layers_bf16", &decode_layers_bf16, py::arg("h"), py::arg("out"), py::arg("rows"), py::arg("d"),
        py::arg("table"), py::arg("floats"), py::arg("kv"), py::arg("first"), py::arg("last"), py::arg("heads"),
        py::arg("kv_heads"), py::arg("head_dim"), py::arg("inter"), py::arg("cos"), py::arg("sin"),
        py::arg("c_stride"), py::arg("pos"), py::arg("cols"), py::arg("s_row"), py::arg("s_head"), py::arg("s_col"),
        py::arg("threads"), "A bf16 model's int4 decoder layers first .. last - 1 for decode rows, in one call "
        "(AVX512-BF16)");
  m.def("eigenscore", &eigenscore, py::arg("z"), py::arg("valid"), py::arg("alpha"), py::arg("cov") = false,
        "SeaKR's eigenscore of z [B, k, d] over the valid [B, k] samples, float64 inside: [B] float32; cov divides the "
        "Gram matrix by d - 1 (INSIDE's form).");
}
