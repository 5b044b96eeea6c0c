// The step driver: the thin C++ layer under the Python runtime.
//
// One call launches one engine step: stage its inputs (host -> device), run the step (replay a
// captured CUDA graph, or call a Python function on the eager backend), then copy its outputs
// device -> pinned host memory on a copy stream, behind an event. Python gets a ticket back
// at once and later waits on it with the GIL released, so the next step can be launched (and
// the asyncio side can run) while the device works. Scheduling policy stays in Python.
//
// Ordering on CUDA: inputs are copied on the compute stream, so they are ordered with the
// step; the copy stream waits for the step's event before reading its outputs; and the next
// step waits (on the device, not the host) until the last copy-out finished, because it
// rewrites the same static output buffers.
//
// Built CPU-only where there is no CUDA (TTSBUILD_WITH_CUDA undefined): then every step is a
// Python function and every ticket is complete when launch() returns.

#include <torch/extension.h>

#include <memory>
#include <unordered_map>
#include <vector>

#ifdef TTSBUILD_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace py = pybind11;

namespace {

void check_pairs(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst,
                 const char* what) {
  TORCH_CHECK(src.size() == dst.size(), what, ": ", src.size(), " sources but ", dst.size(),
              " destinations");
  for (size_t i = 0; i < src.size(); ++i) {
    TORCH_CHECK(src[i].sizes() == dst[i].sizes(), what, " copy ", i, ": shape ", src[i].sizes(),
                " -> ", dst[i].sizes());
  }
}

void copy_all(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst,
              bool non_blocking) {
  for (size_t i = 0; i < src.size(); ++i) {
    // copy_ on a const Tensor handle is fine: the handle is const, the storage is not.
    const_cast<at::Tensor&>(dst[i]).copy_(src[i], non_blocking);
  }
}

}  // namespace

class StepDriver {
 public:
  explicit StepDriver(bool cuda) : cuda_(cuda) {
#ifdef TTSBUILD_WITH_CUDA
    if (cuda_) {
      copy_stream_ = std::make_unique<c10::cuda::CUDAStream>(
          c10::cuda::getStreamFromPool(/*isHighPriority=*/true));
    }
#else
    TORCH_CHECK(!cuda_, "ttsbuild's step driver was built without CUDA support");
#endif
  }

  bool cuda() const { return cuda_; }

  // step: a torch.cuda.CUDAGraph (CUDA) or a Python callable (either).
  int64_t launch(py::object step, const std::vector<at::Tensor>& h2d_src,
                 const std::vector<at::Tensor>& h2d_dst, const std::vector<at::Tensor>& d2h_src,
                 const std::vector<at::Tensor>& d2h_dst) {
    check_pairs(h2d_src, h2d_dst, "input");
    check_pairs(d2h_src, d2h_dst, "output");
    const int64_t ticket = next_ticket_++;
#ifdef TTSBUILD_WITH_CUDA
    if (cuda_) {
      at::cuda::CUDAGraph* graph = nullptr;
      try {
        graph = &py::cast<at::cuda::CUDAGraph&>(step);
      } catch (const py::cast_error&) {
        graph = nullptr;  // a Python function: run it with the GIL held
      }
      auto compute = c10::cuda::getCurrentCUDAStream();
      auto done = std::make_shared<at::cuda::CUDAEvent>();
      {
        py::gil_scoped_release no_gil;
        copy_all(h2d_src, h2d_dst, /*non_blocking=*/true);
        if (last_copy_out_) last_copy_out_->block(compute);
        if (graph != nullptr) graph->replay();
      }
      if (graph == nullptr) step();
      {
        py::gil_scoped_release no_gil;
        at::cuda::CUDAEvent step_done;
        step_done.record(compute);
        step_done.block(*copy_stream_);
        {
          c10::cuda::CUDAStreamGuard guard(*copy_stream_);
          copy_all(d2h_src, d2h_dst, /*non_blocking=*/true);
        }
        done->record(*copy_stream_);
      }
      last_copy_out_ = done;
      pending_[ticket] = done;
      return ticket;
    }
#endif
    copy_all(h2d_src, h2d_dst, /*non_blocking=*/false);
    step();
    copy_all(d2h_src, d2h_dst, /*non_blocking=*/false);
    return ticket;
  }

  // True once the ticket's outputs are in host memory (never blocks).
  bool ready(int64_t ticket) {
#ifdef TTSBUILD_WITH_CUDA
    auto it = pending_.find(ticket);
    if (it != pending_.end()) return it->second->query();
#endif
    TORCH_CHECK(ticket < next_ticket_, "unknown ticket ", ticket);
    return true;
  }

  // Blocks until the ticket's outputs are in host memory, without holding the GIL.
  void wait(int64_t ticket) {
    TORCH_CHECK(ticket >= 0 && ticket < next_ticket_, "unknown ticket ", ticket);
#ifdef TTSBUILD_WITH_CUDA
    auto it = pending_.find(ticket);
    if (it == pending_.end()) return;
    auto event = it->second;
    pending_.erase(it);
    py::gil_scoped_release no_gil;
    event->synchronize();
#endif
  }

  int64_t in_flight() const {
#ifdef TTSBUILD_WITH_CUDA
    return static_cast<int64_t>(pending_.size());
#else
    return 0;
#endif
  }

 private:
  bool cuda_;
  int64_t next_ticket_ = 0;
#ifdef TTSBUILD_WITH_CUDA
  std::unique_ptr<c10::cuda::CUDAStream> copy_stream_;
  std::shared_ptr<at::cuda::CUDAEvent> last_copy_out_;
  std::unordered_map<int64_t, std::shared_ptr<at::cuda::CUDAEvent>> pending_;
#endif
};

bool built_with_cuda() {
#ifdef TTSBUILD_WITH_CUDA
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ttsbuild's step driver: launch a step, copy its outputs out behind an event.";
  m.def("built_with_cuda", &built_with_cuda);
  py::class_<StepDriver>(m, "StepDriver")
      .def(py::init<bool>(), py::arg("cuda"))
      .def_property_readonly("cuda", &StepDriver::cuda)
      .def("launch", &StepDriver::launch, py::arg("step"), py::arg("h2d_src"),
           py::arg("h2d_dst"), py::arg("d2h_src"), py::arg("d2h_dst"))
      .def("ready", &StepDriver::ready, py::arg("ticket"))
      .def("wait", &StepDriver::wait, py::arg("ticket"))
      .def_property_readonly("in_flight", &StepDriver::in_flight);
}
