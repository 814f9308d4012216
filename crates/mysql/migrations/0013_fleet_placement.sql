-- shardlock_placement: per fleet, the placements its processes last ran while they agreed,
-- oldest first (the one moved away from while a move was in force, then the current one), as
-- JSON: each shard's name, weight and identity, and the ring's virtual nodes. A process
-- started onto a changed config after every process of its fleet stopped (none left to
-- reload) reads it and moves from it as a reload would: fences, rows kept past their
-- release, jobs and CAS locks are carried from the shards its keys left. `seq` rises with
-- every record a fleet writes, each over the one its writer read (compare and set): of the
-- records on its shards, a start takes the newest.
CREATE TABLE IF NOT EXISTS shardlock_placement (
  fleet      VARBINARY(100)  NOT NULL,
  seq        BIGINT UNSIGNED NOT NULL,
  placements MEDIUMTEXT      NOT NULL,
  PRIMARY KEY (fleet)
) ENGINE=InnoDB;
