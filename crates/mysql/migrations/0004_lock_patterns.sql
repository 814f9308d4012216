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

-- shardlock_job: job claims (`LockRouter::enqueue_job`, `claim_job`, ...). status is ready,
-- claimed, done or failed; a claimed job whose lease_until passed is claimed again (retry_count
-- + 1) while retry_count <= max_retries.
CREATE TABLE IF NOT EXISTS shardlock_job (
  id          BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,
  queue       VARBINARY(255)  NOT NULL,
  payload     BLOB            NOT NULL,
  status      VARCHAR(16)     NOT NULL,
  due_at      DATETIME(3)     NOT NULL,
  locked_by   VARBINARY(191)  NULL,
  locked_at   DATETIME(3)     NULL,
  lease_until DATETIME(3)     NULL,
  retry_count INT UNSIGNED    NOT NULL,
  max_retries INT UNSIGNED    NOT NULL,
  PRIMARY KEY (id),
  KEY due (queue, status, due_at)
) ENGINE=InnoDB DEFAULT CHARSET=binary;
