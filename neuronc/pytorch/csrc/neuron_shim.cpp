// The C++ half of the `neuron` device: what PyTorch only accepts from C++.
//
// * an allocator (c10::DeviceAllocator) whose bytes are counted on the emulated NeuronCore's HBM (the
//   Python runtime's accounting, neuronc.pytorch.device_memory) and held in a numpy array, so that
//   `view` gives Python a numpy view of a tensor's elements with one call; freed buffers are cached by
//   size for the next storage (empty_cache gives them back);
// * a DeviceGuardImplInterface: current device, streams and events over an emulated per-stream clock
//   (each queued program advances its stream's clock by its estimated device time); synchronising or
//   querying runs the device's queued work (neuronc.pytorch.queues);
// * PrivateUse1HooksInterface, so torch.accelerator sees the device, with a generator per device;
// * autocast: PyTorch's op lists registered on AutocastPrivateUse1;
// * profiler stubs: the profiler stamps each op with its stream's emulated clock before and after it, so
//   an op's device time is what it added to the clock (torch.profiler's PrivateUse1 activity);
// * the kernels that only touch tensor metadata (empty, views, resize, set_), which must alias storage.
//
// Every op that computes is in Python (neuronc/pytorch/eager.py).
#include <ATen/core/Generator.h>
#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/native/Resize.h>
#include <ATen/native/TensorFactories.h>
#include <ATen/ops/as_strided_cpu_dispatch.h>
#include <ATen/ops/set_cpu_dispatch.h>
#include <ATen/ops/view_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/ApproximateClock.h>
#include <torch/csrc/profiler/stubs/base.h>
#include <torch/csrc/profiler/standalone/privateuse1_profiler.h>  // (USE_KINETO: see shim.py)
#include <GenericTraceActivity.h>
#include <IActivityProfiler.h>
#include <libkineto.h>  // CpuTraceBuffer
#include <torch/extension.h>
#include <pybind11/numpy.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace py = pybind11;

namespace neuron {

constexpr c10::DeviceType kDevice = c10::DeviceType::PrivateUse1;
constexpr int kMaxDevices = 64;

c10::DeviceIndex g_device_count = 1;
thread_local c10::DeviceIndex t_current_device = 0;
thread_local std::array<c10::StreamId, kMaxDevices> t_current_stream{};  // per device: the current stream

c10::DeviceIndex current_device() { return t_current_device; }

void check_index(c10::DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < g_device_count, "neuron:", static_cast<int>(index),
              " does not exist: there are ", static_cast<int>(g_device_count),
              " emulated NeuronCores (set NEURON_RT_VISIBLE_CORES to change how many)");
}

// ---- memory -------------------------------------------------------------------------------------

py::object* g_reserve = nullptr;  // Python: (device index, nbytes) -> (handle of the bytes on the core's HBM,
                                   //   the numpy uint8 array holding them); on any failure it reserves nothing
py::object* g_release = nullptr;  // Python: (device index, handle) -> None

struct Buffer {
  PyObject* bytes;  // the numpy uint8 array holding the storage; views of it keep it alive after the free
  void* data;
  c10::DeviceIndex device;
  size_t nbytes;
  int64_t handle;
  int64_t stream;  // the stream it was allocated on; -1 once recorded on another (it is not cached then)
};

std::mutex g_stats_mutex;
std::array<c10::CachingDeviceAllocator::DeviceStats, kMaxDevices> g_stats;

// `in_use`: bytes held by tensors (allocated, active, requested); `reserved`: bytes held on the core's HBM
// (reserved, segments), which a freed buffer keeps while it waits in the cache.
void update_stats(c10::DeviceIndex device, size_t nbytes, bool increase, bool in_use, bool reserved) {
  std::lock_guard<std::mutex> lock(g_stats_mutex);
  auto& stats = g_stats[device];
  auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  auto change = [&](c10::CachingAllocator::Stat& stat, int64_t amount) {
    increase ? stat.increase(amount) : stat.decrease(amount);
  };
  if (in_use) {
    for (auto* stat : {&stats.allocated_bytes[agg], &stats.active_bytes[agg], &stats.requested_bytes[agg]}) {
      change(*stat, nbytes);
    }
    for (auto* stat : {&stats.allocation[agg], &stats.active[agg]}) change(*stat, 1);
  }
  if (reserved) {
    change(stats.reserved_bytes[agg], nbytes);
    change(stats.segment[agg], 1);
  }
}

// Freed buffers wait here, per (device, stream, size), to be given to the next storage of that size on that
// stream without asking Python, as CUDA's caching allocator does (torch.accelerator.empty_cache() gives them
// back to the core). Queued work of the stream that still reads a freed buffer runs before the stream's later
// work that reuses it; a buffer used on another stream (Tensor.record_stream) is not cached.
std::mutex g_cache_mutex;
std::map<std::tuple<c10::DeviceIndex, int64_t, size_t>, std::vector<Buffer*>> g_cached;

void release_buffer(Buffer* buffer);

void free_buffer(void* context) {
  auto* buffer = static_cast<Buffer*>(context);
  update_stats(buffer->device, buffer->nbytes, false, true, false);
  if (buffer->stream < 0) {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      release_buffer(buffer);
    }
    return;
  }
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  g_cached[{buffer->device, buffer->stream, buffer->nbytes}].push_back(buffer);
}

