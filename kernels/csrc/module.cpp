// The one Python extension module of the native CPU kernels: each kernels/csrc/*.cpp adds its
// functions (built together by kernels/native.py, so ninja compiles the files in parallel and
// one link makes the module).

#include <torch/extension.h>

void register_moe_cpu(pybind11::module_& m);
void register_linear_cpu(pybind11::module_& m);
void register_paged_attention(pybind11::module_& m);
void register_ops_cpu(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_moe_cpu(m);
  register_linear_cpu(m);
  register_paged_attention(m);
  register_ops_cpu(m);
}
