# SPDX-License-Identifier: MIT
# The components of the idem package, and the third-party libraries they link. The one list
# both idem's build (finding dependencies, install rules, pkg-config files, .deb packages) and
# the installed idemConfig.cmake read: `find_package(idem CONFIG REQUIRED COMPONENTS sqlite)`
# looks up what `sqlite` needs (SQLite, and the core's OpenSSL and Threads), nothing else.
# The functions are in IdemPackage.cmake.
#
# How to add a component (example: `mysql`, target idem_mysql, linking MariaDB Connector/C):
#   1. Describe each new third-party library once, below, with idem_dependency():
#        idem_dependency(mariadb FIND "PKG_CONFIG libmariadb"
#                        PKG_CONFIG libmariadb DEB libmariadb-dev)
#      Finding it sets IDEM_MARIADB_TARGET (here PkgConfig::libmariadb).
#   2. Declare the component right after it:
#        idem_component(mysql OPTION IDEM_WITH_MYSQL TARGETS idem_mysql COMPONENTS core
#                       PRIVATE_DEPENDS mariadb HEADERS idem/mysql
#                       SUMMARY "MySQL / MariaDB durable store")
#      DEPENDS for what the component's targets link PUBLIC or INTERFACE (a consumer always
#      needs it), PRIVATE_DEPENDS for what they link PRIVATE (a static build's consumer needs
#      it to link). COMPONENTS for other idem components it links (core at least).
#   3. In CMakeLists.txt, add `option(IDEM_WITH_MYSQL ...)` and the target as the other
#      adapters are: add_library(idem_mysql ...), add_library(idem::mysql ALIAS idem_mysql),
#      EXPORT_NAME mysql, POSITION_INDEPENDENT_CODE ON, linked to ${IDEM_MARIADB_TARGET}, and
#      `IDEM_EXPORT` on its public classes (include/idem/export.hpp).
#   4. Add tests/package/mysql.cpp: a consumer of the installed component (scripts/test.sh
#      builds it with every dependency the component does not need made unfindable).
# That is all: the build finds mariadb when IDEM_WITH_MYSQL is ON (and stops with "apt-get
# install libmariadb-dev, or -DIDEM_WITH_MYSQL=OFF" when missing); the install writes
# idem-mysql-targets.cmake, lib/pkgconfig/idem-mysql.pc (Requires: idem-core, libmariadb) and
# the headers; `cpack -G DEB` makes idem-mysql_<version>_<arch>.deb (Depends: idem-core,
# libmariadb-dev); find_package(idem COMPONENTS mysql) finds libmariadb and loads idem::mysql.
include_guard(GLOBAL)
include(${CMAKE_CURRENT_LIST_DIR}/IdemPackage.cmake)

# --- third-party libraries ---------------------------------------------------------------------
idem_dependency(openssl FIND "MODULE OpenSSL OpenSSL::Crypto Crypto"
                PKG_CONFIG libcrypto DEB libssl-dev)
idem_dependency(libssl FIND "MODULE OpenSSL OpenSSL::SSL SSL" PKG_CONFIG libssl DEB libssl-dev)
idem_dependency(threads FIND "MODULE Threads Threads::Threads")
idem_dependency(sqlite3 FIND "MODULE SQLite3 SQLite::SQLite3"
                PKG_CONFIG sqlite3 DEB libsqlite3-dev)
# Debian 12's hiredis 0.14 and libpqxx 6.4 ship pkg-config files only (hiredis' CMake package
# has no imported target); newer releases ship CMake packages, tried first.
idem_dependency(hiredis FIND "CONFIG hiredis hiredis::hiredis" "PKG_CONFIG hiredis"
                PKG_CONFIG hiredis DEB libhiredis-dev)
idem_dependency(pqxx FIND "CONFIG libpqxx libpqxx::pqxx" "PKG_CONFIG libpqxx"
                PKG_CONFIG libpqxx DEB libpqxx-dev)