void release_buffer(Buffer* buffer) {  // with the GIL
  update_stats(buffer->device, buffer->nbytes, false, false, true);
  py::error_scope pending;  // tensors are also freed while an exception unwinds: keep it for later
  try {
    (*g_release)(buffer->device, buffer->handle);
  } catch (py::error_already_set& e) {
    e.discard_as_unraisable("freeing a neuron tensor's HBM");
  }
  Py_DECREF(buffer->bytes);  // queued work holding views of the bytes keeps them until it has run
  delete buffer;
}

void empty_cache(c10::DeviceIndex device) {  // device -1: all of them
  std::vector<Buffer*> released;
  {
    std::lock_guard<std::mutex> lock(g_cache_mutex);
    for (auto it = g_cached.begin(); it != g_cached.end();) {
      if (device >= 0 && std::get<0>(it->first) != device) {
        ++it;
        continue;
      }
      released.insert(released.end(), it->second.begin(), it->second.end());
      it = g_cached.erase(it);
    }
  }
  if (released.empty() || !Py_IsInitialized()) return;
  py::gil_scoped_acquire gil;
  for (auto* buffer : released) release_buffer(buffer);
}

Buffer* cached_buffer(c10::DeviceIndex device, int64_t stream, size_t nbytes) {
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  auto it = g_cached.find({device, stream, nbytes});
  if (it == g_cached.end() || it->second.empty()) return nullptr;
  auto* buffer = it->second.back();
  it->second.pop_back();
  return buffer;
}

Buffer* new_buffer(c10::DeviceIndex device, int64_t stream, size_t nbytes) {  // with the GIL
  py::tuple reserved;
  try {
    reserved = (*g_reserve)(device, nbytes);
  } catch (py::error_already_set&) {  // out of HBM or of host memory: give back what the cache holds, retry once
    empty_cache(device);
    reserved = (*g_reserve)(device, nbytes);  // raises DeviceOutOfMemoryError through pybind
  }
  auto handle = reserved[0].cast<int64_t>();
  auto bytes = reserved[1].cast<py::array_t<uint8_t>>();  // filled with 0xFF: uninitialised HBM reads as NaN
  void* data = bytes.mutable_data();
  update_stats(device, nbytes, true, false, true);
  return new Buffer{bytes.release().ptr(), data, device, nbytes, handle, stream};
}

struct NeuronAllocator final : public c10::DeviceAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    c10::DeviceIndex device = current_device();
    if (nbytes == 0) {
      return {nullptr, nullptr, &c10::detail::deleteNothing, c10::Device(kDevice, device)};
    }
    TORCH_CHECK(g_reserve != nullptr, "the neuron device is not initialised (import neuronc.pytorch.device)");
    int64_t stream = t_current_stream[device];
    Buffer* buffer = cached_buffer(device, stream, nbytes);
    if (buffer == nullptr) {
      py::gil_scoped_acquire gil;
      buffer = new_buffer(device, stream, nbytes);
    }
    update_stats(device, nbytes, true, true, false);
    return {buffer->data, buffer, &free_buffer, c10::Device(kDevice, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const final { default_copy_data(dest, src, count); }

  bool initialized() override { return g_reserve != nullptr; }
  void emptyCache(c10::MempoolId_t) override { empty_cache(-1); }
  void recordStream(const c10::DataPtr& data, c10::Stream stream) override {
    if (data.get_deleter() != &free_buffer) return;
    auto* buffer = static_cast<Buffer*>(data.get_context());
    if (stream.id() != buffer->stream) buffer->stream = -1;  // read on another stream: never reused
  }
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(g_stats_mutex);
    return g_stats[device];
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(g_stats_mutex);
    for (auto* array : {&g_stats[device].allocated_bytes, &g_stats[device].reserved_bytes,
                        &g_stats[device].active_bytes, &g_stats[device].requested_bytes,
                        &g_stats[device].allocation, &g_stats[device].segment, &g_stats[device].active}) {
      for (auto& stat : *array) stat.reset_accumulated();
    }
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(g_stats_mutex);
    for (auto* array : {&g_stats[device].allocated_bytes, &g_stats[device].reserved_bytes,
                        &g_stats[device].active_bytes, &g_stats[device].requested_bytes,
                        &g_stats[device].allocation, &g_stats[device].segment, &g_stats[device].active}) {
      for (auto& stat : *array) stat.reset_peak();
    }
  }
};

NeuronAllocator g_allocator;
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_allocator);

// ---- streams and events on the emulated timeline --------------------------------------------------

// Work is queued per stream (neuronc/pytorch/queues.py) and runs at synchronisation points. Each launch
// starts at its stream's clock and moves it on by the program's estimated device time; a stream never
// starts before the device's last synchronisation (the host waited for everything queued until then),
// and an event wait moves the waiting stream's clock to the event's. Events read these clocks.
std::mutex g_clock_mutex;
std::map<std::pair<c10::DeviceIndex, c10::StreamId>, double> g_clock_ns;
std::array<double, kMaxDevices> g_synced_ns{};  // per device: the emulated time of its last synchronisation
std::atomic<c10::StreamId> g_next_stream{1};
py::object* g_synchronize = nullptr;  // Python: (device index) -> None, runs the device's queued work

