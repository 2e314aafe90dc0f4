// Library-wide queries (numeric version, log sink), devices and executors of the C ABI
// (cabi/include/tandem.h).
#include <unistd.h>

#include <fmt/format.h>

#include <limits>
#include <string>
#include <vector>

#include "capi_internal.hpp"
#include "cpu_kernels.hpp"

#if defined(TANDEM_HAVE_CUDA)
#include <cuda_runtime_api.h>
#endif

using namespace tandem;
using namespace tandem::capi;

namespace {

constexpr size_t kDeviceInfoV01 = sizeof(tandem_device_info);
static_assert(offsetof(tandem_device_info, compute_capability) + sizeof(int32_t) == sizeof(tandem_device_info),
              "tandem_device_info has tail padding");
/// The device list, built once (names and ISA strings live as long as the process).
struct DeviceList {
  std::vector<tandem_device_info> devices;
  std::vector<std::string> strings;  ///< backing store of name/isa (reserved: never moves)
};

const DeviceList& device_list() {
  static const DeviceList* list = [] {
    auto* l = new DeviceList;  // never destroyed: the strings are handed out as static storage
    l->strings.reserve(size_t{2} * 65);
    tandem_device_info cpu{};
    cpu.struct_size = sizeof cpu;
    cpu.name = "cpu";
    l->strings.emplace_back(kernels::cpu_isa_name());
    cpu.isa = l->strings.back().c_str();
    cpu.memory_bytes = physical_memory_bytes();
    cpu.kind = TANDEM_DEVICE_CPU;
    const long online = sysconf(_SC_NPROCESSORS_ONLN);
    cpu.n_cores = online > 0 ? int32_t(online) : 1;
    l->devices.push_back(cpu);
#if defined(TANDEM_HAVE_CUDA)
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    for (int i = 0; i < n && i < 64; ++i) {
      cudaDeviceProp prop{};
      if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
      tandem_device_info d{};
      d.struct_size = sizeof d;
      l->strings.emplace_back(prop.name);
      d.name = l->strings.back().c_str();
      l->strings.emplace_back(fmt::format("sm_{}{}", prop.major, prop.minor));
      d.isa = l->strings.back().c_str();
      d.memory_bytes = prop.totalGlobalMem;
      d.kind = TANDEM_DEVICE_CUDA;
      d.device_id = i;
      d.n_cores = prop.multiProcessorCount;
      d.compute_capability = prop.major * 10 + prop.minor;
      l->devices.push_back(d);
    }
#endif
    return l;
  }();
  return *list;
}

}  // namespace

namespace tandem::capi {

void check_executor_params(const tandem_executor_params& e, size_t i, const char* fn) {
  if (e.n_threads < 0 || e.n_threads > kMaxThreads || e.max_running < 1 || e.step_token_budget < 1 ||
      e.prefill_chunk < 1 || e.kv_pages < 0 || e.accelerator < -1 || e.accelerator > 1) {
    fail(TANDEM_E_INVALID_ARG,
         fmt::format("{}: executors[{}]: n_threads {} must be in [0, {}], max_running {}, step_token_budget {} "
                     "and prefill_chunk {} >= 1, kv_pages {} >= 0, accelerator {} in [-1, 1]",
                     fn, i, e.n_threads, kMaxThreads, e.max_running, e.step_token_budget, e.prefill_chunk, e.kv_pages,
                     e.accelerator));
  }
  if (e.device_kind != TANDEM_DEVICE_CPU && e.device_kind != TANDEM_DEVICE_CUDA) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: executors[{}]: device_kind {} is not a tandem_device_kind (0 cpu, "
                                           "1 cuda)",
                                           fn, i, e.device_kind));
  }
  if (e.device_id < 0 || (e.device_kind == TANDEM_DEVICE_CPU && e.device_id != 0)) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: executors[{}]: device_id {} (the CPU is device 0; CUDA ordinals "
                                           "are >= 0)",
                                           fn, i, e.device_id));
  }
  if (e.kv_dtype != TANDEM_KV_F16 && e.kv_dtype != TANDEM_KV_F32 && e.kv_dtype != TANDEM_KV_Q8_0) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: executors[{}]: kv_dtype {} is not a tandem_kv_dtype (0 f32, 1 f16, "
                                           "2 q8_0)",
                                           fn, i, e.kv_dtype));
  }
  if (e.kv_dtype == TANDEM_KV_Q8_0 && e.device_kind == TANDEM_DEVICE_CUDA) {
    fail(TANDEM_E_UNSUPPORTED,
         fmt::format("{}: executors[{}]: a q8_0 KV cache is unsupported on a CUDA executor (use f16)", fn, i));
  }
  if (e.pool != nullptr && (e.n_threads != 0 || e.device_kind != TANDEM_DEVICE_CPU)) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: executors[{}]: a pool is for CPU executors with n_threads 0 (got "
                                           "n_threads {}, device_kind {})",
                                           fn, i, e.n_threads, e.device_kind));
  }
  if (e.kv_file_pages < 0) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: executors[{}]: kv_file_pages {} must be >= 0", fn, i, e.kv_file_pages));
  }
}

