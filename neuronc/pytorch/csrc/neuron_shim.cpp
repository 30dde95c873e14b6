// The C++ half of the `neuron` device: what PyTorch only accepts from C++.
//
// * an allocator (c10::DeviceAllocator) whose bytes come from the emulated NeuronCore's HBM: it asks
//   the Python runtime (neuronc.pytorch.device_memory) for a buffer and keeps it alive until PyTorch frees it;
// * a DeviceGuardImplInterface: current device, streams and events over an emulated per-stream clock
//   (each launched program advances its stream's clock by its estimated device time);
// * PrivateUse1HooksInterface, so torch.accelerator sees the device;
// * the kernels that only touch tensor metadata (empty, views, resize, set_), which must alias storage.
//
// Every op that computes is in Python (neuronc/pytorch/eager.py).
#include <ATen/EmptyTensor.h>
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
#include <torch/extension.h>

#include <array>
#include <map>
#include <mutex>

namespace py = pybind11;

namespace neuron {

constexpr c10::DeviceType kDevice = c10::DeviceType::PrivateUse1;
constexpr int kMaxDevices = 64;

c10::DeviceIndex g_device_count = 1;
thread_local c10::DeviceIndex t_current_device = 0;

c10::DeviceIndex current_device() { return t_current_device; }

void check_index(c10::DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < g_device_count, "neuron:", static_cast<int>(index),
              " does not exist: there are ", static_cast<int>(g_device_count),
              " emulated NeuronCores (set NEURON_RT_VISIBLE_CORES to change how many)");
}

// ---- memory -------------------------------------------------------------------------------------

py::object* g_allocate = nullptr;  // Python: (device index, nbytes) -> (data pointer, owner object)

struct Buffer {
  PyObject* owner;  // keeps the runtime's bytes alive; dropping it frees them on the NeuronCore
  c10::DeviceIndex device;
  size_t nbytes;
};

std::mutex g_stats_mutex;
std::array<c10::CachingDeviceAllocator::DeviceStats, kMaxDevices> g_stats;

void update_stats(c10::DeviceIndex device, size_t nbytes, bool allocated) {
  std::lock_guard<std::mutex> lock(g_stats_mutex);
  auto& stats = g_stats[device];
  auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  for (auto* stat : {&stats.allocated_bytes[agg], &stats.reserved_bytes[agg], &stats.active_bytes[agg],
                     &stats.requested_bytes[agg]}) {
    allocated ? stat->increase(nbytes) : stat->decrease(nbytes);
  }
  for (auto* stat : {&stats.allocation[agg], &stats.segment[agg], &stats.active[agg]}) {
    allocated ? stat->increase(1) : stat->decrease(1);
  }
}

void free_buffer(void* context) {
  auto* buffer = static_cast<Buffer*>(context);
  update_stats(buffer->device, buffer->nbytes, false);
  if (Py_IsInitialized()) {
    py::gil_scoped_acquire gil;
    Py_DECREF(buffer->owner);
  }
  delete buffer;
}

struct NeuronAllocator final : public c10::DeviceAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    c10::DeviceIndex device = current_device();
    if (nbytes == 0) {
      return {nullptr, nullptr, &c10::detail::deleteNothing, c10::Device(kDevice, device)};
    }
    TORCH_CHECK(g_allocate != nullptr, "the neuron device is not initialised (import neuronc.pytorch.device)");
    py::gil_scoped_acquire gil;
    py::tuple result = (*g_allocate)(device, nbytes);  // raises DeviceOutOfMemoryError through pybind
    auto* data = reinterpret_cast<void*>(result[0].cast<uintptr_t>());
    PyObject* owner = result[1].ptr();
    Py_INCREF(owner);
    update_stats(device, nbytes, true);
    return {data, new Buffer{owner, device, nbytes}, &free_buffer, c10::Device(kDevice, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const final { default_copy_data(dest, src, count); }

  bool initialized() override { return g_allocate != nullptr; }
  void emptyCache(c10::MempoolId_t) override {}  // nothing is cached: freed bytes go back to the core at once
  void recordStream(const c10::DataPtr&, c10::Stream) override {}
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

// Work on a stream runs in order: each launch starts at its stream's clock and moves it on by the
// program's estimated device time. Execution itself is synchronous (the numerics are done when the
// launch returns); the clocks are what the device would have done, so events read them.
std::mutex g_clock_mutex;
std::map<std::pair<c10::DeviceIndex, c10::StreamId>, double> g_clock_ns;
std::atomic<c10::StreamId> g_next_stream{1};
thread_local std::array<c10::StreamId, kMaxDevices> t_current_stream{};

double& clock_of(c10::DeviceIndex device, c10::StreamId stream) { return g_clock_ns[{device, stream}]; }

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
  bool queryEvent(void*) const override { return true; }  // synchronous execution: recorded work is done
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<NeuronEvent*>(event);
  }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override {
    TORCH_CHECK(start && end, "both events must be recorded before elapsed_time");
    auto* a = static_cast<NeuronEvent*>(start);
    auto* b = static_cast<NeuronEvent*>(end);
    TORCH_CHECK(a->recorded && b->recorded, "both events must be recorded before elapsed_time");
    return (b->time_ns - a->time_ns) / 1e6;  // milliseconds, as CUDA
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, NeuronGuardImpl);

struct NeuronHooks final : public at::PrivateUse1HooksInterface {
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
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    c10::DeviceGuard guard(storage.device());
    at::native::resize_bytes_cpu(storage.unsafeGetStorageImpl(), newsize);
  }
};

NeuronHooks* g_hooks = nullptr;

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

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("resize_", resize_);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Storage_storage_offset", set_source_storage_offset);
  m.impl("view", view);
  m.impl("_reshape_alias", reshape_alias);
}

// ---- what Python sees --------------------------------------------------------------------------------

void init(c10::DeviceIndex device_count, py::object allocate) {
  TORCH_CHECK(device_count >= 1 && device_count <= kMaxDevices, "between 1 and ", kMaxDevices,
              " NeuronCores can be emulated, not ", static_cast<int>(device_count));
  g_device_count = device_count;
  if (g_allocate == nullptr) g_allocate = new py::object(std::move(allocate));  // leaked: lives as long as torch
  if (g_hooks == nullptr) {
    g_hooks = new NeuronHooks();
    at::RegisterPrivateUse1HooksInterface(g_hooks);
  }
}

// Launch bookkeeping: a program of `duration_ns` runs on the current stream of `device`.
std::pair<double, double> launch(c10::DeviceIndex device, double duration_ns) {
  std::lock_guard<std::mutex> lock(g_clock_mutex);
  double& clock = clock_of(device, t_current_stream[device]);
  double start = clock;
  clock += duration_ns;
  return {start, clock};
}

double stream_clock(c10::DeviceIndex device, c10::StreamId stream) {
  std::lock_guard<std::mutex> lock(g_clock_mutex);
  return clock_of(device, stream);
}

}  // namespace neuron

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "neuron device shim: allocator, device guard, hooks and metadata kernels for PrivateUse1";
  m.def("init", &neuron::init, "set the device count and the Python allocator; register the hooks");
  m.def("launch", &neuron::launch, "advance the current stream of a device by a program's duration");
  m.def("stream_clock", &neuron::stream_clock, "the emulated clock (ns) of a stream");
  m.def("current_device", []() { return static_cast<int>(neuron::current_device()); });
}
