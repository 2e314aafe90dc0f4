# Optional CUDA: TANDEM_CUDA=AUTO builds the GPU executor when a CUDA toolkit with cuBLAS
# is found (default location /usr/local/cuda), ON requires it, OFF skips it.
# TANDEM_CUDA_EMU=ON builds it against the cuemu emulator instead (tests without a GPU;
# the top-level CMakeLists.txt then includes cmake/TandemCudaEmu.cmake); TANDEM_CUDA is
# then ignored.
option(TANDEM_CUDA_EMU "Build the CUDA executor against cuemu (CUDA on the CPU, for tests)" OFF)
set(TANDEM_HAVE_CUDA OFF)
if(TANDEM_CUDA_EMU)
  set(TANDEM_HAVE_CUDA ON)
  message(STATUS "Tandem: CUDA executor ON, emulated by cuemu")
  return()
endif()
if(NOT TANDEM_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    find_package(CUDAToolkit QUIET)
  endif()
  if(CMAKE_CUDA_COMPILER AND CUDAToolkit_FOUND AND TARGET CUDA::cublas)
    set(TANDEM_HAVE_CUDA ON)
  elseif(TANDEM_CUDA STREQUAL "ON")
    message(FATAL_ERROR "TANDEM_CUDA=ON but no CUDA toolkit with cuBLAS was found")
  endif()
endif()
message(STATUS "Tandem: CUDA executor ${TANDEM_HAVE_CUDA}")
