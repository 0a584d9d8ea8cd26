-- SPDX-License-Identifier: MIT
-- idem's MySQL / MariaDB tables, for DBAs who apply DDL by hand (MysqlStoreOptions::migrate =
-- false). The same DDL as MysqlStore::migrate(), schema version 1: the seed tables'
-- columns plus idem's (fingerprint, owner, lease_until, expires_at, attempts). Safe to run
-- twice. InnoDB, utf8mb4; key columns compare bytes (ascii_bin); times are UTC (idem writes
-- UTC_TIMESTAMP(3)); response_body is binary-safe (longblob).
--
--   mysql payments < mysql_schema.sql
--
-- To adopt an existing api_idempotency of the seed's shape instead, see docs/mysql.md.

CREATE TABLE IF NOT EXISTS idem_schema_version (
  name       varchar(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY,
  version    int NOT NULL,
  applied_at datetime(3) NOT NULL
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;

-- HTTP/API idempotency records: one row per (idempotency key, business type).
CREATE TABLE IF NOT EXISTS api_idempotency (
  id            bigint NOT NULL AUTO_INCREMENT,
  idem_key      varchar(128) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
  biz_type      varchar(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
  status        varchar(32) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,  -- in_progress, completed, failed
  response_body longblob,                                    -- replayed to duplicates, byte for byte
  created_at    datetime(3) NOT NULL,                        -- UTC
  updated_at    datetime(3) NOT NULL,                        -- UTC
  fingerprint   varbinary(255) NOT NULL DEFAULT '',          -- the request payload's hash
  owner         varchar(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL DEFAULT '',  -- fencing
  lease_until   datetime(3) NULL,                            -- in_progress: honoured until then (UTC)
  expires_at    datetime(3) NULL,                            -- completed/failed: purgeable after (UTC)
  attempts      int NOT NULL DEFAULT 1,                      -- 1 + lease takeovers
  PRIMARY KEY (id),
  UNIQUE KEY uk_idem_key_biz_type (idem_key, biz_type),
  KEY idx_idem_expires_at (expires_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;
-- The version row only for a table with idem's columns: one that existed in the seed's shape
-- keeps none, so that MysqlStoreOptions::adopt_existing_table can still adopt it.
INSERT INTO idem_schema_version (name, version, applied_at)
  SELECT 'api_idempotency', 1, UTC_TIMESTAMP(3) FROM information_schema.COLUMNS
   WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'api_idempotency' AND COLUMN_NAME = 'lease_until'
  ON DUPLICATE KEY UPDATE name = name;

-- MQ consume records: one row per (message id, consumer group).
CREATE TABLE IF NOT EXISTS mq_consume_record (
  id             bigint NOT NULL AUTO_INCREMENT,
  message_id     varchar(128) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
  consumer_group varchar(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
  status         varchar(32) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
  response_body  longblob,
  created_at     datetime(3) NOT NULL,
  updated_at     datetime(3) NOT NULL,
  fingerprint    varbinary(255) NOT NULL DEFAULT '',
  owner          varchar(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL DEFAULT '',
  lease_until    datetime(3) NULL,
  expires_at     datetime(3) NULL,
  attempts       int NOT NULL DEFAULT 1,
  PRIMARY KEY (id),
  UNIQUE KEY uk_msg_group (message_id, consumer_group),
  KEY idx_idem_expires_at (expires_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;
-- The version row only for a table with idem's columns: one that existed in the seed's shape
-- keeps none, so that MysqlStoreOptions::adopt_existing_table can still adopt it.
INSERT INTO idem_schema_version (name, version, applied_at)
  SELECT 'mq_consume_record', 1, UTC_TIMESTAMP(3) FROM information_schema.COLUMNS
   WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'mq_consume_record' AND COLUMN_NAME = 'lease_until'
  ON DUPLICATE KEY UPDATE name = name;
