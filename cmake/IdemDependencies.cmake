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
  if(IDEM_WITH_RABBITMQ)
    list(APPEND IDEM_DEPS_FOR rabbitmq)
  endif()
  if(IDEM_WITH_ASYNC)
    list(APPEND IDEM_DEPS_FOR async)
    if(IDEM_WITH_POSTGRES)
      list(APPEND IDEM_DEPS_FOR async_postgres)
    endif()
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

# rabbitmq-c 0.11 (Debian librabbitmq-dev) installs a CMake config with rabbitmq::rabbitmq; the
# pkg-config file librabbitmq is the fallback. Linked PRIVATE by idem::rabbitmq (a static idem
# library still needs it found by find_package(idem)).
if("rabbitmq" IN_LIST IDEM_DEPS_FOR AND NOT DEFINED IDEM_RABBITMQ_C_TARGET)
  find_package(rabbitmq-c CONFIG QUIET)
  if(TARGET rabbitmq::rabbitmq)
    set(IDEM_RABBITMQ_C_TARGET rabbitmq::rabbitmq)
  else()
    find_package(PkgConfig QUIET)
    if(PkgConfig_FOUND)
      pkg_check_modules(librabbitmq QUIET IMPORTED_TARGET librabbitmq)
    endif()
    if(TARGET PkgConfig::librabbitmq)
      set(IDEM_RABBITMQ_C_TARGET PkgConfig::librabbitmq)
    else()
      message(FATAL_ERROR "idem: rabbitmq-c not found (apt-get install librabbitmq-dev), "
                          "or configure with -DIDEM_WITH_RABBITMQ=OFF")
    endif()
  endif()
endif()

# idem::async: Boost.Asio (headers only: Debian libboost-dev) by default, standalone Asio
# (libasio-dev) with IDEM_ASIO_STANDALONE. idem::async_redis re-uses hiredis above;
# idem::async_postgres needs libpq itself (it drives the socket; libpqxx has no async API).
if(("async" IN_LIST IDEM_DEPS_FOR OR "async_redis" IN_LIST IDEM_DEPS_FOR OR
    "async_postgres" IN_LIST IDEM_DEPS_FOR) AND NOT DEFINED IDEM_ASIO_TARGET)
  if(IDEM_ASIO_STANDALONE)
    find_path(IDEM_ASIO_INCLUDE_DIR asio.hpp)
    if(NOT IDEM_ASIO_INCLUDE_DIR)
      message(FATAL_ERROR "idem: standalone Asio not found (apt-get install libasio-dev), "
                          "or configure with -DIDEM_ASIO_STANDALONE=OFF (Boost.Asio)")
    endif()
    add_library(idem_asio_headers INTERFACE IMPORTED)
    set_target_properties(idem_asio_headers PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${IDEM_ASIO_INCLUDE_DIR}"
      INTERFACE_COMPILE_DEFINITIONS "IDEM_ASIO_STANDALONE")
    set(IDEM_ASIO_TARGET idem_asio_headers)
  else()
    find_package(Boost 1.74 CONFIG QUIET)
    if(NOT TARGET Boost::headers)
      message(FATAL_ERROR "idem: Boost (Asio) not found (apt-get install libboost-dev), "
                          "or configure with -DIDEM_WITH_ASYNC=OFF")
    endif()
    set(IDEM_ASIO_TARGET Boost::headers)
  endif()
endif()
if("async_postgres" IN_LIST IDEM_DEPS_FOR AND NOT TARGET PostgreSQL::PostgreSQL)
  find_package(PostgreSQL QUIET)
  if(NOT TARGET PostgreSQL::PostgreSQL)
    message(FATAL_ERROR "idem: libpq not found (apt-get install libpq-dev), "
                        "or configure with -DIDEM_WITH_ASYNC=OFF")
  endif()
endif()
