// SPDX-License-Identifier: MIT
// idem::mq::RedisStreams, the Redis Streams consumer-group client: it is part of the Redis
// adapter (idem/redis/streams.hpp, target idem::redis); this header keeps the path under which
// it was first published, for the component idem::mq.
#pragma once

#include "idem/redis/streams.hpp"