double& clock_of(c10::DeviceIndex device, c10::StreamId stream) {  // callers hold g_clock_mutex
  double& clock = g_clock_ns[{device, stream}];
  clock = std::max(clock, g_synced_ns[device]);
  return clock;
}

// Run the queued work of `device` (Python), then no stream of it starts before the latest of them ended.
void synchronize_device(c10::DeviceIndex device) {
  if (g_synchronize != nullptr) {
    py::gil_scoped_acquire gil;
    (*g_synchronize)(device);  // an error of queued work is raised here, with the op that caused it
  }
}

void settle(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lock(g_clock_mutex);
  for (auto& [key, clock] : g_clock_ns) {
    if (key.first == device) g_synced_ns[device] = std::max(g_synced_ns[device], clock);
  }
}

struct NeuronEvent {
  c10::DeviceIndex device = -1;
  c10::StreamId stream = 0;
  double time_ns = 0;
  bool recorded = false;
  c10::EventFlag flag;
};

c10::Stream make_stream(c10::DeviceIndex device, c10::StreamId id) {
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(kDevice, device), id);
}

c10::DeviceIndex index_of(c10::Device d) {  // "neuron" without an index is the current device
  c10::DeviceIndex index = d.has_index() ? d.index() : current_device();
  check_index(index);
  return index;
}

