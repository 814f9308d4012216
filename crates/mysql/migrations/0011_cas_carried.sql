-- shardlock_cas.carried_version: the version a move's carry freed the row at (a carry raises
-- the version by 2); takes, releases and give-backs leave it alone. A carry whose commit's
-- outcome is unknown reads it to learn whether the row was carried (and its copies on the
-- key's new shard are the lock) even after later takes and releases moved the version on.
ALTER TABLE shardlock_cas
  ADD COLUMN carried_version BIGINT UNSIGNED NULL;
