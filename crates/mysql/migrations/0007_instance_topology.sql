-- shardlock_instance.topology: a fingerprint of the topology the instance runs (shards with
-- their weights and servers, virtual nodes, namespaces' buckets); NULL from versions before
-- this migration.
-- shardlock_instance.moving: 1 while a reload's move is in force in the instance.
-- shardlock_instance.fleet: the processes it shares keys with (`instance.fleet`); only a
-- router's own fleet is compared.
-- A router that starts while another live instance runs another topology, or is still moving
-- keys, grants nothing until the fleet agrees and is at rest: a process started with a new
-- config does not know the placement the others still use.
ALTER TABLE shardlock_instance
  ADD COLUMN topology VARBINARY(64) NULL,
  ADD COLUMN moving TINYINT NOT NULL DEFAULT 0,
  ADD COLUMN fleet VARBINARY(100) NULL;