struct NeuronGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kDevice; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kDevice, current_device()); }
  void setDevice(c10::Device d) const override {
    check_index(d.index());
    t_current_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override { t_current_device = d.index(); }
  c10::Stream getStream(c10::Device d) const override {
    return make_stream(index_of(d), t_current_stream[index_of(d)]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override { return make_stream(index_of(d), 0); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override { return getNewStream(d, 0); }
  c10::Stream getNewStream(c10::Device d, int) const override { return make_stream(index_of(d), g_next_stream++); }
  c10::Stream exchangeStream(c10::Stream s) const override {
    auto old = getStream(s.device());
    t_current_stream[s.device_index()] = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return g_device_count; }

  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device,
              const c10::EventFlag flag) const override {
    TORCH_CHECK(device == -1 || device == stream.device_index(), "event on neuron:", static_cast<int>(device),
                " cannot be recorded on a stream of neuron:", static_cast<int>(stream.device_index()));
    if (*event == nullptr) *event = new NeuronEvent{};
    auto* e = static_cast<NeuronEvent*>(*event);
    std::lock_guard<std::mutex> lock(g_clock_mutex);
    *e = NeuronEvent{stream.device_index(), stream.id(), clock_of(stream.device_index(), stream.id()), true, flag};
  }
  void block(void* event, const c10::Stream& stream) const override {
    if (event == nullptr) return;
    auto* e = static_cast<NeuronEvent*>(event);
    if (!e->recorded) return;
    std::lock_guard<std::mutex> lock(g_clock_mutex);
    double& clock = clock_of(stream.device_index(), stream.id());
    clock = std::max(clock, e->time_ns);  // the stream's next work starts after the event
  }
  // Querying or waiting for an event or a stream is a synchronisation point: the device's queued work runs
  // (in emulated-time order across its streams), so the answer is always "done".
  bool queryEvent(void* event) const override {
    synchronizeEvent(event);
    return true;
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<NeuronEvent*>(event);
  }
  bool queryStream(const c10::Stream& stream) const override {
    synchronizeStream(stream);
    return true;
  }
  void synchronizeStream(const c10::Stream& stream) const override { synchronize_device(stream.device_index()); }
  void synchronizeEvent(void* event) const override {
    auto* e = static_cast<NeuronEvent*>(event);
    if (e != nullptr && e->recorded) synchronize_device(e->device);
  }
  void synchronizeDevice(const c10::DeviceIndex device) const override {
    synchronize_device(device < 0 ? current_device() : device);
  }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override {
    TORCH_CHECK(start && end, "both events must be recorded before elapsed_time");
    auto* a = static_cast<NeuronEvent*>(start);
    auto* b = static_cast<NeuronEvent*>(end);
    TORCH_CHECK(a->recorded && b->recorded, "both events must be recorded before elapsed_time");
    return (b->time_ns - a->time_ns) / 1e6;  // milliseconds, as CUDA
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, NeuronGuardImpl);

// ---- random numbers ------------------------------------------------------------------------------

// A `neuron` generator is the state of a counter-based generator, as CUDA's Philox one: a seed and an offset
// (how many numbers of the seed's stream were handed out). Random ops run on the emulated device (the GpSimd
// engine's RNG instruction draws element e of the stream as a pure function of (seed, e)), so a launch
// only reserves its span of the stream (`philox_state`), and the generator's whole state is 16 bytes.
struct NeuronGeneratorImpl final : public c10::GeneratorImpl {
  NeuronGeneratorImpl(c10::DeviceIndex device, uint64_t seed)
      : c10::GeneratorImpl{c10::Device(kDevice, device), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)},
        seed_(seed) {}
  void set_current_seed(uint64_t seed) override {
    seed_ = seed;
    offset_ = 0;
  }
  void set_offset(uint64_t offset) override { offset_ = offset; }
  uint64_t get_offset() const override { return offset_; }
  uint64_t current_seed() const override { return seed_; }
  uint64_t seed() override {
    auto random = c10::detail::getNonDeterministicRandom();
    set_current_seed(random);
    return random;
  }
  void set_state(const c10::TensorImpl& state) override {
    at::detail::check_rng_state(state);
    TORCH_CHECK(state.numel() == kStateBytes, "a neuron generator's state is ", kStateBytes,
                " bytes (seed, offset), not ", state.numel(), ": take it from a neuron generator's get_state()");
    const auto* bytes = static_cast<const uint8_t*>(state.data());
    std::memcpy(&seed_, bytes, 8);
    std::memcpy(&offset_, bytes + 8, 8);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    auto state = at::detail::empty_cpu({kStateBytes}, c10::ScalarType::Byte, std::nullopt, std::nullopt,
                                       std::nullopt, std::nullopt);
    auto* bytes = static_cast<uint8_t*>(state.data_ptr());
    std::memcpy(bytes, &seed_, 8);
    std::memcpy(bytes + 8, &offset_, 8);
    return state.getIntrusivePtr();
  }
  // (seed, offset) for a launch drawing `count` numbers; the offset moves on by them, rounded up to whole
  // Philox blocks of 4 so that two launches never share a block.
  std::pair<uint64_t, uint64_t> reserve(uint64_t count) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto taken = std::make_pair(seed_, offset_);
    offset_ += (count + 3) / 4 * 4;
    return taken;
  }
  static c10::DeviceType device_type() { return kDevice; }
  static constexpr int64_t kStateBytes = 16;

 private:
  uint64_t seed_;
  uint64_t offset_ = 0;
  NeuronGeneratorImpl* clone_impl() const override {
    auto* copy = new NeuronGeneratorImpl(device_.index(), seed_);
    copy->offset_ = offset_;
    return copy;
  }
};

std::array<at::Generator, kMaxDevices> g_default_generators;
std::once_flag g_generators_once;

const at::Generator& default_generator(c10::DeviceIndex device) {
  std::call_once(g_generators_once, [] {
    for (int i = 0; i < kMaxDevices; ++i) {
      g_default_generators[i] = at::make_generator<NeuronGeneratorImpl>(i, c10::detail::getNonDeterministicRandom());
    }
  });
  return g_default_generators[device < 0 ? current_device() : device];
}

// (seed, offset) of `generator` (the default one of `device` for None) for `count` numbers: the span of the
// stream one launch draws; the generator moves past it.
std::pair<uint64_t, uint64_t> philox_state(std::optional<at::Generator> generator, c10::DeviceIndex device,
                                           uint64_t count) {
  const at::Generator& chosen = generator.has_value() ? *generator : default_generator(device);
  TORCH_CHECK(chosen.device().type() == kDevice, "expected a neuron generator, got one of ", chosen.device());
  return chosen.get<NeuronGeneratorImpl>()->reserve(count);
}

// ---- pinned host memory ------------------------------------------------------------------------------------

// Host memory registered for the device (`Tensor.pin_memory()`, `DataLoader(pin_memory=True)`): page-aligned
// buffers whose address ranges are recorded, so that `is_pinned()` can tell them, and a copy to the device can
// read them when it runs rather than when it is queued (see `pinned_span`).
struct PinnedAllocator final : public c10::Allocator {
  static constexpr size_t kAlignment = 4096;
  std::mutex mutex;
  std::map<uintptr_t, size_t> spans;  // start address -> bytes

  c10::DataPtr allocate(size_t nbytes) override {
    void* data = nullptr;
    if (nbytes > 0) {
      TORCH_CHECK(posix_memalign(&data, kAlignment, nbytes) == 0, "neuron: cannot allocate ", nbytes,
                  " bytes of pinned host memory");
      std::lock_guard<std::mutex> lock(mutex);
      spans[reinterpret_cast<uintptr_t>(data)] = nbytes;
    }
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }
  static void release(void* data);
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

  // The pinned buffer holding `data`: (start, bytes), or (0, 0).
  std::pair<uintptr_t, size_t> span_of(const void* data) {
    std::lock_guard<std::mutex> lock(mutex);
    auto address = reinterpret_cast<uintptr_t>(data);
    auto after = spans.upper_bound(address);
    if (after == spans.begin()) return {0, 0};
    --after;
    if (address >= after->first + after->second) return {0, 0};
    return *after;
  }
};

PinnedAllocator g_pinned_allocator;

void PinnedAllocator::release(void* data) {
  if (data == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(g_pinned_allocator.mutex);
    g_pinned_allocator.spans.erase(reinterpret_cast<uintptr_t>(data));
  }
  free(data);
}

// Whether a CPU tensor's bytes lie in pinned host memory.
bool is_pinned(const at::Tensor& tensor) {
  return tensor.device().is_cpu() && g_pinned_allocator.span_of(tensor.data_ptr()).second > 0;
}

struct NeuronHooks final : public at::PrivateUse1HooksInterface {
  bool isPinnedPtr(const void* data) const override { return g_pinned_allocator.span_of(data).second > 0; }
  at::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned_allocator; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return g_device_count; }
  void setCurrentDevice(c10::DeviceIndex d) const override {
    check_index(d);
    t_current_device = d;
  }
  c10::DeviceIndex getCurrentDevice() const override { return current_device(); }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    auto old = current_device();
    setCurrentDevice(d);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return exchangeDevice(d); }
  at::Device getDeviceFromPtr(void*) const override { return c10::Device(kDevice, current_device()); }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex device) const override {
    return default_generator(device);
  }
  at::Generator getNewGenerator(c10::DeviceIndex device) const override {
    return at::make_generator<NeuronGeneratorImpl>(device < 0 ? current_device() : device,
                                                   c10::default_rng_seed_val);
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    c10::DeviceGuard guard(storage.device());
    at::native::resize_bytes_cpu(storage.unsafeGetStorageImpl(), newsize);
  }
};

