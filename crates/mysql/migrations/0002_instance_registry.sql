-- shardlock instance registry: one row per instance (process) that uses this shard, kept by the
-- `heartbeat` registry. The cleaner deletes an expired lease only when its owner's instance is
-- dead here: deregistered, or silent for longer than `cleaner.heartbeat-timeout`.
--
-- instance_id     the first part of every owner the instance writes (`<instance id>:<seq>`).
-- host, pid       where it runs, for operators (`shardlock status`).
-- started_at      shard clock when it first registered here.
-- heartbeat_at    shard clock of its latest heartbeat.
-- deregistered_at shard clock of its clean shutdown; NULL while it runs.
CREATE TABLE IF NOT EXISTS shardlock_instance (
  instance_id     VARBINARY(100) NOT NULL,
  host            VARCHAR(255)   NOT NULL,
  pid             INT UNSIGNED   NOT NULL,
  started_at      DATETIME(3)    NOT NULL,
  heartbeat_at    DATETIME(3)    NOT NULL,
  deregistered_at DATETIME(3)    NULL,
  PRIMARY KEY (instance_id)
) ENGINE=InnoDB DEFAULT CHARSET=binary;
