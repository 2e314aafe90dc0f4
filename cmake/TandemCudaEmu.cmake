# TANDEM_CUDA_EMU=ON: the CUDA executor built against cuemu (CUDA on the CPU, a test tool in
# ../shared/tools/cuemu, see its README) so CI runs the GPU kernels and host code without a
# GPU. No nvcc: each .cu is rewritten to C++ by cuemu's cu2cpp.py (a build step) and
# compiled with the host compiler; the emulator's runtime (tandem_cuemu) is linked where
# CUDA::cudart would be, under the same name. The emulator is used from the shared folder
# (TANDEM_SHARED, default ../shared beside the source tree), never copied into the project.
# Emulated builds are for tests only: the GPU benchmark is left out.
if(DEFINED ENV{TANDEM_SHARED} AND NOT "$ENV{TANDEM_SHARED}" STREQUAL "")
  set(_tandem_shared_default "$ENV{TANDEM_SHARED}")
else()
  set(_tandem_shared_default "${CMAKE_SOURCE_DIR}/../shared")
endif()
set(TANDEM_CUEMU_DIR "${_tandem_shared_default}/tools/cuemu" CACHE PATH "cuemu (CUDA emulator) folder")
get_filename_component(TANDEM_CUEMU_DIR "${TANDEM_CUEMU_DIR}" ABSOLUTE)
if(NOT EXISTS "${TANDEM_CUEMU_DIR}/tools/cu2cpp.py" OR NOT EXISTS "${TANDEM_CUEMU_DIR}/src/cuemu.cpp")
  message(FATAL_ERROR "TANDEM_CUDA_EMU=ON but cuemu was not found in ${TANDEM_CUEMU_DIR} "
                      "(set TANDEM_SHARED or TANDEM_CUEMU_DIR)")
endif()
find_package(Python3 REQUIRED COMPONENTS Interpreter)
include(GNUInstallDirs)

add_library(tandem_cuemu STATIC "${TANDEM_CUEMU_DIR}/src/cuemu.cpp")
target_include_directories(tandem_cuemu SYSTEM PUBLIC "$<BUILD_INTERFACE:${TANDEM_CUEMU_DIR}/include>")
target_link_libraries(tandem_cuemu PUBLIC Threads::Threads)
add_library(CUDA::cudart ALIAS tandem_cuemu)
# The static C library lists CUDA::cudart among its link dependencies: export the emulator
# with it so install(EXPORT) stays consistent in an emulated build.
install(TARGETS tandem_cuemu EXPORT TandemTargets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})

# tandem_cuemu_rewrite(<out-var> <file.cu>...): the C++ files cu2cpp.py makes of each .cu
# (regenerated when the .cu or the tool changes), for a target compiled with
# tandem_cuemu_device_code().
function(tandem_cuemu_rewrite out_var)
  set(outputs)
  foreach(cu IN LISTS ARGN)
    get_filename_component(name "${cu}" NAME_WE)
    set(cpp "${CMAKE_CURRENT_BINARY_DIR}/cuemu/${name}.cu.cpp")
    add_custom_command(
      OUTPUT "${cpp}"
      COMMAND ${CMAKE_COMMAND} -E make_directory "${CMAKE_CURRENT_BINARY_DIR}/cuemu"
      COMMAND Python3::Interpreter "${TANDEM_CUEMU_DIR}/tools/cu2cpp.py" "${cu}" "${cpp}"
      DEPENDS "${cu}" "${TANDEM_CUEMU_DIR}/tools/cu2cpp.py"
      COMMENT "cu2cpp ${name}.cu"
      VERBATIM)
    list(APPEND outputs "${cpp}")
  endforeach()
  set(${out_var} ${outputs} PARENT_SCOPE)
endfunction()

# Device-code flags: the rewritten .cu files see __CUDA_ARCH__ (sm_90) and cuemu's device
# side; no FMA contraction, as nvcc's --fmad=false of the real build.
function(tandem_cuemu_device_code target)
  target_compile_definitions(${target} PRIVATE __CUDA_ARCH__=900 CUEMU_DEVICE_CODE=1)
  # `#pragma unroll` is nvcc's: the host compiler ignores it.
  target_compile_options(${target} PRIVATE -ffp-contract=off -Wno-unknown-pragmas)
  target_link_libraries(${target} PUBLIC tandem_cuemu)
endfunction()

message(STATUS "Tandem: cuemu from ${TANDEM_CUEMU_DIR}")