NeuronHooks* g_hooks = nullptr;

// ---- profiler ------------------------------------------------------------------------------------

// An event of the profiler is a reading of the current stream's emulated clock; two readings around an op
// give the device time of the work it queued (the clock moves on at each launch, see `launch`).
struct NeuronProfilerStubs final : public torch::profiler::impl::ProfilerStubs {
  void record(c10::DeviceIndex* device, torch::profiler::impl::ProfilerVoidEventStub* event,
              int64_t* cpu_ns) const override {
    auto index = current_device();
    if (device != nullptr) *device = index;
    if (cpu_ns != nullptr) *cpu_ns = c10::getTime();
    std::lock_guard<std::mutex> lock(g_clock_mutex);
    *event = std::make_shared<double>(clock_of(index, t_current_stream[index]));
  }
  float elapsed(const torch::profiler::impl::ProfilerVoidEventStub* start,
                const torch::profiler::impl::ProfilerVoidEventStub* end) const override {  // microseconds
    return static_cast<float>((*static_cast<double*>(end->get()) - *static_cast<double*>(start->get())) / 1e3);
  }
  void mark(const char*) const override {}
  void rangePush(const char*) const override {}
  void rangePop() const override {}
  bool enabled() const override { return true; }
  void onEachDevice(std::function<void(int)> op) const override {
    auto previous = current_device();
    for (c10::DeviceIndex d = 0; d < g_device_count; ++d) {
      t_current_device = d;
      op(d);
    }
    t_current_device = previous;
  }
  void synchronize() const override {}  // the clocks move at launch: nothing to wait for
};

NeuronProfilerStubs* g_profiler_stubs = nullptr;

// ---- Kineto plugin: device rows in torch.profiler ---------------------------------------------------------

// `torch.profiler.profile(activities=[CPU, PrivateUse1])` asks Kineto for a session of this profiler, which
// PyTorch registered through REGISTER_PRIVATEUSE1_PROFILER. While it records, each launch carries the
// correlation id of the ATen op that queued it (Kineto pushes it here as the op starts), and Python records the
// launch's kernels with their emulated start and duration on the stream (`record_activity`). At the end they
// become Kineto activities: kernels, copies and fills on a row per device and stream, linked to their op, and
// the ranges of record_function on the same rows. Times are the emulated clock's, shifted so that the first
// launch of a device starts when the host queued it.
struct DeviceActivity {
  std::string name;
  libkineto::ActivityType type;
  c10::DeviceIndex device;
  int64_t stream;
  uint64_t correlation;
  double start_ns;  // emulated
  double end_ns;
  int64_t host_ns;  // when the host queued the launch (system clock)
  int64_t flow;  // the launch it belongs to
};

struct HostLaunch {  // the host side of a launch: where the flow arrow to its device activities starts
  std::string name;
  uint64_t correlation;
  int64_t host_ns;
  int32_t thread;
  int64_t flow;
};

struct UserRange {  // a record_function range: the launches queued inside it
  uint64_t correlation;
  size_t first, last;  // [first, last) of g_activities
};

std::mutex g_trace_mutex;
std::atomic<bool> g_tracing{false};
std::vector<DeviceActivity> g_activities;
std::vector<HostLaunch> g_launches;
std::vector<UserRange> g_user_ranges;
thread_local std::vector<uint64_t> t_correlations;
thread_local std::vector<std::pair<uint64_t, size_t>> t_user_ranges;  // (correlation, first activity)

int64_t system_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch()).count();
}

// The correlation id of the op a launch belongs to: 0 outside an op, -1 when no trace records.
int64_t current_correlation() {
  if (!g_tracing.load(std::memory_order_relaxed)) return -1;
  return t_correlations.empty() ? 0 : static_cast<int64_t>(t_correlations.back());
}

// A launch queued by the host now (by the op of `correlation`): the id its device activities are recorded with.
int64_t record_launch(const std::string& name, uint64_t correlation) {
  if (!g_tracing.load()) return 0;
  std::lock_guard<std::mutex> lock(g_trace_mutex);
  int64_t flow = static_cast<int64_t>(g_launches.size()) + 1;
  g_launches.push_back({name, correlation, system_ns(), libkineto::systemThreadId(), flow});
  return flow;
}

void record_activity(const std::string& name, const std::string& kind, c10::DeviceIndex device, int64_t stream,
                     uint64_t correlation, double start_ns, double end_ns, int64_t flow) {
  if (!g_tracing.load()) return;
  auto type = kind == "memcpy" ? libkineto::ActivityType::GPU_MEMCPY
              : kind == "memset" ? libkineto::ActivityType::GPU_MEMSET
                                 : libkineto::ActivityType::CONCURRENT_KERNEL;
  std::lock_guard<std::mutex> lock(g_trace_mutex);
  int64_t host_ns = flow > 0 && flow <= static_cast<int64_t>(g_launches.size()) ? g_launches[flow - 1].host_ns
                                                                                : system_ns();
  g_activities.push_back({name, type, device, stream, correlation, start_ns, end_ns, host_ns, flow});
}

