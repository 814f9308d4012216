-- shardlock_instance.shard_name: the name under which the process that beat last reaches the
-- server holding this row (its config's shard name); NULL from versions before this migration.
-- A topology's fingerprint leaves URLs out (one database has many), so two processes with the
-- same fingerprint may still reach one shard name at two servers, or two names at swapped
-- servers: a process whose name for this server differs from the reader's places keys here
-- that the reader places elsewhere, and the reader's start, or its reload's move, waits.
ALTER TABLE shardlock_instance
  ADD COLUMN shard_name VARCHAR(191) CHARACTER SET utf8mb4 NULL;
