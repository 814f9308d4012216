-- shardlock_job.origin: for a job carried to this shard after a reload moved its queue, its
-- move's key (a hash of the shard id, id and origin it had on the shard it came from); for a
-- job enqueued here, its enqueue's request id. Unique, so a carry interrupted and run again,
-- or run by two processes, enqueues each job once.
-- shardlock_job.moved_to: for a job being carried away from this shard (status 'moving' or
-- 'moved'), the identity of the shard it goes to, fixed when the move starts: whoever finishes
-- the move (any process) takes it there and nowhere else.
ALTER TABLE shardlock_job
  ADD COLUMN origin VARBINARY(255) NULL,
  ADD COLUMN moved_to VARBINARY(255) NULL,
  ADD UNIQUE KEY origin (origin);

-- shardlock_cas.token: the acquire call that set the owner (unique per call), so a retry after
-- a lost reply recognises its own grant without taking one owner name's for its own.
ALTER TABLE shardlock_cas ADD COLUMN token VARBINARY(191) NULL;