class NeuronProfilerSession final : public libkineto::IActivityProfilerSession {
 public:
  void start() override {
    std::lock_guard<std::mutex> lock(g_trace_mutex);
    g_activities.clear();
    g_launches.clear();
    g_user_ranges.clear();
    g_tracing = true;
    status_ = libkineto::TraceStatus::RECORDING;
  }
  void stop() override {
    g_tracing = false;
    status_ = libkineto::TraceStatus::PROCESSING;
  }
  void pushCorrelationId(uint64_t id) override { t_correlations.push_back(id); }
  void popCorrelationId() override {
    if (!t_correlations.empty()) t_correlations.pop_back();
  }
  void pushUserCorrelationId(uint64_t id) override {
    std::lock_guard<std::mutex> lock(g_trace_mutex);
    t_user_ranges.emplace_back(id, g_activities.size());
  }
  void popUserCorrelationId() override {
    if (t_user_ranges.empty()) return;
    std::lock_guard<std::mutex> lock(g_trace_mutex);
    auto [id, first] = t_user_ranges.back();
    t_user_ranges.pop_back();
    if (g_activities.size() > first) g_user_ranges.push_back({id, first, g_activities.size()});
  }
  std::vector<std::string> errors() override { return {}; }
  void processTrace(libkineto::ActivityLogger& logger) override {
    processTrace(logger, [](int32_t) -> const libkineto::ITraceActivity* { return nullptr; }, 0, 0);
  }
  void processTrace(libkineto::ActivityLogger& logger, libkineto::getLinkedActivityCallback linked, int64_t,
                    int64_t) override {
    std::lock_guard<std::mutex> lock(g_trace_mutex);
    // per device: (host ns, emulated ns) of its first activity; a time since then is added in integer ns, as a
    // double holds the system clock's ns only to 256 ns
    std::map<c10::DeviceIndex, std::pair<int64_t, double>> origin;
    for (const auto& a : g_activities) origin.try_emplace(a.device, a.host_ns, a.start_ns);
    auto host = [&origin](c10::DeviceIndex device, double emulated_ns) {
      const auto& [host_ns, start_ns] = origin[device];
      return host_ns + static_cast<int64_t>(std::llround(emulated_ns - start_ns));
    };
    int64_t first = g_activities.empty() ? system_ns() : g_activities.front().host_ns;
    span_ = std::make_unique<libkineto::TraceSpan>(first, first, "neuron");
    for (const auto& a : g_activities) {
      libkineto::GenericTraceActivity activity(*span_, a.type, a.name);
      activity.startTime = host(a.device, a.start_ns);
      activity.endTime = std::max(activity.startTime + 1, host(a.device, a.end_ns));
      activity.device = a.device;
      activity.resource = a.stream;
      activity.id = static_cast<int32_t>(a.correlation);
      activity.linked = a.correlation ? linked(static_cast<int32_t>(a.correlation)) : nullptr;
      activity.flow.id = a.flow;
      activity.flow.type = libkineto::kLinkAsyncCpuGpu;
      activity.flow.start = false;
      activity.addMetadataQuoted("emulated start ns", std::to_string(a.start_ns));  // (addMetadata needs fmt,
      activity.addMetadataQuoted("device time ns", std::to_string(a.end_ns - a.start_ns));  // not exported)
      activity.addMetadataQuoted("stream", std::to_string(a.stream));
      activity.log(logger);
    }
    for (const auto& launch : g_launches) {  // on the host thread that queued it, the arrow's start
      libkineto::GenericTraceActivity activity(*span_, libkineto::ActivityType::PRIVATEUSE1_RUNTIME, launch.name);
      activity.startTime = launch.host_ns;
      activity.endTime = launch.host_ns + 1;
      activity.device = libkineto::processId();
      activity.resource = launch.thread;
      activity.threadId = launch.thread;
      activity.id = static_cast<int32_t>(launch.correlation);
      activity.linked = launch.correlation ? linked(static_cast<int32_t>(launch.correlation)) : nullptr;
      activity.flow.id = launch.flow;
      activity.flow.type = libkineto::kLinkAsyncCpuGpu;
      activity.flow.start = true;
      activity.log(logger);
    }
    for (const auto& range : g_user_ranges) {  // a record_function range, on the rows of the launches in it
      const libkineto::ITraceActivity* cpu = linked(static_cast<int32_t>(range.correlation));
      std::map<std::pair<c10::DeviceIndex, int64_t>, std::pair<double, double>> spans;
      for (size_t i = range.first; i < range.last; ++i) {
        const auto& a = g_activities[i];
        auto [it, fresh] = spans.try_emplace({a.device, a.stream}, a.start_ns, a.end_ns);
        if (!fresh) it->second = {std::min(it->second.first, a.start_ns), std::max(it->second.second, a.end_ns)};
      }
      for (const auto& [where, span] : spans) {
        libkineto::GenericTraceActivity activity(*span_, libkineto::ActivityType::GPU_USER_ANNOTATION,
                                                 cpu != nullptr ? cpu->name() : std::string("record_function"));
        activity.startTime = host(where.first, span.first);
        activity.endTime = std::max(activity.startTime + 1, host(where.first, span.second));
        activity.device = where.first;
        activity.resource = where.second;
        activity.id = static_cast<int32_t>(range.correlation);
        activity.linked = cpu;
        activity.log(logger);
      }
    }
    status_ = libkineto::TraceStatus::READY;
  }
  std::unique_ptr<libkineto::DeviceInfo> getDeviceInfo() override {
    return std::make_unique<libkineto::DeviceInfo>(0, 0, "neuron", "neuron (emulated NeuronCore)");
  }
  std::vector<libkineto::ResourceInfo> getResourceInfos() override { return {}; }
  std::unique_ptr<libkineto::CpuTraceBuffer> getTraceBuffer() override { return nullptr; }