idem_dependency(fmt FIND "CONFIG fmt fmt::fmt" PKG_CONFIG fmt DEB libfmt-dev)
idem_dependency(spdlog FIND "CONFIG spdlog spdlog::spdlog" PKG_CONFIG spdlog DEB libspdlog-dev)
idem_dependency(prometheus FIND "CONFIG prometheus-cpp prometheus-cpp::core"
                PKG_CONFIG prometheus-cpp-core DEB prometheus-cpp-dev)
# cpp-httplib: upstream installs httplib::httplib (CMake config); Debian 12 ships a compiled
# libcpp-httplib with a pkg-config file whose Cflags carry the feature macros (OpenSSL, zlib,
# brotli) that change the classes' layout, so they must come from there.
idem_dependency(httplib FIND "CONFIG httplib httplib::httplib" "PKG_CONFIG cpp-httplib"
                PKG_CONFIG cpp-httplib DEB libcpp-httplib-dev)
# nlohmann/json: idem::http's canonical-JSON fingerprints (include/idem/http/json.hpp).
idem_dependency(nlohmann_json FIND "CONFIG nlohmann_json nlohmann_json::nlohmann_json"
                PKG_CONFIG nlohmann_json DEB nlohmann-json3-dev)

# --- components ---------------------------------------------------------------------------------
idem_component(core TARGETS idem_core DEPENDS openssl threads HEADERS idem
               SUMMARY "idempotency guard, keys, errors, memory store (header-only)")
idem_component(sqlite OPTION IDEM_WITH_SQLITE TARGETS idem_sqlite COMPONENTS core
               PRIVATE_DEPENDS sqlite3 HEADERS idem/sqlite
               SUMMARY "SQLite durable store")
idem_component(redis OPTION IDEM_WITH_REDIS TARGETS idem_redis COMPONENTS core
               PRIVATE_DEPENDS hiredis libssl HEADERS idem/redis
               SUMMARY "Redis fast store (hiredis)")
idem_component(mq OPTION IDEM_WITH_REDIS TARGETS idem_mq COMPONENTS core redis
               HEADERS idem/mq
               SUMMARY "Redis Streams consumer-group client (part of idem::redis)")
idem_component(postgres OPTION IDEM_WITH_POSTGRES TARGETS idem_postgres COMPONENTS core
               DEPENDS pqxx HEADERS idem/postgres
               SUMMARY "PostgreSQL durable store (libpqxx)")
idem_component(fmt OPTION IDEM_WITH_FMT TARGETS idem_fmt COMPONENTS core DEPENDS fmt
               HEADERS idem/log/fmt_sink.hpp SUMMARY "fmt log sink")
# spdlog's own CMake package looks for fmt (Debian builds it with SPDLOG_FMT_EXTERNAL).
idem_component(spdlog OPTION IDEM_WITH_SPDLOG TARGETS idem_spdlog COMPONENTS core
               DEPENDS fmt spdlog HEADERS idem/log/spdlog_sink.hpp SUMMARY "spdlog log sink")
idem_component(prometheus OPTION IDEM_WITH_PROMETHEUS TARGETS idem_prometheus COMPONENTS core
               DEPENDS prometheus HEADERS idem/prometheus SUMMARY "Prometheus metrics observer")
idem_component(http OPTION IDEM_WITH_HTTP TARGETS idem_http COMPONENTS core
               DEPENDS httplib nlohmann_json
               HEADERS idem/http/httplib.hpp SUMMARY "cpp-httplib adapter of the HTTP layer")
# rabbitmq-c 0.11 (Debian librabbitmq-dev) installs a CMake config with rabbitmq::rabbitmq; its
# pkg-config file librabbitmq is the fallback. Linked PRIVATE by idem::rabbitmq.
idem_dependency(rabbitmq-c FIND "CONFIG rabbitmq-c rabbitmq::rabbitmq" "PKG_CONFIG librabbitmq"
                PKG_CONFIG librabbitmq DEB librabbitmq-dev)
