-- shardlock_instance.servers: a digest of which database each shard name of the topology the
-- process that beat last runs reaches (each name with the shard id migration 5 stores in its
-- database); NULL from versions before this migration. A topology's fingerprint leaves URLs
-- out (one database has many), so two processes with the same fingerprint may still reach one
-- shard name at two databases: their digests differ, and a start, or a reload's move, waits.
ALTER TABLE shardlock_instance
  ADD COLUMN servers VARCHAR(64) CHARACTER SET ascii NULL;
