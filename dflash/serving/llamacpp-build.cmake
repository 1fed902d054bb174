# `make llamacpp`'s build settings. Unity builds where sources add one variant each: ggml's base, the llama
# library (its model graphs), common's chat parsers and Jinja engine, mtmd's model graphs; the rest
# compiles file by file (common/ and the server do not build as one unit). Optimisation follows
# what runs per token: ggml's kernels, the llama library's decode path (context, graph, KV cache,
# batch, sampler, and the model graphs built per call) and the server's decode loop, sampling and
# speculative drafting keep -O3; the llama library's loading, quantising, vocabulary and
# other architectures' caches compile at -O1; what runs once per request or never here (HTTP,
# JSON, argument parsing, templates, multimodal) at -O0. Less build time for the same tokens/s
# (BENCHMARKS.md, "llama.cpp").
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
      continue()  # inside a unity batch: the target's level
    endif()
    set_source_files_properties("${src}" DIRECTORY "${source_dir}" PROPERTIES COMPILE_OPTIONS ${level})
  endforeach()
endfunction()

# A target holding one of those families (by folder) builds them as unity batches at -O0 (the
# target's level; its per-token files are set back to -O3); its other sources build alone.
set(_dflash_families "/(common/parsers|common/jinja|tools/mtmd/models)/[^/]+$")

function(_dflash_unity_families t)
  get_property(sources TARGET ${t} PROPERTY SOURCES)
  get_property(source_dir TARGET ${t} PROPERTY SOURCE_DIR)
  set(batched OFF)
  foreach(src IN LISTS sources)
    if(NOT src MATCHES "\\.(c|cc|cpp|cxx)$")
      continue()
    endif()
    if(NOT IS_ABSOLUTE "${src}")
      set(src "${source_dir}/${src}")
    endif()
    get_filename_component(name "${src}" NAME)
    if(src MATCHES "${_dflash_families}")
      set(batched ON)
    elseif(name MATCHES "${_dflash_hot}")
      set_source_files_properties("${src}" DIRECTORY "${source_dir}" PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON COMPILE_OPTIONS -O3)
    else()
      set_source_files_properties("${src}" DIRECTORY "${source_dir}" PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
    endif()
  endforeach()
  set_property(TARGET ${t} PROPERTY UNITY_BUILD ${batched})
  if(batched)
    target_compile_options(${t} PRIVATE -O0)
  endif()
endfunction()

function(_dflash_build_flags dir)
  get_property(targets DIRECTORY "${dir}" PROPERTY BUILDSYSTEM_TARGETS)
  foreach(t IN LISTS targets)
    if(t MATCHES "^ggml-cpu(-.+)?$")  # and its variants (GGML_CPU_ALL_VARIANTS)
      # each file alone: its sources include ggml-common.h under different declarations (C-style
      # blocks, C++ aggregates), and on a CPU with AMX (Sapphire Rapids) amx/mmq.cpp compiles in and
      # fails when a batch holds it after repack.cpp
      set_property(TARGET ${t} PROPERTY UNITY_BUILD OFF)
      continue()
    endif()
    if(t MATCHES "^(ggml|ggml-base)$")
      continue()
    endif()
    get_property(type TARGET ${t} PROPERTY TYPE)
    if(t STREQUAL "llama")
      _dflash_optimise(${t} -O1 "${_dflash_llama_hot}")
      continue()
    endif()
    if(NOT type MATCHES "^(STATIC_LIBRARY|SHARED_LIBRARY|OBJECT_LIBRARY|MODULE_LIBRARY|EXECUTABLE)$")
      set_property(TARGET ${t} PROPERTY UNITY_BUILD OFF)
      continue()
    endif()
    _dflash_unity_families(${t})
    _dflash_optimise(${t} -O0 "${_dflash_hot}")
  endforeach()
  get_property(subdirs DIRECTORY "${dir}" PROPERTY SUBDIRECTORIES)
  foreach(d IN LISTS subdirs)
    _dflash_build_flags("${d}")
  endforeach()
endfunction()
cmake_language(DEFER CALL _dflash_build_flags "${CMAKE_SOURCE_DIR}")
