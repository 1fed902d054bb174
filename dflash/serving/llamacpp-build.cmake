# `make llamacpp`'s build settings: unity builds for the heavy libraries only (ggml, llama: ~2x faster on 2 cores);
# the rest compiles file by file (llama.cpp's common/ does not build as one unit). Optimisation follows
# what runs per token: ggml's kernels, the llama library's decode path (context, graph, KV cache,
# batch, sampler, and the model graphs built per call) and the server's decode loop, sampling and
# speculative drafting keep -O3; the llama library's loading, quantising, vocabulary and
# other architectures' caches compile at -O1; what runs once per request or never here (HTTP,
# JSON, argument parsing, templates, multimodal) at -O0. Less build time for the same tokens/s
# (BENCHMARKS.md, "make test").
set(_dflash_hot "^(common|sampling|speculative|ngram-.*|log|server-context|server-queue)\\.cpp$")
set(_dflash_llama_hot "^(llama-context|llama-graph|llama-kv-cache|llama-kv-cache-iswa|llama-batch|llama-sampler|llama-memory|llama-cparams|llama)\\.cpp$")

function(_dflash_optimise t level hot)
  get_property(sources TARGET ${t} PROPERTY SOURCES)
  get_property(source_dir TARGET ${t} PROPERTY SOURCE_DIR)
  foreach(src IN LISTS sources)
    get_filename_component(name "${src}" NAME)
    if(NOT name MATCHES "\\.(c|cc|cpp|cxx)$" OR name MATCHES "${hot}")
      continue()
    endif()
    if(NOT IS_ABSOLUTE "${src}")
      set(src "${source_dir}/${src}")
    endif()
    get_property(skip SOURCE "${src}" DIRECTORY "${source_dir}" PROPERTY SKIP_UNITY_BUILD_INCLUSION)
    get_property(unity TARGET ${t} PROPERTY UNITY_BUILD)
    if(unity AND NOT skip)
      continue()  # inside a unity batch (the llama library's model graphs): left as it is
    endif()
    set_source_files_properties("${src}" DIRECTORY "${source_dir}" PROPERTIES COMPILE_OPTIONS ${level})
  endforeach()
endfunction()

function(_dflash_build_flags dir)
  get_property(targets DIRECTORY "${dir}" PROPERTY BUILDSYSTEM_TARGETS)
  foreach(t IN LISTS targets)
    if(t MATCHES "^(ggml|ggml-base|ggml-cpu)$")
      continue()
    endif()
    get_property(type TARGET ${t} PROPERTY TYPE)
    if(t STREQUAL "llama")
      _dflash_optimise(${t} -O1 "${_dflash_llama_hot}")
      continue()
    endif()
    set_property(TARGET ${t} PROPERTY UNITY_BUILD OFF)
    if(NOT type MATCHES "^(STATIC_LIBRARY|SHARED_LIBRARY|OBJECT_LIBRARY|MODULE_LIBRARY|EXECUTABLE)$")
      continue()
    endif()
    _dflash_optimise(${t} -O0 "${_dflash_hot}")
  endforeach()
  get_property(subdirs DIRECTORY "${dir}" PROPERTY SUBDIRECTORIES)
  foreach(d IN LISTS subdirs)
    _dflash_build_flags("${d}")
  endforeach()
endfunction()
cmake_language(DEFER CALL _dflash_build_flags "${CMAKE_SOURCE_DIR}")
