# SPDX-License-Identifier: MIT
# Finds what idem's targets link. Used by the build and, installed, by idem-config.cmake.
# Each dependency: find_package(CONFIG) first, pkg-config fallback (Debian's hiredis 0.14 and
# libpqxx 6.4 ship pkg-config files only). Requested components come in IDEM_DEPS_FOR.
include(CMakeFindDependencyMacro)

if(NOT DEFINED IDEM_DEPS_FOR)
  set(IDEM_DEPS_FOR core)
  if(IDEM_WITH_SQLITE)
    list(APPEND IDEM_DEPS_FOR sqlite)
  endif()
  if(IDEM_WITH_REDIS)
    list(APPEND IDEM_DEPS_FOR redis)
  endif()
  if(IDEM_WITH_POSTGRES)
    list(APPEND IDEM_DEPS_FOR postgres)
  endif()
  if(IDEM_WITH_FMT)
    list(APPEND IDEM_DEPS_FOR fmt)
  endif()
  if(IDEM_WITH_SPDLOG)
    list(APPEND IDEM_DEPS_FOR spdlog)
  endif()
  if(IDEM_WITH_PROMETHEUS)
    list(APPEND IDEM_DEPS_FOR prometheus)
  endif()
  if(IDEM_WITH_HTTP)
    list(APPEND IDEM_DEPS_FOR http)
  endif()
endif()

set(THREADS_PREFER_PTHREAD_FLAG ON)
find_package(Threads REQUIRED)
find_package(OpenSSL REQUIRED COMPONENTS Crypto)

if("sqlite" IN_LIST IDEM_DEPS_FOR AND NOT TARGET SQLite::SQLite3)
  find_package(SQLite3 QUIET)
  if(NOT SQLite3_FOUND)
    message(FATAL_ERROR "idem: libsqlite3 not found (apt-get install libsqlite3-dev), "
                        "or configure with -DIDEM_WITH_SQLITE=OFF")
  endif()
endif()

if(("redis" IN_LIST IDEM_DEPS_FOR OR "mq" IN_LIST IDEM_DEPS_FOR)
   AND NOT DEFINED IDEM_HIREDIS_TARGET)
  find_package(hiredis CONFIG QUIET)
  if(TARGET hiredis::hiredis)
    set(IDEM_HIREDIS_TARGET hiredis::hiredis)
  else()
    find_package(PkgConfig QUIET)
    if(PkgConfig_FOUND)
      pkg_check_modules(hiredis QUIET IMPORTED_TARGET hiredis)
    endif()
    if(TARGET PkgConfig::hiredis)
      set(IDEM_HIREDIS_TARGET PkgConfig::hiredis)
    else()
      message(FATAL_ERROR "idem: hiredis not found (apt-get install libhiredis-dev), "
                          "or configure with -DIDEM_WITH_REDIS=OFF")
    endif()
  endif()
endif()

if("postgres" IN_LIST IDEM_DEPS_FOR AND NOT DEFINED IDEM_PQXX_TARGET)
  find_package(libpqxx CONFIG QUIET)
  if(TARGET libpqxx::pqxx)
    set(IDEM_PQXX_TARGET libpqxx::pqxx)
  else()
    find_package(PkgConfig QUIET)
    if(PkgConfig_FOUND)
      pkg_check_modules(libpqxx QUIET IMPORTED_TARGET libpqxx)
    endif()
    if(TARGET PkgConfig::libpqxx)
      set(IDEM_PQXX_TARGET PkgConfig::libpqxx)
    else()
      message(FATAL_ERROR "idem: libpqxx not found (apt-get install libpqxx-dev), "
                          "or configure with -DIDEM_WITH_POSTGRES=OFF")
    endif()
  endif()
endif()

if("fmt" IN_LIST IDEM_DEPS_FOR AND NOT TARGET fmt::fmt)
  find_package(fmt CONFIG QUIET)
  if(NOT TARGET fmt::fmt)
    message(FATAL_ERROR "idem: fmt not found (apt-get install libfmt-dev), "
                        "or configure with -DIDEM_WITH_FMT=OFF")
  endif()
endif()

if("spdlog" IN_LIST IDEM_DEPS_FOR AND NOT TARGET spdlog::spdlog)
  find_package(spdlog CONFIG QUIET)
  if(NOT TARGET spdlog::spdlog)
    message(FATAL_ERROR "idem: spdlog not found (apt-get install libspdlog-dev), "
                        "or configure with -DIDEM_WITH_SPDLOG=OFF")
  endif()
endif()

if("prometheus" IN_LIST IDEM_DEPS_FOR AND NOT TARGET prometheus-cpp::core)
  find_package(prometheus-cpp CONFIG QUIET)
  if(NOT TARGET prometheus-cpp::core)
    message(FATAL_ERROR "idem: prometheus-cpp not found (apt-get install prometheus-cpp-dev), "
                        "or configure with -DIDEM_WITH_PROMETHEUS=OFF")
  endif()
endif()

# cpp-httplib: upstream installs httplib::httplib (CMake config); Debian 12 ships a compiled
# libcpp-httplib with a pkg-config file whose Cflags carry the feature macros (OpenSSL, zlib,
# brotli) that change the classes' layout, so they must come from there.
if("http" IN_LIST IDEM_DEPS_FOR AND NOT DEFINED IDEM_HTTPLIB_TARGET)
  find_package(httplib CONFIG QUIET)
  if(TARGET httplib::httplib)
    set(IDEM_HTTPLIB_TARGET httplib::httplib)
  else()
    find_package(PkgConfig QUIET)
    if(PkgConfig_FOUND)
      pkg_check_modules(cpp-httplib QUIET IMPORTED_TARGET cpp-httplib)
    endif()
    if(TARGET PkgConfig::cpp-httplib)
      set(IDEM_HTTPLIB_TARGET PkgConfig::cpp-httplib)
    else()
      message(FATAL_ERROR "idem: cpp-httplib not found (apt-get install libcpp-httplib-dev), "
                          "or configure with -DIDEM_WITH_HTTP=OFF")
    endif()
  endif()
endif()

# nlohmann-json: idem/http/json.hpp (canonical JSON fingerprints) is part of idem::http.
if("http" IN_LIST IDEM_DEPS_FOR AND NOT TARGET nlohmann_json::nlohmann_json)
  find_package(nlohmann_json CONFIG QUIET)
  if(NOT TARGET nlohmann_json::nlohmann_json)
    message(FATAL_ERROR "idem: nlohmann-json not found (apt-get install nlohmann-json3-dev), "
                        "or configure with -DIDEM_WITH_HTTP=OFF")
  endif()
endif()
