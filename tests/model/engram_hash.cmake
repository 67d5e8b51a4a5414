# Engram n-gram hash tests; included from tests/model/CMakeLists.txt with
#   include(${CMAKE_CURRENT_SOURCE_DIR}/engram_hash.cmake)
uf_add_test(test_engram_hash
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_engram_hash.cpp
  DEPS uf_model nlohmann_json::nlohmann_json
  LABELS unit)
