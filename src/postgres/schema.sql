-- SPDX-License-Identifier: MIT
-- idem's PostgreSQL tables, for DBAs who apply DDL by hand (PostgresStoreOptions::migrate =
-- false). Same DDL as PostgresStore::migrate(), schema version 2 (the unique key is the primary
-- key; version-1 tables, with a bigserial `id`, are left as they are and keep working). Safe to
-- run twice.
--
--   psql -v schema=payments -f schema.sql      (default schema: public)
--   psql -v schema=payments -v partitions=16 -f schema.sql
--        api_idempotency hash-partitioned by (biz_type, idem_key) into 16 partitions
--        api_idempotency_p0..p15 (PostgresStoreOptions::partitions; PostgreSQL 12+)
--
-- Requires psql 10+ (\if). Every statement runs under one advisory lock, in one transaction.
\if :{?schema}
\else
  \set schema public
\endif
\if :{?partitions}
\else
  \set partitions 0
\endif
\set ON_ERROR_STOP on

BEGIN;
SELECT pg_advisory_xact_lock(7306086965236950125);

CREATE SCHEMA IF NOT EXISTS :"schema";

CREATE TABLE IF NOT EXISTS :"schema".idem_schema_version (
  name       text PRIMARY KEY,
  version    integer NOT NULL,
  applied_at timestamptz NOT NULL DEFAULT now()
);

-- HTTP/API idempotency records: one row per (idempotency key, business type).
SELECT (:partitions)::int > 1 AS idem_partitioned \gset
\if :idem_partitioned
-- Partitioned: the primary key contains the partition columns, so it stays one constraint
-- across partitions.
CREATE TABLE IF NOT EXISTS :"schema".api_idempotency (
  idem_key      varchar(128) COLLATE "C" NOT NULL,
  biz_type      varchar(64) COLLATE "C" NOT NULL,
  status        varchar(16) NOT NULL CHECK (status IN ('in_progress', 'completed', 'failed')),
  fingerprint   text NOT NULL DEFAULT '',
  owner         varchar(64) NOT NULL,
  response_body bytea,
  lease_until   timestamptz NOT NULL,
  expires_at    timestamptz,
  attempts      integer NOT NULL DEFAULT 1,
  created_at    timestamptz NOT NULL DEFAULT now(),
  updated_at    timestamptz NOT NULL DEFAULT now(),
  CONSTRAINT api_idempotency_key_uq PRIMARY KEY (idem_key, biz_type)
) PARTITION BY HASH (biz_type, idem_key);
SELECT format('CREATE TABLE IF NOT EXISTS %I.api_idempotency_p%s PARTITION OF'
              ' %I.api_idempotency FOR VALUES WITH (MODULUS %s, REMAINDER %s)',
              :'schema', i, :'schema', :partitions, i)
  FROM generate_series(0, (:partitions)::int - 1) AS i
 WHERE EXISTS (SELECT 1 FROM pg_partitioned_table  -- an existing plain table stays as it is
                WHERE partrelid = format('%I.api_idempotency', :'schema')::regclass) \gexec
\else
CREATE TABLE IF NOT EXISTS :"schema".api_idempotency (
  idem_key      varchar(128) COLLATE "C" NOT NULL,
  biz_type      varchar(64) COLLATE "C" NOT NULL,
  status        varchar(16) NOT NULL CHECK (status IN ('in_progress', 'completed', 'failed')),
  fingerprint   text NOT NULL DEFAULT '',
  owner         varchar(64) NOT NULL,          -- owner token of the attempt (fencing)
  response_body bytea,                         -- replayed to duplicates
  lease_until   timestamptz NOT NULL,          -- in_progress: honoured until then
  expires_at    timestamptz,                   -- completed/failed: purgeable after
  attempts      integer NOT NULL DEFAULT 1,    -- 1 + lease takeovers
  created_at    timestamptz NOT NULL DEFAULT now(),
  updated_at    timestamptz NOT NULL DEFAULT now(),
  CONSTRAINT api_idempotency_key_uq PRIMARY KEY (idem_key, biz_type)
);
\endif
CREATE INDEX IF NOT EXISTS api_idempotency_expires_idx
  ON :"schema".api_idempotency (expires_at) WHERE status <> 'in_progress';
-- The version its layout is: 1 for a table that existed with a bigserial `id`.
INSERT INTO :"schema".idem_schema_version (name, version)
  SELECT 'api_idempotency', CASE WHEN EXISTS (SELECT 1 FROM pg_attribute
      WHERE attrelid = format('%I.api_idempotency', :'schema')::regclass AND attname = 'id'
        AND NOT attisdropped) THEN 1 ELSE 2 END
  ON CONFLICT (name) DO NOTHING;

-- MQ consume records: one row per (message id, consumer group).
CREATE TABLE IF NOT EXISTS :"schema".mq_consume_record (
  message_id     varchar(128) COLLATE "C" NOT NULL,
  consumer_group varchar(64) COLLATE "C" NOT NULL,
  status         varchar(16) NOT NULL CHECK (status IN ('in_progress', 'completed', 'failed')),
  fingerprint    text NOT NULL DEFAULT '',
  owner          varchar(64) NOT NULL,
  response_body  bytea,
  lease_until    timestamptz NOT NULL,
  expires_at     timestamptz,
  attempts       integer NOT NULL DEFAULT 1,
  created_at     timestamptz NOT NULL DEFAULT now(),
  updated_at     timestamptz NOT NULL DEFAULT now(),
  CONSTRAINT mq_consume_record_key_uq PRIMARY KEY (message_id, consumer_group)
);
CREATE INDEX IF NOT EXISTS mq_consume_record_expires_idx
  ON :"schema".mq_consume_record (expires_at) WHERE status <> 'in_progress';
-- The version its layout is: 1 for a table that existed with a bigserial `id`.
INSERT INTO :"schema".idem_schema_version (name, version)
  SELECT 'mq_consume_record', CASE WHEN EXISTS (SELECT 1 FROM pg_attribute
      WHERE attrelid = format('%I.mq_consume_record', :'schema')::regclass AND attname = 'id'
        AND NOT attisdropped) THEN 1 ELSE 2 END
  ON CONFLICT (name) DO NOTHING;

COMMIT;
