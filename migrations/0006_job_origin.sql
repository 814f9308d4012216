-- shardlock_job.origin: for a job carried to this shard after a reload moved its queue, the
-- shard id and job id it had where it was enqueued. Unique, so a carry interrupted and run
-- again enqueues each job once.
ALTER TABLE shardlock_job
  ADD COLUMN origin VARBINARY(255) NULL,
  ADD UNIQUE KEY origin (origin);
