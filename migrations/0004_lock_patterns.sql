-- Tables of the other lock patterns (shardlock::patterns).
--
-- shardlock_txlock: one row per key locked with `SELECT ... FOR UPDATE` inside a transaction
-- (`LockRouter::lock_in_transaction`); the row is created on first use and only ever locked.
CREATE TABLE IF NOT EXISTS shardlock_txlock (
  lock_key VARBINARY(255) NOT NULL,
  PRIMARY KEY (lock_key)
) ENGINE=InnoDB DEFAULT CHARSET=binary;

-- shardlock_cas: version compare-and-set locks (`LockRouter::cas_acquire`): owner is NULL when
-- free; every acquire and release bumps version.
CREATE TABLE IF NOT EXISTS shardlock_cas (
  lock_key VARBINARY(255)  NOT NULL,
  owner    VARBINARY(191)  NULL,
  version  BIGINT UNSIGNED NOT NULL,
  PRIMARY KEY (lock_key)
) ENGINE=InnoDB DEFAULT CHARSET=binary;