idem_component(rabbitmq OPTION IDEM_WITH_RABBITMQ TARGETS idem_rabbitmq COMPONENTS core
               PRIVATE_DEPENDS rabbitmq-c libssl HEADERS idem/rabbitmq
               SUMMARY "RabbitMQ consumer loop and publisher (rabbitmq-c)")
# grpc++ and protobuf are part of idem::grpc's API (Method::handle takes grpc::ServerContextBase,
# grpc::Status and protobuf messages). Debian 12 ships gRPCConfig.cmake and no protobuf CMake
# config: protobuf comes from CMake's FindProtobuf. gRPC's config prints "Could NOT find c-ares"
# on Debian: harmless.
idem_dependency(protobuf FIND "MODULE Protobuf protobuf::libprotobuf"
                PKG_CONFIG protobuf DEB libprotobuf-dev)
idem_dependency(grpc FIND "CONFIG gRPC gRPC::grpc++" PKG_CONFIG grpc++
                DEB libgrpc++-dev)
idem_component(grpc OPTION IDEM_WITH_GRPC TARGETS idem_grpc COMPONENTS core
               DEPENDS protobuf grpc HEADERS idem/grpc
               SUMMARY "idempotent unary gRPC methods (grpc++)")
# MariaDB Connector/C (libmariadb-dev; speaks to MySQL 5.7/8.x and MariaDB): no CMake config on
# Debian, pkg-config only. Linked PRIVATE by idem::mysql (its headers never include it).
idem_dependency(mariadb FIND "PKG_CONFIG libmariadb" PKG_CONFIG libmariadb DEB libmariadb-dev)
idem_component(mysql OPTION IDEM_WITH_MYSQL TARGETS idem_mysql COMPONENTS core
               PRIVATE_DEPENDS mariadb HEADERS idem/mysql
               SUMMARY "MySQL / MariaDB durable store (MariaDB Connector/C)")
# idem::async: Boost.Asio by default (header-only: Debian libboost-dev, whose BoostConfig.cmake
# gives Boost::headers), or standalone Asio with IDEM_ASIO_STANDALONE (libasio-dev: headers
# only, no package file; idem::async then names its include directory itself).
# idem::async_postgres drives libpq itself (its asynchronous API and pipeline mode: libpqxx has
# neither), linked PRIVATE; CMake's FindPostgreSQL gives PostgreSQL::PostgreSQL, pkg-config
# libpq is the fallback.
idem_dependency(boost FIND "CONFIG Boost Boost::headers" DEB libboost-dev)
if(IDEM_ASIO_STANDALONE)
  set(_idem_asio_dependency "")
else()
  set(_idem_asio_dependency boost)
endif()
idem_component(async OPTION IDEM_WITH_ASYNC TARGETS idem_async COMPONENTS core
               DEPENDS ${_idem_asio_dependency} threads
               HEADERS idem/async/call.hpp idem/async/function.hpp idem/async/guard.hpp
                       idem/async/net.hpp idem/async/pooled_durable.hpp idem/async/store.hpp
                       idem/async/worker_pool.hpp
               SUMMARY "asynchronous guard on Asio (header-only)")
idem_component(async_redis OPTION IDEM_WITH_ASYNC TARGETS idem_async_redis
               COMPONENTS async redis PRIVATE_DEPENDS hiredis
               HEADERS idem/async/redis_store.hpp
               SUMMARY "Redis fast store on hiredis's asynchronous API, driven by Asio")
idem_dependency(libpq FIND "MODULE PostgreSQL PostgreSQL::PostgreSQL" "PKG_CONFIG libpq"
                PKG_CONFIG libpq DEB libpq-dev)
idem_component(async_postgres OPTION IDEM_WITH_ASYNC TARGETS idem_async_postgres
               COMPONENTS async postgres PRIVATE_DEPENDS libpq
               HEADERS idem/async/postgres_store.hpp
               SUMMARY "PostgreSQL durable store on libpq's pipeline, driven by Asio")
