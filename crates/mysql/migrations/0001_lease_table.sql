-- shardlock lease table: one row per lock key ever granted on this shard.
--
-- lock_key     the key's UTF-8 bytes, compared byte for byte (binary, no collation): `Order:1`
--              and `order:1` are different locks. Keys over 255 bytes are stored as 0xFF
--              followed by the key's SHA-256 (0xFF never occurs in UTF-8).
-- owner        '<instance id>:<start nonce>:<grant seq>' of the holder. Once released, a
--              tombstone of the same length (its first byte ':', which starts no owner), or
--              NULL.
-- fence        the highest fencing token reserved by the latest grant: a grant takes the next
--              fence (at least one above the stored one, and at least the shard clock in
--              microseconds) and sets aside a range after it for in-memory hand-offs, storing
--              the top. The clock floor keeps fences rising for a key whose row was deleted;
--              across moves between shards, fences are carried (see migration 5's floor).
-- ttl_ms       the lease length of the latest grant; renewal extends expires_at by it.
-- expires_at   shard clock (UTC, sessions run with time_zone '+00:00') at which the lease ends
--              unless renewed.
-- acquired_at  shard clock of the latest grant.
-- wanted_at    shard clock of the latest failed attempt by another owner; cleared on grant.
CREATE TABLE IF NOT EXISTS shardlock_lease (
  lock_key    VARBINARY(255)  NOT NULL,
  owner       VARBINARY(191)  NULL,
  fence       BIGINT UNSIGNED NOT NULL,
  ttl_ms      INT UNSIGNED    NOT NULL,
  expires_at  DATETIME(3)     NOT NULL,
  acquired_at DATETIME(3)     NOT NULL,
  wanted_at   DATETIME(3)     NULL,
  PRIMARY KEY (lock_key)
) ENGINE=InnoDB DEFAULT CHARSET=binary;