 private:
  std::unique_ptr<libkineto::TraceSpan> span_;
};

class NeuronActivityProfiler final : public libkineto::IActivityProfiler {
 public:
  const std::string& name() const override { return name_; }
  const std::set<libkineto::ActivityType>& availableActivities() const override { return activities_; }
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(const std::set<libkineto::ActivityType>& types,
                                                                 const libkineto::Config&) override {
    for (auto type : types) {
      if (activities_.count(type)) return std::make_unique<NeuronProfilerSession>();
    }
    return nullptr;
  }
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(int64_t, int64_t,
                                                                 const std::set<libkineto::ActivityType>& types,
                                                                 const libkineto::Config& config) override {
    return configure(types, config);
  }

 private:
  std::string name_{"neuron"};
  std::set<libkineto::ActivityType> activities_{
      libkineto::ActivityType::CONCURRENT_KERNEL, libkineto::ActivityType::GPU_MEMCPY,
      libkineto::ActivityType::GPU_MEMSET, libkineto::ActivityType::GPU_USER_ANNOTATION,
      libkineto::ActivityType::PRIVATEUSE1_RUNTIME};
};

REGISTER_PRIVATEUSE1_PROFILER(NeuronActivityProfiler);

// ---- metadata kernels ------------------------------------------------------------------------------

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout>, std::optional<c10::Device> device,
                               std::optional<bool>, std::optional<c10::MemoryFormat> memory_format) {
  c10::DeviceGuard guard(device.value_or(c10::Device(kDevice, current_device())));
  return at::detail::empty_generic(size, &g_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout>, std::optional<c10::Device> device, std::optional<bool>) {
  c10::DeviceGuard guard(device.value_or(c10::Device(kDevice, current_device())));
  return at::detail::empty_strided_generic(size, stride, &g_allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      std::optional<int64_t> storage_offset) {
  return at::cpu::as_strided(self, size, stride, storage_offset);
}

const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format) {
  c10::DeviceGuard guard(self.device());
  return at::native::resize_(self, C10_AS_INTARRAYREF_SLOW(size), memory_format);
}

at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  return at::cpu::set_(self, source);
}

at::Tensor& set_source_storage_offset(at::Tensor& self, c10::Storage source, c10::SymInt offset,
                                      c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::cpu::set__symint(self, source, offset, size, stride);
}

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

void record_stream(at::Tensor& self, c10::Stream stream) {
  g_allocator.recordStream(self.storage().data_ptr(), stream);
}

// `module.to("neuron")` keeps tied weights tied, as CUDA does: nn.Module moves a parameter in place
// (`param.data = moved`, the same Parameter object in every module that holds it) only when the two tensors have
// "compatible shallow-copy types", which c10 grants between its own dense backends (CPU, CUDA, ...) but not
// PrivateUse1; without this each module holding a tied weight (an LM head and its embedding) got its own copy,
// and training updated them apart.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](const at::Tensor& t) {
    return t.layout() == c10::kStrided && !t.is_quantized() && (t.is_cpu() || t.device().type() == kDevice);
  };
  return dense(self) && dense(from);
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", has_compatible_shallow_copy_type);
  m.impl("record_stream", record_stream);
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("resize_", resize_);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Storage_storage_offset", set_source_storage_offset);
  m.impl("view", view);
  m.impl("_reshape_alias", reshape_alias);
}

// ---- autocast ----------------------------------------------------------------------------------------

// torch.autocast("neuron"): PyTorch's own op lists and cast policies (the ones CUDA uses), on the
// AutocastPrivateUse1 key; the lower precision is the autocast dtype (bfloat16 by default on neuron).
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {  // ops outside the lists run as they are
  m.fallback(torch::CppFunction::makeFallthrough());
}

