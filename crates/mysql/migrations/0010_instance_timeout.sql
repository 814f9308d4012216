-- shardlock_instance.heartbeat_timeout_ms: the cleaner.heartbeat-timeout of the process that
-- beat last under the instance id; NULL from versions before this migration. Whoever judges
-- the row (a cleaner, a reload's move, a start under the same id) counts the instance live for
-- the longer of its own timeout and this one: a process configured with a longer timeout than
-- the reader's (a rolling change of the setting) stops granting, by its own clock, before
-- anyone counts it dead.
ALTER TABLE shardlock_instance
  ADD COLUMN heartbeat_timeout_ms BIGINT UNSIGNED NULL;