std::shared_ptr<ExecutorObj> make_executor(const std::shared_ptr<ModelObj>& model, const tandem_executor_params& p,
                                           [[maybe_unused]] const char* fn) {
  auto obj = std::make_shared<ExecutorObj>();
  obj->model = model;
  obj->device_kind = p.device_kind;
  obj->device_id = p.device_id;
#if !defined(TANDEM_HAVE_CUDA)
  if (p.device_kind == TANDEM_DEVICE_CUDA) {
    fail(TANDEM_E_UNSUPPORTED, fmt::format("{}: a CUDA executor was asked for, but this libtandem was built "
                                           "without CUDA (rebuild with -DTANDEM_CUDA=ON on a machine with the "
                                           "CUDA toolkit)",
                                           fn));
  }
#endif
  ExecutorSpec es;
  es.kind = p.device_kind == TANDEM_DEVICE_CUDA ? ExecutorKind::kGpu : ExecutorKind::kCpu;
  es.device = p.device_id;
  es.n_threads = p.n_threads;
  if (p.pool != nullptr) es.pool = get_pool(p.pool, fn)->pool;
  obj->executor = tandem::make_executor(model->model, es);
  if (const auto* cpu = dynamic_cast<const CpuQ4Executor*>(obj->executor.get())) {
    log_line(TANDEM_LOG_INFO,
             fmt::format("executor: cpu, {} threads, {} kernels", cpu->n_threads(), kernels::cpu_isa_name()));
  } else {
    log_line(TANDEM_LOG_INFO, fmt::format("executor: gpu on CUDA device {}", p.device_id));
  }
  return obj;
}

}  // namespace tandem::capi