namespace autocast_kernels {
using namespace at;  // the op lists name ATen types unqualified
using namespace at::autocast;

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define NEURON_LOWER_PRECISION(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
  AT_FORALL_LOWER_PRECISION_FP(NEURON_LOWER_PRECISION)
#define NEURON_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
  AT_FORALL_FP32(NEURON_FP32)
#define NEURON_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
  AT_FORALL_FP32_SET_OPT_DTYPE(NEURON_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
#define NEURON_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_PROMOTE(NEURON_PROMOTE)
}
}  // namespace autocast_kernels

// ---- what Python sees --------------------------------------------------------------------------------

std::array<PyObject*, 64> g_numpy_dtypes{};  // ScalarType -> numpy dtype of the elements (owned references)

void init(c10::DeviceIndex device_count, py::object reserve, py::object release, py::object synchronize) {
  TORCH_CHECK(device_count >= 1 && device_count <= kMaxDevices, "between 1 and ", kMaxDevices,
              " NeuronCores can be emulated, not ", static_cast<int>(device_count));
  g_device_count = device_count;
  if (g_reserve == nullptr) {  // leaked: they live as long as torch
    g_reserve = new py::object(std::move(reserve));
    g_release = new py::object(std::move(release));
    g_synchronize = new py::object(std::move(synchronize));
  }
  if (g_hooks == nullptr) {
    g_hooks = new NeuronHooks();
    at::RegisterPrivateUse1HooksInterface(g_hooks);
  }
  if (g_profiler_stubs == nullptr) {
    g_profiler_stubs = new NeuronProfilerStubs();
    torch::profiler::impl::registerPrivateUse1Methods(g_profiler_stubs);
  }
}

void set_numpy_dtypes(py::dict numpy_dtypes) {  // torch dtype -> numpy dtype, for `view`
  for (auto item : numpy_dtypes) {
    auto type = static_cast<size_t>(item.first.cast<at::ScalarType>());
    TORCH_CHECK(type < g_numpy_dtypes.size(), "unexpected dtype");
    if (g_numpy_dtypes[type] == nullptr) {
      g_numpy_dtypes[type] = py::reinterpret_borrow<py::object>(item.second).release().ptr();
    }
  }
}

// A numpy view of a `neuron` tensor's elements in its storage's bytes (no copy; keeps the bytes alive).
py::array numpy_view(const at::Tensor& tensor) {
  auto type = static_cast<size_t>(tensor.scalar_type());
  TORCH_CHECK(type < g_numpy_dtypes.size() && g_numpy_dtypes[type] != nullptr, "neuron tensors of dtype ",
              tensor.scalar_type(), " cannot be viewed as numpy arrays");
  auto dtype = py::reinterpret_borrow<py::dtype>(g_numpy_dtypes[type]);
  std::vector<py::ssize_t> shape(tensor.sizes().begin(), tensor.sizes().end());
  const auto& data = tensor.storage().data_ptr();
  if (tensor.numel() == 0 || data.get_deleter() != &free_buffer) return py::array(dtype, shape);
  TORCH_CHECK(tensor.device().type() == kDevice, "not a neuron tensor");
  std::vector<py::ssize_t> strides;
  for (auto stride : tensor.strides()) strides.push_back(stride * dtype.itemsize());
  auto* buffer = static_cast<Buffer*>(data.get_context());
  return py::array(dtype, shape, strides, tensor.data_ptr(), py::handle(buffer->bytes));
}

// A new contiguous `neuron` tensor on `device` and a numpy view of its elements: an eager op's output, made
// without the dispatcher's trip through torch.empty (argument parsing, device guard, dispatch).
std::pair<at::Tensor, py::array> empty_with_view(c10::IntArrayRef sizes, c10::ScalarType dtype,
                                                 c10::DeviceIndex device) {
  check_index(device);
  c10::DeviceGuard guard(c10::Device(kDevice, device));
  at::Tensor tensor = at::detail::empty_generic(sizes, &g_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                dtype, std::nullopt);
  return {tensor, numpy_view(tensor)};
}

// A launch on the current stream of `device`: (its start on the emulated clock, the stream's id, the correlation
// id of the op queueing it for the profiler's trace, or -1 when no trace records).
std::tuple<double, int64_t, int64_t> launch(c10::DeviceIndex device, double duration_ns) {
  std::lock_guard<std::mutex> lock(g_clock_mutex);
  auto stream = t_current_stream[device];
  double& clock = clock_of(device, stream);
  double start = clock;
  clock += duration_ns;
  return {start, stream, current_correlation()};
}

double stream_clock(c10::DeviceIndex device, c10::StreamId stream) {
  std::lock_guard<std::mutex> lock(g_clock_mutex);
  return clock_of(device, stream);
}

}  // namespace neuron

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "neuron device shim: allocator, device guard, hooks and metadata kernels for PrivateUse1";
  m.def("init", &neuron::init, "set the device count, the Python HBM accounting and queue runner; register the hooks");
  m.def("launch", &neuron::launch,
        "queue a program of a duration on the current stream of a device: (start, stream, profiler correlation)");
  m.def("record_launch", &neuron::record_launch,
        "a launch the host queues now, for the profiler's trace: (name, correlation) -> its id");
  m.def("record_activity", &neuron::record_activity,
        "a device activity of the profiler's trace: (name, kind, device, stream, correlation, start, end, launch)");
  m.def("settle", &neuron::settle, "after a device's queued work ran: no stream of it starts earlier");
  m.def("set_numpy_dtypes", &neuron::set_numpy_dtypes, "the numpy dtype of each torch dtype, for view");
  m.def("is_pinned", &neuron::is_pinned, "whether a CPU tensor's bytes are in pinned host memory");
  m.def("view", &neuron::numpy_view, "a numpy view of a neuron tensor's elements");
  m.def("empty_with_view", &neuron::empty_with_view, "a new neuron tensor (sizes, dtype, device) and its numpy view");
  m.def("stream_clock", &neuron::stream_clock, "the emulated clock (ns) of a stream");
  m.def("default_generator", [](c10::DeviceIndex device) { return neuron::default_generator(device); },
        "the default generator of a neuron device");
  m.def("philox_state", &neuron::philox_state,
        "(seed, offset) of a neuron generator for a launch drawing a count of numbers; the offset moves past them");
  m.def("current_device", []() { return static_cast<int>(neuron::current_device()); });
}
