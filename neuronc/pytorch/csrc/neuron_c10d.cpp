// The "neuron" backend of torch.distributed as PyTorch expects a backend: a c10d::Backend.
//
// PyTorch registers a backend per device type on a ProcessGroup (ProcessGroup::setBackend), takes the group's
// name from it, and routes every collective of a tensor's device (the c10d ops' PrivateUse1 kernels, the
// functional collectives of DTensor, FSDP2 and compiled graphs, DDP's reducer) to it. Python cannot subclass
// c10d::Backend, so this one forwards each collective to a Python object (neuronc.pytorch.distributed's
// NeuronCollectives) with the arguments as given, and returns the Work it returns.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

namespace py = pybind11;

namespace neuron {

// A Work made in Python (a subclass of torch.distributed.Work) lives as long as C++ holds it: the Python object
// is kept with it, as PyTorch's PyProcessGroup does.
class HeldWork final : public c10d::Work {
 public:
  explicit HeldWork(py::object work) : work_(work.cast<c10::intrusive_ptr<c10d::Work>>()), object_(std::move(work)) {}
  ~HeldWork() override {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      object_ = py::object();
    } else {
      object_.release();
    }
  }
  bool isCompleted() override { return work_->isCompleted(); }
  bool isSuccess() const override { return work_->isSuccess(); }
  std::exception_ptr exception() const override { return work_->exception(); }
  std::vector<at::Tensor> result() override { return work_->result(); }
  void synchronize() override { work_->synchronize(); }
  bool wait(std::chrono::milliseconds timeout) override { return work_->wait(timeout); }
  void abort() override { work_->abort(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return work_->getFuture(); }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  py::object object_;
};

class NeuronBackend final : public c10d::Backend {
 public:
  NeuronBackend(py::object collectives, int rank, int size, std::chrono::milliseconds timeout)
      : Backend(rank, size),
        collectives_(new py::object(std::move(collectives))),
        options_(c10::make_intrusive<Options>("neuron", timeout)) {}

  ~NeuronBackend() override {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      delete collectives_;
    }  // else leaked: the interpreter is gone
  }

  const std::string getBackendName() const override { return "neuron"; }
  c10::intrusive_ptr<Options> getBackendOptions() override { return options_; }
  void setTimeout(std::chrono::milliseconds timeout) override { options_->timeout = timeout; }
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return sequence_; }
  void setGroupUid(const std::string& uid) override {
    Backend::setGroupUid(uid);
    py::gil_scoped_acquire gil;
    collectives_->attr("group_name") = uid;
  }

  using Tensors = std::vector<at::Tensor>;
  using TensorLists = std::vector<std::vector<at::Tensor>>;
  using WorkPtr = c10::intrusive_ptr<c10d::Work>;

  WorkPtr broadcast(Tensors& tensors, const c10d::BroadcastOptions& opts) override {
    return call("broadcast", tensors, opts);
  }
  WorkPtr allreduce(Tensors& tensors, const c10d::AllreduceOptions& opts) override {
    return call("allreduce", tensors, opts);
  }
  WorkPtr allreduce_coalesced(Tensors& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    return call("allreduce_coalesced", tensors, opts);
  }
  WorkPtr reduce(Tensors& tensors, const c10d::ReduceOptions& opts) override {
    return call("reduce", tensors, opts);
  }
  WorkPtr allgather(TensorLists& outputs, Tensors& inputs, const c10d::AllgatherOptions& opts) override {
    return call("allgather", outputs, inputs, opts);
  }
  WorkPtr _allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) override {
    return call("all_gather_single", output, input, opts);
  }
  WorkPtr allgather_coalesced(TensorLists& outputs, Tensors& inputs, const c10d::AllgatherOptions& opts) override {
    return call("allgather_coalesced", outputs, inputs, opts);
  }
  WorkPtr allgather_into_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                          const c10d::AllgatherOptions& opts) override {
    return call("allgather_into_tensor_coalesced", outputs, inputs, opts);
  }
  WorkPtr gather(TensorLists& outputs, Tensors& inputs, const c10d::GatherOptions& opts) override {
    return call("gather", outputs, inputs, opts);
  }
  WorkPtr scatter(Tensors& outputs, TensorLists& inputs, const c10d::ScatterOptions& opts) override {
    return call("scatter", outputs, inputs, opts);
  }
  WorkPtr reduce_scatter(Tensors& outputs, TensorLists& inputs, const c10d::ReduceScatterOptions& opts) override {
    return call("reduce_scatter", outputs, inputs, opts);
  }
  WorkPtr _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                               const c10d::ReduceScatterOptions& opts) override {
    return call("reduce_scatter_single", output, input, opts);
  }
  WorkPtr reduce_scatter_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                          const c10d::ReduceScatterOptions& opts) override {
    return call("reduce_scatter_tensor_coalesced", outputs, inputs, opts);
  }
  WorkPtr alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
                        std::vector<int64_t>& input_splits, const c10d::AllToAllOptions& opts) override {
    return call("all_to_all_single", output, input, output_splits, input_splits, opts);
  }
  WorkPtr alltoall(Tensors& outputs, Tensors& inputs, const c10d::AllToAllOptions& opts) override {
    return call("alltoall", outputs, inputs, opts);
  }
  WorkPtr send(Tensors& tensors, int dst, int tag) override { return call("send", tensors, dst, tag); }
  WorkPtr recv(Tensors& tensors, int src, int tag) override { return call("recv", tensors, src, tag); }
  WorkPtr recvAnysource(Tensors& tensors, int tag) override { return call("recv_anysource", tensors, tag); }
  WorkPtr barrier(const c10d::BarrierOptions& opts) override { return call("barrier", opts); }

 private:
  // `name`(*args) of the Python collectives; a Python exception goes back to the caller as itself.
  template <typename... Args>
  WorkPtr call(const char* name, Args&... args) {
    py::gil_scoped_acquire gil;
    ++sequence_;
    py::object work = collectives_->attr(name)(args...);
    return c10::make_intrusive<HeldWork>(std::move(work));
  }

  py::object* collectives_;
  c10::intrusive_ptr<Options> options_;
  uint64_t sequence_ = 0;
};

c10::intrusive_ptr<c10d::Backend> make_backend(py::object collectives, int rank, int size, double timeout_s) {
  auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  return c10::make_intrusive<NeuronBackend>(std::move(collectives), rank, size, timeout);
}

}  // namespace neuron

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "the c10d Backend of the neuron device: collectives forwarded to neuronc.pytorch.distributed";
  m.def("make_backend", &neuron::make_backend, "a c10d Backend forwarding to a Python object (its collectives)",
        py::arg("collectives"), py::arg("rank"), py::arg("size"), py::arg("timeout_s"));
}