extern "C" {

int32_t tandem_version_number(void) {
  return TANDEM_VERSION_NUMBER;
}

tandem_status tandem_log_set(tandem_log_callback callback, void* user_data, int32_t min_level) {
  return set_log(callback, user_data, min_level);
}

tandem_status tandem_pool_create(int32_t n_threads, tandem_pool** out_pool) {
  static constexpr const char* fn = "tandem_pool_create";
  if (out_pool != nullptr) *out_pool = nullptr;
  return guard([&] {
    require(out_pool, fn, "out_pool");
    if (n_threads < 0 || n_threads > kMaxThreads) {
      fail(TANDEM_E_INVALID_ARG, fmt::format("{}: n_threads {} must be in [0, {}]", fn, n_threads, kMaxThreads));
    }
    auto obj = std::make_shared<PoolObj>();
    obj->pool = CpuQ4Executor::make_pool(n_threads);
    log_line(TANDEM_LOG_INFO, fmt::format("pool: {} threads", obj->pool->size()));
    *out_pool = Registry::instance().add_handle<tandem_pool>(Kind::kPool, std::move(obj));
  });
}

tandem_status tandem_pool_free(tandem_pool* pool) {
  return guard([&] {
    if (pool == nullptr) return;
    if (!Registry::instance().remove(reinterpret_cast<uintptr_t>(pool), Kind::kPool)) {
      fail(TANDEM_E_INVALID_HANDLE, fmt::format("tandem_pool_free: pool handle {:#x} is not live (double free?)",
                                                reinterpret_cast<uintptr_t>(pool)));
    }
  });
}

tandem_status tandem_pool_get_threads(const tandem_pool* pool, int32_t* out_n) {
  static constexpr const char* fn = "tandem_pool_get_threads";
  return guard([&] {
    auto p = get_pool(pool, fn);
    require(out_n, fn, "out_n");
    *out_n = p->pool->size();
  });
}

tandem_status tandem_device_info_init(tandem_device_info* info, size_t struct_size) {
  return guard([&] {
    tandem_device_info d{};
    d.struct_size = sizeof d;
    init_struct(info, struct_size, kDeviceInfoV01, d, "tandem_device_info_init", "tandem_device_info");
  });
}

tandem_status tandem_device_count(size_t* out_n) {
  return guard([&] {
    require(out_n, "tandem_device_count", "out_n");
    *out_n = device_list().devices.size();
  });
}

tandem_status tandem_device_get_info(size_t index, tandem_device_info* info) {
  static constexpr const char* fn = "tandem_device_get_info";
  return guard([&] {
    require(info, fn, "info");
    const size_t n = out_struct_size(info, kDeviceInfoV01, fn, "tandem_device_info");
    const auto& devices = device_list().devices;
    if (index >= devices.size()) {
      fail(TANDEM_E_INVALID_ARG,
           fmt::format("{}: index {} is out of range (there are {} devices)", fn, index, devices.size()));
    }
    write_struct(info, devices[index], n);
  });
}

tandem_status tandem_executor_create(const tandem_model* model, const tandem_executor_params* params,
                                     tandem_executor** out_executor) {
  static constexpr const char* fn = "tandem_executor_create";
  if (out_executor != nullptr) *out_executor = nullptr;
  return guard([&] {
    require(out_executor, fn, "out_executor");
    auto m = get_model(model, fn);
    tandem_executor_params p{};
    if (tandem_executor_params_init(&p, sizeof p) != TANDEM_OK) fail(TANDEM_E_INTERNAL, last_error());
    if (params != nullptr)
      read_struct(params, offsetof(tandem_executor_params, device_kind), p, fn, "tandem_executor_params");
    check_executor_params(p, 0, fn);
    auto obj = make_executor(m, p, fn);
    *out_executor = Registry::instance().add_handle<tandem_executor>(Kind::kExecutor, std::move(obj));
  });
}

tandem_status tandem_executor_free(tandem_executor* executor) {
  return guard([&] {
    if (executor == nullptr) return;
    if (!Registry::instance().remove(reinterpret_cast<uintptr_t>(executor), Kind::kExecutor)) {
      fail(TANDEM_E_INVALID_HANDLE, fmt::format("tandem_executor_free: executor handle {:#x} is not live (double "
                                                "free?)",
                                                reinterpret_cast<uintptr_t>(executor)));
    }
  });
}

tandem_status tandem_executor_get_device(const tandem_executor* executor, tandem_device_info* info) {
  static constexpr const char* fn = "tandem_executor_get_device";
  return guard([&] {
    auto e = get_executor(executor, fn);
    require(info, fn, "info");
    const size_t n = out_struct_size(info, kDeviceInfoV01, fn, "tandem_device_info");
    tandem_device_info out{};
    const auto& devices = device_list().devices;
    for (const auto& d : devices) {
      if (d.kind == e->device_kind && d.device_id == e->device_id) out = d;
    }
    out.struct_size = sizeof out;
    if (e->device_kind == TANDEM_DEVICE_CPU) {
      out.n_cores = static_cast<const CpuQ4Executor&>(*e->executor).n_threads();
    }
    write_struct(info, out, n);
  });
}

}  // extern "C"
